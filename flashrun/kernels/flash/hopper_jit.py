"""The FA3-style Hopper (sm_90) forward in Gluon, Triton 3.6's API: the kernel only. The gate,
launcher and first-use check are in :mod:`flashrun.kernels.flash.hopper`; the maths in
:mod:`flashrun.kernels.flash`.

A tile is ``CONSUMERS`` x 64 query rows of one (batch, head). Each program runs a loop over tiles
(tile ``pid``, ``pid + programs``, ...): launched with one program per tile it runs once; with
fewer programs (one or two per SM) it is persistent, and the producer loads the next tile's Q and
first K/V blocks while the consumers still finish this one (FA3's cross-tile prefetch, the piece a
plain persistent Triton loop lacked: NOTES v3, change 4). Tiles go head by head (the
programs running at once share K/V in L2), causal ones heaviest first within a head, or where all
heads' K/V fit in L2 heaviest first across the heads (:func:`~flashrun.kernels.flash.jit.tile_of`).
Three kinds of partition (``gl.warp_specialize``):
  * producer (worker, 1 warp, few registers): TMA loads of Q (one 64-row half per consumer, once
    the consumer has released the previous tile's) and of K/V blocks into a ring of ``STAGES``
    shared-memory stages that runs on across tiles; per stage a K-ready and a V-ready mbarrier
    (expect-tx) and an empty mbarrier that every consumer arrives on;
  * ``CONSUMERS`` consumers (the default partition and, with two, a 4-warp worker; one warpgroup
    each, 240 registers): consumer c owns rows [64c, 64c + 64) of the tile. Per key block:
    S = Q Kᵀ (async wgmma, K from shared memory; Q from shared memory too, or with ``Q_REGS``
    from registers, loaded once per tile, which frees Q's buffer for the next tile at once and
    halves what S reads from shared memory), online softmax in base 2 in registers,
    P cast to fp16/bf16 in registers as the A operand of O += P V (async wgmma, V from shared
    memory), then the stage is released. Two warpgroups run the same loop on the same stages,
    so the SM scheduler interleaves one's softmax with the other's wgmma; one (64-row tiles, half
    the shared memory) lets two programs share an SM instead;
  * ``OVERLAP`` (FA3's intra-warpgroup pipelining): S for block j+1 is issued before block j's
    softmax, so the tensor cores work while this warpgroup does exp2; P V of block j is waited
    for only at the next iteration.

Head dims: register tensors and TMA boxes are powers of two, wgmma's N need not be. A head dim
that is not one runs as two column blocks, ``HEAD_D0`` + ``HEAD_D1`` (192 = 128 + 64), as the
portable kernel does: Q, K and V each have two descriptors and two shared buffers, S sums two
wgmmas (K = 128 and K = 64), O is two accumulators ([64, 128] and [64, 64], two P V wgmmas).
``HEAD_D1 = 0``: one block.

Descriptors are 4-D over (batch, heads, seq, head_dim) with boxes [1, 1, rows, HEAD_D0 or HEAD_D1]:
the copy engine zero-fills rows past a head's sequence, so a neighbouring head's rows (NaN
included) never reach the tile. Keys past N_K are masked to -inf in the last block; query rows
past N_Q are computed on zeros and never stored (masked pointer stores of LSE, and of O; or
``TMA_O``, the overlapped loop where every tile sees a key: O leaves by TMA stores through the
tile's last stage, whose descriptors clip rows past N_Q, :func:`_store_through`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashrun.kernels.flash.jit import tile_of

# Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load (3.9 keeps
# the old name as a stub that raises)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
LOG2E = 1.4426950408889634
HALF_M = 64  # rows of the tile per consumer warpgroup (wgmma's M is 64 per warpgroup)
LOG2E_C = gl.constexpr(LOG2E)
HALF_M_C = gl.constexpr(HALF_M)
P_SHIFT_C = gl.constexpr(8.0)  # fp8_jit.P_SHIFT: P in [0, 2^8] before its cast to e4m3


@gluon.jit
def _tile(t, Z, H, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
          ACROSS: gl.constexpr):
    """Tile t's (batch, head, first query row, key blocks to visit); ACROSS: tile_of's order.
    Causal tiles differ in cost, and a persistent program takes every programs-th tile: were the
    programs a multiple of a head's tiles (132 SMs, 4 tiles of 128 rows at 512 keys), each would
    get the same rank every round - some all the heaviest tiles, some all the lightest. So every
    other round the programs take the round's tiles in reverse (a serpentine): a program's
    heavy tile in one round is paired with a light one in the next; a round still covers the
    same consecutive tiles (the same heads in L2). One program per tile: one round, unchanged."""
    n_m = gl.cdiv(N_Q, BLOCK_M)
    if CAUSAL:  # the last query tiles see the most keys: start them first (tile_of)
        programs = gl.num_programs(0)
        first = (t // programs) * programs  # the round's first tile
        in_round = gl.minimum(programs, n_m * Z * H - first)  # its tiles (the last round may be short)
        if (t // programs) % 2 == 1:
            t = first + in_round - 1 - (t - first)
        off_hz, rank = tile_of(t, Z * H, n_m, ACROSS)
        start_m = (n_m - 1 - rank) * BLOCK_M
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + N_K - N_Q, 0), N_K)
    else:
        # a head's tiles side by side: the programs running at once share a few heads' K/V in L2
        # (in the order of all heads' last tiles first they would each stream their own head's,
        # and at 4096 keys and 128 heads need about the HBM's whole bandwidth)
        off_hz = t // n_m
        start_m = (t % n_m) * BLOCK_M
        hi = N_K
    return off_hz // H, off_hz % H, start_m, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _unmasked_blocks(first_row, shift, N_K, n_blocks, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many of the first key blocks every one of the 64 rows from ``first_row`` sees whole (no
    mask); the rest (the causal diagonal, the ragged end) are masked. ``shift``: N_K - N_Q."""
    n_full = N_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(gl.maximum(first_row + shift + 1, 0) // BLOCK_N, n_full)
    return gl.minimum(n_full, n_blocks)


@gluon.jit
def _load_rows(desc, desc1, z, h, row, bar, dst, dst1, HEAD_D0: gl.constexpr, SPLIT: gl.constexpr):
    """TMA-load rows [row, row + box) of (z, h) into dst (and the second column block into dst1),
    completing ``bar`` once every byte has landed."""
    if SPLIT:
        mbarrier.expect(bar, desc.block_type.nbytes + desc1.block_type.nbytes)
        _tma_load(desc, [z, h, row, 0], bar, dst)
        _tma_load(desc1, [z, h, row, HEAD_D0], bar, dst1)
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
        _tma_load(desc, [z, h, row, 0], bar, dst)


@gluon.jit
def _producer(q_desc, q1_desc, k_desc, k1_desc, v_desc, v1_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem, v1_smem,
              q_bars, q_empty, k_bars, v_bars, empty_bars, Z, H, N_Q, N_K,
              GROUP: gl.constexpr, HEAD_D0: gl.constexpr, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, ACROSS: gl.constexpr,
              FP8: gl.constexpr, K_GROUPS: gl.constexpr):
    n_tiles = gl.cdiv(N_Q, CONSUMERS * HALF_M_C) * Z * H
    it = 0  # K/V blocks loaded so far: the ring's position runs on across tiles
    tile_i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        off_z, off_h, start_m, n_blocks = _tile(t, Z, H, N_Q, N_K, CONSUMERS * HALF_M_C, BLOCK_N, CAUSAL, ACROSS)
        # Q: each consumer's 64 rows on its own barrier, loaded once that consumer is done with the
        # previous tile's (a fresh mbarrier counts as having completed the phase before 0)
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(c), (tile_i & 1) ^ 1)
            _load_rows(q_desc, q1_desc, off_z, off_h, start_m + c * HALF_M_C, q_bars.index(c), q_smem.index(c),
                       q1_smem.index(c), HEAD_D0, SPLIT)
        for i in range(n_blocks):
            s = it % STAGES
            free = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(empty_bars.index(s), free)  # K's half of the stage, released once S has read it
            if K_GROUPS:  # 16-key groups (B H_KV N' / 16, 2, 4, 2, D), each head's keys padded to 16: _key_columns
                group = (off_z * (H // GROUP) + off_h // GROUP) * gl.cdiv(N_K, 16) + i * (BLOCK_N // 16)
                mbarrier.expect(k_bars.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [group, 0, 0, 0, 0], k_bars.index(s), k_smem.index(s))
            else:
                _load_rows(k_desc, k1_desc, off_z, off_h // GROUP, i * BLOCK_N, k_bars.index(s), k_smem.index(s),
                           k1_smem.index(s), HEAD_D0, SPLIT)
            mbarrier.wait(empty_bars.index(STAGES + s), free)  # V's, once P V has
            if FP8:  # Vᵀ, (head dim, keys) boxes: the K-major B operand an fp8 wgmma needs
                mbarrier.expect(v_bars.index(s), v_desc.block_type.nbytes)
                _tma_load(v_desc, [off_z, off_h // GROUP, 0, i * BLOCK_N], v_bars.index(s), v_smem.index(s))
            else:
                _load_rows(v_desc, v1_desc, off_z, off_h // GROUP, i * BLOCK_N, v_bars.index(s), v_smem.index(s),
                           v1_smem.index(s), HEAD_D0, SPLIT)
            it += 1
        tile_i += 1


@gluon.jit
def _softmax_block(s_val, m_i, l_i, cols, rows, N_K, shift, qk_scale,
                   MASKED: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr):
    """One key block's online-softmax step in base 2: (p, alpha, m_new, l_new). FP8: p in
    [0, 2^P_SHIFT] (``fp8_jit.P_SHIFT``), before its cast to e4m3; l carries the same factor."""
    if MASKED:
        keep = gl.expand_dims(cols, 0) < N_K
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        # masked before the scale, which like the unmasked step's follows the row max (qk_scale > 0;
        # masking the scaled S held both at once: a spill on Triton 3.9 with Q in registers)
        s_val = gl.where(keep, s_val, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_val, 1) * qk_scale)
        s_val = s_val * qk_scale
        if CAUSAL:
            # a row that has seen no key yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # (every row sees the block's first key)
            m_sub = m_new
    else:
        m_new = gl.maximum(m_i, gl.max(s_val, 1) * qk_scale)
        s_val = s_val * qk_scale
        m_sub = m_new
    if FP8:
        p = gl.exp2(s_val - gl.expand_dims(m_sub - P_SHIFT_C, 1))
    else:
        p = gl.exp2(s_val - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr):
    """Block i's softmax step: unmasked below ``n_unmasked``, masked from there."""
    if i < n_unmasked:
        p, alpha, m_new, l_new = _softmax_block(s_val, m_i, l_i, i * BLOCK_N + offs_n, rows, N_K, shift, qk_scale,
                                                False, CAUSAL, FP8)
    else:
        p, alpha, m_new, l_new = _softmax_block(s_val, m_i, l_i, i * BLOCK_N + offs_n, rows, N_K, shift, qk_scale,
                                                True, CAUSAL, FP8)
    return p, alpha, m_new, l_new


@gluon.jit
def _qk(q, q1, k_smem, k1_smem, s, s_zero, BLOCK_N: gl.constexpr, HEAD_D0: gl.constexpr, HEAD_D1: gl.constexpr):
    """Issue S = Q Kᵀ on stage s (one async wgmma, or two summed over the column blocks)."""
    k = k_smem.index(s).reshape([BLOCK_N, HEAD_D0]).permute((1, 0))
    s_tok = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
    if HEAD_D1 > 0:
        k1 = k1_smem.index(s).reshape([BLOCK_N, HEAD_D1]).permute((1, 0))
        s_tok = warpgroup_mma(q1, k1, s_tok, is_async=True)
    return s_tok


@gluon.jit
def _pv(p_op, v_smem, v1_smem, s, acc, acc1, BLOCK_N: gl.constexpr, HEAD_D0: gl.constexpr, HEAD_D1: gl.constexpr,
        p1_layout: gl.constexpr, FP8: gl.constexpr = False):
    """Issue O += P V on stage s (one async wgmma per column block): (acc's token, acc1's token, the
    second block's P operand, which like P must stay alive until its wgmma is done). FP8: the
    stage holds Vᵀ (head dim x keys), read as V transposed (K-major, as an fp8 wgmma wants)."""
    if FP8:
        v = v_smem.index(s).reshape([HEAD_D0, BLOCK_N]).permute((1, 0))
    else:
        v = v_smem.index(s).reshape([BLOCK_N, HEAD_D0])
    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
    if FP8:  # (one column block)
        p1_op = p_op
        o1_tok = acc1
    elif HEAD_D1 > 0:
        p1_op = gl.convert_layout(p_op, p1_layout)  # the same registers (layouts equal but for N)
        o1_tok = warpgroup_mma(p1_op, v1_smem.index(s).reshape([BLOCK_N, HEAD_D1]), acc1, is_async=True)
    else:
        p1_op = p_op
        o1_tok = acc1  # unused: a [64, 16] placeholder the compiler drops
    return o_tok, o1_tok, p1_op


@gluon.jit
def _key_columns(BLOCK_N: gl.constexpr, layout: gl.constexpr, K_GROUPS: gl.constexpr):
    """The key (from the block's first) that each column of S holds. K_GROUPS: K's rows land in shared
    memory in 16-key groups permuted (the producer's descriptor, ``hopper._key_group_descriptor``):
    column 16a + 8g + 2i + j holds key 16a + 4i + 2g + j, so that the accumulator's registers hold P
    already as an 8-bit A operand wants it (:func:`_p_operand`)."""
    c = gl.arange(0, BLOCK_N, layout=layout)
    if K_GROUPS:
        c = (c // 16) * 16 + ((c // 2) % 4) * 4 + ((c // 8) % 2) * 2 + c % 2
    return c


@gluon.jit
def _p_operand(p, p_smem, p_layout: gl.constexpr, dtype: gl.constexpr, FP8: gl.constexpr, P_REGS: gl.constexpr):
    """P as P V's A operand: in registers, or FP8 without P_REGS through this consumer's shared
    tile, once the previous P V has read it (the caller waits first). FP8 with P_REGS: a thread's
    accumulator holds columns 8g + 2i + j (j, g in {0, 1}, i its lane's quad position, per 16) where
    an 8-bit A operand wants keys 4i + 2g + j: relabeling the columns (a register rename, no data
    moves) gives the keys in order, as K's permuted rows made them (:func:`_key_columns`); Triton's
    own conversion moves the bytes across lanes. An H100: the loop without the overlap ran 1.05-1.10x
    faster so (no warpgroup barrier before P V), the overlapped ones 0.52-0.93x."""
    if FP8 and not P_REGS:
        p_smem.store(p.to(dtype))
        fence_async_shared()
        p_op = p_smem
    else:
        p_op = p.to(dtype)
        if FP8:
            M: gl.constexpr = p.shape[0]
            N: gl.constexpr = p.shape[1]
            p_op = gl.reshape(gl.permute(gl.reshape(p_op, [M, N // 16, 2, 4, 2]), [0, 1, 3, 2, 4]), [M, N])
        p_op = gl.convert_layout(p_op, p_layout)
    return p_op


@gluon.jit
def _pv_wait(o_tok, o1_tok, p_op, p1_op, HEAD_D1: gl.constexpr, FP8: gl.constexpr = False):
    """Wait for every wgmma in flight (the P V ones last): (acc, acc1), the P operands kept alive
    until then. FP8: not P, which the wait cannot hold ("Unexpected bitwidth in WGMMAWaitGroupOp"
    with 8-bit operands, Triton 3.6 and 3.9); its registers are written again only after this
    wait (the loop's next P), and ptxas serializes a wgmma whose inputs are written while in flight
    (warning C7515, which compile_hopper.py reports: none for these kernels)."""
    if FP8:
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        acc1 = o1_tok
    elif HEAD_D1 > 0:
        acc, acc1, p_op, p1_op = warpgroup_mma_wait(0, deps=(o_tok, o1_tok, p_op, p1_op))
    else:
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        acc1 = o1_tok
    return acc, acc1


@gluon.jit
def _store_rows(O, base, rows, n_q, stride_om, acc, COL0: gl.constexpr, WIDTH: gl.constexpr, layout: gl.constexpr,
                dtype: gl.constexpr):
    """Store acc (64 rows, WIDTH columns from COL0) to O's rows below n_q."""
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = O + base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc.to(dtype), mask=gl.expand_dims(rows < n_q, 1))


@gluon.jit
def _consumer(q_smem, q1_smem, k_smem, k1_smem, v_smem, v1_smem, p_smem, q_bars, q_empty, k_bars, v_bars, empty_bars,
              k_done, v_done, O, LSE, o_desc, o1_desc, stride_oz, stride_oh, stride_om, stride_lz, stride_lh, Z, H, N_Q, N_K,
              qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, stride_dz, stride_dh,
              C: gl.constexpr, GROUP: gl.constexpr, HEAD_D0: gl.constexpr, HEAD_D1: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              OVERLAP: gl.constexpr, ACROSS: gl.constexpr, TMA_O: gl.constexpr, Q_REGS: gl.constexpr,
              FP8: gl.constexpr, P_REGS: gl.constexpr):
    D1: gl.constexpr = HEAD_D1 if HEAD_D1 > 0 else 16  # the second block's width (a placeholder without one)
    PV_OPS: gl.constexpr = 2 if HEAD_D1 > 0 else 1  # wgmmas per P V
    INSTR_K: gl.constexpr = 32 if FP8 else 16  # a wgmma's K: 32 bytes of its operands' rows
    OP_WIDTH: gl.constexpr = 4 if FP8 else 2  # register operands: 32 bits of elements per register
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D0, INSTR_K])
    o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D1, INSTR_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=OP_WIDTH)
    p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=OP_WIDTH)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=OP_WIDTH)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_o1: gl.constexpr = gl.SliceLayout(1, o1_layout)
    dtype: gl.constexpr = q_smem.dtype
    # TMA_O: where this consumer's rows of O leave (_store_through): rows [64 C, 64 C + 64) of the
    # last stage's K tile, or where that tile holds fewer than the tile's rows (192: 64 keys, two
    # consumers), consumer 0 through K's tile and consumer 1 through V's
    K_AND_V: gl.constexpr = TMA_O and BLOCK_N < CONSUMERS * HALF_M_C
    VIA_V: gl.constexpr = K_AND_V and C == 1
    O_ROW0: gl.constexpr = 0 if K_AND_V else C * HALF_M_C
    # Q_REGS: which of Q's column blocks S takes from registers. Both but where a second block
    # meets a causal mask: there the first stays in shared memory (with both in registers
    # Triton 3.9 spilled the causal consumer, NOTES v28). Q_FREE: Q's buffer is free once loaded,
    # where its first block is in registers (a second one then is too).
    Q0_REGS: gl.constexpr = Q_REGS and (HEAD_D1 == 0 or not CAUSAL)
    Q1_REGS: gl.constexpr = Q_REGS and HEAD_D1 > 0
    Q_FREE: gl.constexpr = Q0_REGS

    q_view = q_smem.index(C).reshape([HALF_M_C, HEAD_D0])
    if HEAD_D1 > 0:
        q1_view = q1_smem.index(C).reshape([HALF_M_C, HEAD_D1])
    else:
        q1_view = q_view
    s_zero = gl.zeros([HALF_M_C, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = _key_columns(BLOCK_N, col_s, P_REGS)
    n_tiles = gl.cdiv(N_Q, CONSUMERS * HALF_M_C) * Z * H
    it = 0  # K/V blocks consumed so far (the producer's ring position)
    tile_i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        off_z, off_h, start_m, n_blocks = _tile(t, Z, H, N_Q, N_K, CONSUMERS * HALF_M_C, BLOCK_N, CAUSAL, ACROSS)
        first_row = start_m + C * HALF_M_C
        rows = first_row + gl.arange(0, HALF_M_C, layout=row_s)
        shift = N_K - N_Q  # bottom-right alignment: row i faces key i + shift
        n_unmasked = _unmasked_blocks(first_row, shift, N_K, n_blocks, BLOCK_N, CAUSAL)
        if FP8:  # q's and k's descales join the scale; v's the normalization (per batch and kv head)
            descale = off_z * stride_dz + (off_h // GROUP) * stride_dh
            scale = qk_scale * gl.load(Q_DESCALE + descale) * gl.load(K_DESCALE + descale)
        else:
            scale = qk_scale
        m_i = gl.full([HALF_M_C], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([HALF_M_C], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([HALF_M_C, HEAD_D0], gl.float32, layout=o_layout)
        acc1 = gl.zeros([HALF_M_C, D1], gl.float32, layout=o1_layout)

        mbarrier.wait(q_bars.index(C), tile_i & 1)
        # Q as wgmma's register operand (Q_REGS): S reads only K from shared memory
        if Q0_REGS:
            q = q_view.load(q_layout)
        else:
            q = q_view
        if Q1_REGS:
            q1 = q1_view.load(q_layout)
        else:
            q1 = q1_view
        if Q_FREE:
            mbarrier.arrive(q_empty.index(C), count=1)  # the producer may load the next tile's Q
        if OVERLAP:
            # FA3's intra-warpgroup pipelining: S of block i is issued, then P V of block i - 1, and
            # block i's softmax runs while that P V is on the tensor cores. wgmma groups complete in
            # issue order, so waiting for all but the P V ones in flight waits for S only.
            if n_blocks > 0:
                mbarrier.wait(k_bars.index(it % STAGES), (it // STAGES) & 1)
                s_tok = _qk(q, q1, k_smem, k1_smem, it % STAGES, s_zero, BLOCK_N, HEAD_D0, HEAD_D1)
                s_val = warpgroup_mma_wait(0, deps=(s_tok,))
                p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, 0, n_unmasked, offs_n, rows, N_K, shift,
                                                   scale, BLOCK_N, CAUSAL, FP8)
                p_op = _p_operand(p, p_smem.index(C), p_layout, dtype, FP8, P_REGS)  # acc is still 0: no rescale
                for i in range(1, n_blocks):
                    s = (it + i) % STAGES
                    prev = (it + i - 1) % STAGES
                    # block i - 1's S is done: its K goes back now, so that with two stages block
                    # i + 1's K loads during this step (V once P V has read it, below)
                    mbarrier.arrive(empty_bars.index(prev), count=1)
                    mbarrier.wait(k_bars.index(s), ((it + i) // STAGES) & 1)
                    mbarrier.wait(v_bars.index(prev), ((it + i - 1) // STAGES) & 1)
                    s_tok = _qk(q, q1, k_smem, k1_smem, s, s_zero, BLOCK_N, HEAD_D0, HEAD_D1)
                    o_tok, o1_tok, p1_op = _pv(p_op, v_smem, v1_smem, prev, acc, acc1, BLOCK_N, HEAD_D0, HEAD_D1,
                                               p1_layout, FP8)
                    s_val = warpgroup_mma_wait(PV_OPS, deps=(s_tok,))
                    p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift,
                                                       scale, BLOCK_N, CAUSAL, FP8)
                    acc, acc1 = _pv_wait(o_tok, o1_tok, p_op, p1_op, HEAD_D1, FP8)
                    mbarrier.arrive(empty_bars.index(STAGES + prev), count=1)  # P V has read V
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    if HEAD_D1 > 0:
                        acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, row_o1), 1)
                    p_op = _p_operand(p, p_smem.index(C), p_layout, dtype, FP8, P_REGS)
                if not Q_FREE:
                    mbarrier.arrive(q_empty.index(C), count=1)  # the last S is done: the producer may load the next Q
                if TMA_O:
                    mbarrier.arrive(k_done, count=1)  # ... and has read the last stage's K
                last = (it + n_blocks - 1) % STAGES
                mbarrier.wait(v_bars.index(last), ((it + n_blocks - 1) // STAGES) & 1)
                o_tok, o1_tok, p1_op = _pv(p_op, v_smem, v1_smem, last, acc, acc1, BLOCK_N, HEAD_D0, HEAD_D1, p1_layout,
                                           FP8)
                acc, acc1 = _pv_wait(o_tok, o1_tok, p_op, p1_op, HEAD_D1, FP8)
                if K_AND_V:  # ... and its last P V has read the last stage's V
                    mbarrier.arrive(v_done, count=1)
                if not TMA_O:  # (else the stage goes back once O has left it, below)
                    mbarrier.arrive(empty_bars.index(last), count=1)
                    mbarrier.arrive(empty_bars.index(STAGES + last), count=1)
            elif not Q_FREE:
                mbarrier.arrive(q_empty.index(C), count=1)
        else:
            for i in range(n_blocks):
                s = (it + i) % STAGES
                phase = ((it + i) // STAGES) & 1
                mbarrier.wait(k_bars.index(s), phase)
                s_val = warpgroup_mma_wait(0, deps=(_qk(q, q1, k_smem, k1_smem, s, s_zero, BLOCK_N, HEAD_D0, HEAD_D1),))
                mbarrier.arrive(empty_bars.index(s), count=1)  # S has read K
                p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift,
                                                   scale, BLOCK_N, CAUSAL, FP8)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                if HEAD_D1 > 0:
                    acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, row_o1), 1)
                p_op = _p_operand(p, p_smem.index(C), p_layout, dtype, FP8, P_REGS)
                mbarrier.wait(v_bars.index(s), phase)
                o_tok, o1_tok, p1_op = _pv(p_op, v_smem, v1_smem, s, acc, acc1, BLOCK_N, HEAD_D0, HEAD_D1, p1_layout, FP8)
                acc, acc1 = _pv_wait(o_tok, o1_tok, p_op, p1_op, HEAD_D1, FP8)
                mbarrier.arrive(empty_bars.index(STAGES + s), count=1)  # P V has read V
            if not Q_FREE:
                mbarrier.arrive(q_empty.index(C), count=1)

        # epilogue: normalize; a row that saw no key outputs 0 and LSE = -inf
        seen = l_i > 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        inv_l = 1.0 / l_safe  # one reciprocal per row, a multiply per output
        if FP8:
            inv_l = inv_l * gl.load(V_DESCALE + descale)
            lse = gl.where(seen, (m_i + gl.log2(l_safe) - P_SHIFT_C) / LOG2E_C, float("-inf"))
        else:
            lse = gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E_C, float("-inf"))
        off_z64 = off_z.to(gl.int64)
        gl.store(LSE + off_z64 * stride_lz + off_h * stride_lh + rows, lse, mask=rows < N_Q)
        if TMA_O:  # (only where every tile sees a key, n_blocks > 0: a stage to store through)
            # every consumer's last S has read the last stage's K (its last P V the stage's V)
            last = (it + n_blocks - 1) % STAGES
            if VIA_V:
                mbarrier.wait(v_done, tile_i & 1)
                _store_through(acc, acc1, inv_l, v_smem, v1_smem, empty_bars, o_desc, o1_desc, off_z, off_h,
                               first_row, last, O_ROW0, HEAD_D1)
            else:
                mbarrier.wait(k_done, tile_i & 1)
                _store_through(acc, acc1, inv_l, k_smem, k1_smem, empty_bars, o_desc, o1_desc, off_z, off_h,
                               first_row, last, O_ROW0, HEAD_D1)
        else:
            base = off_z64 * stride_oz + off_h * stride_oh
            acc = acc * gl.expand_dims(gl.convert_layout(inv_l, row_o), 1)
            _store_rows(O, base, first_row + gl.arange(0, HALF_M_C, layout=row_o), N_Q, stride_om, acc,
                        0, HEAD_D0, o_layout, O.dtype.element_ty)
            if HEAD_D1 > 0:
                acc1 = acc1 * gl.expand_dims(gl.convert_layout(inv_l, row_o1), 1)
                _store_rows(O, base, first_row + gl.arange(0, HALF_M_C, layout=row_o1), N_Q, stride_om, acc1,
                            HEAD_D0, HEAD_D1, o1_layout, O.dtype.element_ty)
        it += n_blocks
        tile_i += 1


@gluon.jit
def _store_through(acc, acc1, inv_l, ring, ring1, empty_bars, o_desc, o1_desc, off_z, off_h, first_row, last,
                   ROW0: gl.constexpr, HEAD_D1: gl.constexpr):
    """TMA_O: this consumer's 64 rows of O (float32 ``acc`` and, with a second column block,
    ``acc1``; normalized here by ``inv_l``, the second block once the first has left its
    registers: normalized before the wait both at once spilled on Triton 3.9) out by TMA stores
    through rows [ROW0, ROW0 + 64) of the tile's last stage ``last`` of ``ring`` and ``ring1``
    (the K or the V blocks; once every consumer is done with them: the caller waits on
    ``k_done`` or ``v_done``, which each consumer arrives on with Q's release or after its last
    P V), then the stage (its K and V halves) back to the producer once the stores have read it.
    Rows past N_Q are clipped by the copy engine. (From the wgmma accumulator's layout a thread
    stores 2 elements of a row per 8-column group, half of each 32-byte sector a warp touches:
    those stores cost every Gluon forward 2-16 % more than these, more at short lengths: NOTES v26.)"""
    HEAD_D0: gl.constexpr = acc.shape[1]
    BLOCK_N: gl.constexpr = ring.shape[3]
    STAGES: gl.constexpr = ring.shape[0]
    tile = ring.index(last)
    acc = acc * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, acc.type.layout)), 1)
    # (a reshaped subslice is not implemented: the rows are sliced twice, as O's box and as a 2-D view)
    tile.reshape([BLOCK_N, HEAD_D0]).slice(ROW0, HALF_M_C, dim=0).store(acc.to(ring.dtype))
    if HEAD_D1 > 0:
        acc1 = acc1 * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, acc1.type.layout)), 1)
        tile1 = ring1.index(last)
        tile1.reshape([BLOCK_N, HEAD_D1]).slice(ROW0, HALF_M_C, dim=0).store(acc1.to(ring.dtype))
    fence_async_shared()
    _tma_store(o_desc, [off_z, off_h, first_row, 0], tile.slice(ROW0, HALF_M_C, dim=2))
    if HEAD_D1 > 0:
        _tma_store(o1_desc, [off_z, off_h, first_row, HEAD_D0], tile1.slice(ROW0, HALF_M_C, dim=2))
    tma.store_wait(0)
    mbarrier.arrive(empty_bars.index(last), count=1)
    mbarrier.arrive(empty_bars.index(STAGES + last), count=1)


# lengths, heads and LSE's strides (multiples of N) are not specialized on divisibility by 16:
# one compile serves every N
@gluon.jit(do_not_specialize=["Z", "H", "N_Q", "N_K", "stride_lz", "stride_lh"])
def _fa3_fwd(q_desc, q1_desc, k_desc, k1_desc, v_desc, v1_desc, O, LSE, o_desc, o1_desc,
             stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
             Z, H, N_Q, N_K, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, stride_dz, stride_dh,
             GROUP: gl.constexpr, HEAD_D0: gl.constexpr, HEAD_D1: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACROSS: gl.constexpr, TMA_O: gl.constexpr,
             Q_REGS: gl.constexpr, FP8: gl.constexpr):
    """q_desc: 4-D descriptor over q (B, H, N_Q, D), box [1, 1, 64, HEAD_D0]; k_desc, v_desc over k,
    v (B, H_KV, N_K, D), box [1, 1, BLOCK_N, HEAD_D0]; the *1_desc the same with HEAD_D1 columns
    from column HEAD_D0 (HEAD_D1 = 0: unused, pass the first ones again). O: (B, H, N_Q, D), last
    dim contiguous; LSE (B, H, N_Q) float32. Grid: (programs,), each looping over tiles
    pid, pid + programs, ... of the cdiv(N_Q, 64 CONSUMERS) x B x H tiles; CAUSAL with ACROSS,
    every head's heaviest tiles first (``jit.tile_of``). Launch with num_warps=4 (the default
    partition, consumer 0)."""
    # TMA_O: a consumer's 64 rows of O go through a K or V tile (two consumers: one each where a tile holds 64 rows)
    gl.static_assert(not TMA_O or (OVERLAP and BLOCK_N >= HALF_M_C))
    gl.static_assert(STAGES >= 2 or not OVERLAP)  # OVERLAP holds block i - 1's stage while loading block i
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(not FP8 or (HEAD_D1 == 0 and not TMA_O and not Q_REGS))  # (a bf16 O is no e4m3 tile's size)
    # FP8's P: in registers without the overlap (K's rows in 16-key groups), else through a shared tile
    # (_p_operand); the host's K descriptor follows (hopper.launch_args)
    P_REGS: gl.constexpr = FP8 and not OVERLAP
    SPLIT: gl.constexpr = HEAD_D1 > 0
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if SPLIT:
        q1_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q1_desc.block_type.shape, q1_desc.layout)
        k1_smem = gl.allocate_shared_memory(dtype, [STAGES] + k1_desc.block_type.shape, k1_desc.layout)
        v1_smem = gl.allocate_shared_memory(dtype, [STAGES] + v1_desc.block_type.shape, v1_desc.layout)
    else:  # never read: the first blocks stand in
        q1_smem = q_smem
        k1_smem = k_smem
        v1_smem = v_smem
    if FP8 and not P_REGS:  # each consumer's P, P V's A operand (_p_operand)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M_C, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF_M_C, BLOCK_N], p_layout)
    else:  # never touched
        p_smem = q_smem
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # a stage's K and V go back to the producer apart (K's at s, V's at STAGES + s): K once S has
    # read it, so that with two stages the next K loads while P V still reads this stage's V
    empty_bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    # TMA_O: every consumer's last S (P V) of the tile is done: the last stage's K (V) is free for O
    k_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(k_done, count=CONSUMERS)
    mbarrier.init(v_done, count=CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=CONSUMERS)  # every consumer releases a stage's K
        mbarrier.init(empty_bars.index(STAGES + s), count=CONSUMERS)  # ... and its V
    fence_async_shared()

    # the argument tuples are written in the call: a tuple assigned to a variable first would
    # turn its constexprs (C, BLOCK_N, ...) into tensors
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_smem, q1_smem, k_smem, k1_smem, v_smem, v1_smem, p_smem, q_bars, q_empty, k_bars, v_bars,
                         empty_bars, k_done, v_done, O, LSE, o_desc, o1_desc, stride_oz, stride_oh, stride_om, stride_lz,
                         stride_lh, Z, H, N_Q, N_K, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, stride_dz,
                         stride_dh, 0, GROUP, HEAD_D0, HEAD_D1, BLOCK_N, STAGES, CONSUMERS, CAUSAL, OVERLAP, ACROSS,
                         TMA_O, Q_REGS, FP8, P_REGS)),
            (_consumer, (q_smem, q1_smem, k_smem, k1_smem, v_smem, v1_smem, p_smem, q_bars, q_empty, k_bars, v_bars,
                         empty_bars, k_done, v_done, O, LSE, o_desc, o1_desc, stride_oz, stride_oh, stride_om, stride_lz,
                         stride_lh, Z, H, N_Q, N_K, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, stride_dz,
                         stride_dh, 1, GROUP, HEAD_D0, HEAD_D1, BLOCK_N, STAGES, CONSUMERS, CAUSAL, OVERLAP, ACROSS,
                         TMA_O, Q_REGS, FP8, P_REGS)),
            (_producer, (q_desc, q1_desc, k_desc, k1_desc, v_desc, v1_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem,
                         v1_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, Z, H, N_Q, N_K,
                         GROUP, HEAD_D0, SPLIT, BLOCK_N, STAGES, CONSUMERS, CAUSAL, ACROSS, FP8, P_REGS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, q1_smem, k_smem, k1_smem, v_smem, v1_smem, p_smem, q_bars, q_empty, k_bars, v_bars,
                         empty_bars, k_done, v_done, O, LSE, o_desc, o1_desc, stride_oz, stride_oh, stride_om, stride_lz,
                         stride_lh, Z, H, N_Q, N_K, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, stride_dz,
                         stride_dh, 0, GROUP, HEAD_D0, HEAD_D1, BLOCK_N, STAGES, CONSUMERS, CAUSAL, OVERLAP, ACROSS,
                         TMA_O, Q_REGS, FP8, P_REGS)),
            (_producer, (q_desc, q1_desc, k_desc, k1_desc, v_desc, v1_desc, q_smem, q1_smem, k_smem, k1_smem, v_smem,
                         v1_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, Z, H, N_Q, N_K,
                         GROUP, HEAD_D0, SPLIT, BLOCK_N, STAGES, CONSUMERS, CAUSAL, ACROSS, FP8, P_REGS)),
        ], [1], [PRODUCER_REGS])
