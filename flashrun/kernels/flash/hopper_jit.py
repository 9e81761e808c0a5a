"""The FA3-style Hopper (sm_90) forward in Gluon, Triton 3.6's API: the kernel only. The gate,
launcher and first-use check are in :mod:`flashrun.kernels.flash.hopper`; the maths in
:mod:`flashrun.kernels.flash`.

One program owns a 128-row query tile of one (batch, head) and runs three partitions
(``gl.warp_specialize``):
  * producer (worker, 1 warp, few registers): TMA loads of Q (once, one 64-row half per
    consumer) and of K/V blocks into a ring of ``STAGES`` shared-memory stages; per stage a
    K-ready and a V-ready mbarrier (expect-tx) and an empty mbarrier that both consumers arrive on;
  * two consumers (the default partition and a 4-warp worker, one warpgroup each, 240
    registers): consumer c owns rows [64c, 64c + 64) of the tile. Per key block:
    S = Q Kᵀ (async wgmma, Q and K from shared memory), online softmax in base 2 in registers,
    P cast to fp16/bf16 in registers as the A operand of O += P V (async wgmma, V from shared
    memory), then the stage is released. The two warpgroups run the same loop on the same stages,
    so the SM scheduler interleaves one's softmax with the other's wgmma.
  * ``OVERLAP`` (FA3's intra-warpgroup pipelining): S for block j+1 is issued before block j's
    softmax, so the tensor cores work while this warpgroup does exp2; P V of block j is waited
    for only at the next iteration.
  * ``PINGPONG`` (with OVERLAP; FA3's inter-warpgroup schedule): the two consumers take turns
    issuing their round of wgmmas (S of j+1 and P V of j) through a pair of mbarriers, so one
    warpgroup's softmax runs while the other's matmuls hold the tensor cores.

Descriptors are 4-D over (batch, heads, seq, head_dim) with boxes [1, 1, rows, head_dim]: the copy
engine zero-fills rows past a head's sequence, so a neighbouring head's rows (NaN included) never
reach the tile. Keys past N_K are masked to -inf in the last block; query rows past N_Q are
computed on zeros and never stored (masked pointer stores of O and LSE).
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

# Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load (3.9 keeps
# the old name as a stub that raises)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
LOG2E = 1.4426950408889634
HALF_M = 64  # rows of the tile per consumer warpgroup (wgmma's M is 64 per warpgroup)
BLOCK_M = 2 * HALF_M
LOG2E_C = gl.constexpr(LOG2E)
HALF_M_C = gl.constexpr(HALF_M)
BLOCK_M_C = gl.constexpr(BLOCK_M)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars,
              off_z, off_h, off_hkv, start_m, n_blocks,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # Q once: each consumer's 64 rows on its own barrier, so consumer 0 need not wait for 1's half
    for c in gl.static_range(2):
        bar = q_bars.index(c)
        mbarrier.expect(bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [off_z, off_h, start_m + c * HALF_M_C, 0], bar, q_smem.index(c))
    for i in range(n_blocks):
        s = i % STAGES
        phase = (i // STAGES) & 1
        # a fresh mbarrier counts as having completed the phase before 0: the first lap runs through
        mbarrier.wait(empty_bars.index(s), phase ^ 1)
        kb = k_bars.index(s)
        mbarrier.expect(kb, k_desc.block_type.nbytes)
        _tma_load(k_desc, [off_z, off_hkv, i * BLOCK_N, 0], kb, k_smem.index(s))
        vb = v_bars.index(s)
        mbarrier.expect(vb, v_desc.block_type.nbytes)
        _tma_load(v_desc, [off_z, off_hkv, i * BLOCK_N, 0], vb, v_smem.index(s))


@gluon.jit
def _softmax_block(s_val, m_i, l_i, cols, rows, N_K, shift, qk_scale,
                   MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """One key block's online-softmax step in base 2: (p, alpha, m_new, l_new)."""
    if MASKED:
        keep = gl.expand_dims(cols, 0) < N_K
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        s_val = gl.where(keep, s_val * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_val, 1))
        # a row that has seen no key yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(s_val, 1) * qk_scale)
        s_val = s_val * qk_scale
        m_sub = m_new
    p = gl.exp2(s_val - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _take_turn(turn_bars, i, C: gl.constexpr):
    """PINGPONG: wait until warpgroup C may issue its i-th round of wgmmas. The warpgroups take
    turns (0 first): each arrives on the other's barrier once it has issued a round, so one
    issues while the other runs its softmax (FA3's ping-pong; Gluon 3.6 has no named barriers).
    They alternate strictly, so a parity wait never falls two phases behind."""
    if C == 0:
        mbarrier.wait(turn_bars.index(0), (i & 1) ^ 1)  # a fresh barrier passes parity 1: round 0 is free
    else:
        mbarrier.wait(turn_bars.index(1), i & 1)


@gluon.jit
def _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Block i's softmax step: unmasked below ``n_unmasked``, masked from there."""
    if i < n_unmasked:
        p, alpha, m_new, l_new = _softmax_block(s_val, m_i, l_i, i * BLOCK_N + offs_n, rows, N_K, shift, qk_scale,
                                                False, CAUSAL)
    else:
        p, alpha, m_new, l_new = _softmax_block(s_val, m_i, l_i, i * BLOCK_N + offs_n, rows, N_K, shift, qk_scale,
                                                True, CAUSAL)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE,
              stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
              off_z, off_h, start_m, n_blocks, N_Q, N_K, qk_scale,
              C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    first_row = start_m + C * HALF_M_C
    rows = first_row + gl.arange(0, HALF_M_C, layout=row_s)
    shift = N_K - N_Q  # bottom-right alignment: row i faces key i + shift
    # blocks every row of this half sees whole need no mask; the rest (causal diagonal, ragged end) do
    n_full = N_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(gl.maximum(first_row + shift + 1, 0) // BLOCK_N, n_full)
    n_unmasked = gl.minimum(n_full, n_blocks)

    q = q_smem.index(C).reshape([HALF_M_C, HEAD_DIM])
    m_i = gl.full([HALF_M_C], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([HALF_M_C], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([HALF_M_C, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_M_C, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)

    mbarrier.wait(q_bars.index(C), 0)
    if OVERLAP:
        # FA3's intra-warpgroup pipelining: S of block i is issued, then P V of block i - 1, and
        # block i's softmax runs while that P V is on the tensor cores. wgmma groups complete in
        # issue order, so waiting for all but one in flight waits for S only.
        if n_blocks > 0:
            mbarrier.wait(k_bars.index(0), 0)
            if PINGPONG:
                _take_turn(turn_bars, 0, C)
            s_tok = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_bars.index(1 - C), count=1)
            s_val = warpgroup_mma_wait(0, deps=(s_tok,))
            p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, 0, n_unmasked, offs_n, rows, N_K, shift, qk_scale,
                                               BLOCK_N, CAUSAL)
            p_op = gl.convert_layout(p.to(dtype), p_layout)  # acc is still 0: no rescale
            for i in range(1, n_blocks):
                s = i % STAGES
                prev = (i - 1) % STAGES
                mbarrier.wait(k_bars.index(s), (i // STAGES) & 1)
                mbarrier.wait(v_bars.index(prev), ((i - 1) // STAGES) & 1)
                if PINGPONG:
                    _take_turn(turn_bars, i, C)
                s_tok = warpgroup_mma(q, k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                o_tok = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                if PINGPONG:  # the other warpgroup may issue its wgmmas while this one runs its softmax
                    mbarrier.arrive(turn_bars.index(1 - C), count=1)
                s_val = warpgroup_mma_wait(1, deps=(s_tok,))
                p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift,
                                                   qk_scale, BLOCK_N, CAUSAL)
                acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))  # p_op: live until its wgmma is done
                mbarrier.arrive(empty_bars.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            last = n_blocks - 1
            mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(empty_bars.index(last % STAGES), count=1)
    else:
        for i in range(n_blocks):
            s = i % STAGES
            phase = (i // STAGES) & 1
            k = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
            v = v_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(k_bars.index(s), phase)
            s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_val = warpgroup_mma_wait(0, deps=(s_tok,))
            p, alpha, m_i, l_i = _softmax_step(s_val, m_i, l_i, i, n_unmasked, offs_n, rows, N_K, shift, qk_scale,
                                               BLOCK_N, CAUSAL)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_bars.index(s), phase)
            o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(empty_bars.index(s), count=1)

    # epilogue: normalize; a row that saw no key outputs 0 and LSE = -inf
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E_C, float("-inf"))
    acc = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    off_z64 = off_z.to(gl.int64)
    gl.store(LSE + off_z64 * stride_lz + off_h * stride_lh + rows, lse, mask=rows < N_Q)
    rows_o = first_row + gl.arange(0, HALF_M_C, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    o_ptrs = (O + off_z64 * stride_oz + off_h * stride_oh + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1)
              + gl.expand_dims(cols_o, 0))
    gl.store(o_ptrs, acc.to(dtype), mask=gl.expand_dims(rows_o < N_Q, 1))


# lengths, heads and LSE's strides (multiples of N) are not specialized on divisibility by 16:
# one compile serves every N
@gluon.jit(do_not_specialize=["H", "N_Q", "N_K", "stride_lz", "stride_lh"])
def _fa3_fwd(q_desc, k_desc, v_desc, O, LSE,
             stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
             H, N_Q, N_K, qk_scale,
             GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
             PRODUCER_REGS: gl.constexpr):
    """q_desc: 4-D descriptor over q (B, H, N_Q, D), box [1, 1, 64, D]; k_desc, v_desc over k, v
    (B, H_KV, N_K, D), box [1, 1, BLOCK_N, D]. O: (B, H, N_Q, D), last dim contiguous; LSE
    (B, H, N_Q) float32. Launch with num_warps=4 (the default partition, consumer 0)."""
    gl.static_assert(STAGES >= 2 or not OVERLAP)  # OVERLAP holds block i - 1's stage while loading block i
    gl.static_assert(OVERLAP or not PINGPONG)  # the turns are taken in the OVERLAP loop
    pid_m = gl.program_id(0)
    if CAUSAL:  # the last query tiles see the most keys: start them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M_C
    off_hz = gl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    off_hkv = off_h // GROUP
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M_C + N_K - N_Q, 0), N_K)
    else:
        hi = N_K
    n_blocks = gl.cdiv(hi, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG
    for c in gl.static_range(2):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(turn_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=2)  # both consumers release a stage
    fence_async_shared()

    # the argument tuples are written in the call: a tuple assigned to a variable first would
    # turn its constexprs (C, BLOCK_N, ...) into tensors
    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE,
                     stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                     off_z, off_h, start_m, n_blocks, N_Q, N_K, qk_scale,
                     0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, PINGPONG)),
        (_consumer, (k_smem, v_smem, q_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE,
                     stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                     off_z, off_h, start_m, n_blocks, N_Q, N_K, qk_scale,
                     1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars,
                     off_z, off_h, off_hkv, start_m, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
