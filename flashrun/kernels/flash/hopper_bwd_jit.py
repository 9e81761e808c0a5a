"""The FA3-layout Hopper (sm_90) backward in Gluon (NOTES v6 "Design 2", v8, v10):
the kernel only. The gate and launcher are in :mod:`flashrun.kernels.flash.hopper_bwd`; the
maths is in :mod:`flashrun.kernels.flash`. dK/dV always; dQ either stays with the portable
``_attn_bwd_dq`` (7 matmuls per tile pair in all, the deterministic backward) or is computed here
(``FUSED_DQ``, 5 matmuls: see :func:`_dq_step`).

Why: the Triton dK/dV kernel holds K, V and both float32 accumulators in one 8-warp program at
255 registers, one program per SM, nothing overlapping one warpgroup's exp2 with the tensor cores
but the other warpgroup in lock-step with it (NOTES v6: 44 % of the matmul roof against cuDNN's 60 %).
FlashAttention-3 (Shah et al., 2024) splits the work across specialized warps instead.

A program owns ``CONSUMERS`` x 64 keys (128 with two consumers) of one k/v head and walks every
query block that sees them, for every query head of the GQA group in turn (head-major, one flat
loop: dK/dV sum over the group without atomics, as the Triton kernel folds them). Three
partitions (``gl.warp_specialize``):
  * producer (worker, 1 warp, 24 registers): TMA loads of each consumer's 64 K and V rows once,
    then per query block of Q with its rows' LSE and of dO with their delta into a ring of
    ``STAGES`` shared-memory stages; per stage a Q-ready and a dO-ready mbarrier (expect-tx) and
    an empty mbarrier that every consumer arrives on;
  * ``CONSUMERS`` consumers (the default partition and a 4-warp worker, one warpgroup each, 240
    registers through setmaxnreg): consumer c owns keys [64c, 64c + 64) of the block, its K_c and
    V_c in shared memory and dK_c, dV_c (64 x HEAD_D float32 each) in registers. Per query block:
        dPᵀ − delta = V_c dOᵀ − delta   async wgmma from shared memory, accumulator set to −delta
        Sᵀ = K_c Qᵀ                       async wgmma from shared memory
        Pᵀ = exp2(Sᵀ · qk_scale − LSE · log2 e)        (masked on the causal diagonal)
        dV_c += Pᵀ dO                     async wgmma, Pᵀ in fp16/bf16 registers as the A operand
        dSᵀ = Pᵀ ∘ (dPᵀ − delta)                        (while dV's wgmma runs)
        dK_c += dSᵀ Q                     async wgmma, dSᵀ in registers as the A operand
    then the stage is released. Two warpgroups run the same loop on the same stages, so the SM's
    schedulers interleave one's exp2 and dS with the other's wgmmas. dK is scaled by sm_scale once,
    at the end, as the Triton kernel does.

Registers per consumer thread at HEAD_D = 128, BLOCK_M = 64: dK_c + dV_c 2 x 64 x 128 / 128 = 128,
Sᵀ/Pᵀ and dPᵀ/dSᵀ 2 x 32 float32 and Pᵀ's operand 16 at the peak (208), leaving ~30 of the 240 for
addresses and loop state. A per-query vector (LSE, delta) costs 16 more in Sᵀ's layout (each
thread holds 16 of its 64 columns), which is why LSE comes from shared memory right before its
use and delta rides in dPᵀ's accumulator (both measured: with the vectors in registers ptxas
spilled 12-228 bytes at head_dim 128).

Head dims that are not a power of two run as two column blocks, ``HEAD_D`` + ``HEAD_D1`` (96 = 64 +
32, 80 = 64 + 16; register tensors and TMA boxes are powers of two), as the Gluon forward runs
192: each tile of Q, dO, K and V comes as two boxes on one barrier, Sᵀ and dPᵀ sum two wgmmas
(one per block), dK_c and dV_c are two accumulators each, and with dQ inside consumer 0 adds dQ's
first block and consumer 1 its second. At 96: dK_c + dV_c 96 registers a thread (no spill).

Edges. Descriptors are 4-D over (batch, heads, seq, head_dim) with boxes [1, 1, rows, HEAD_D] (and
3-D over LSE/delta's (batch, heads, seq)), so the copy engine zero-fills rows past a head's
sequence: a neighbouring head's rows, NaN included, never reach a tile. Query rows past N_Q load
q = dO = 0 and LSE = delta = 0, so P = 1 there but dV += P · 0 and dS = P · (0 − 0): they add
exactly 0. Keys past N_K load as 0 and only ever reach their own rows of dK and dV (row j of dV is
Σ_i Pᵀ_ji dO_i), which are never stored: they need no mask. A row that sees no key has
LSE = -inf: its LSE · log2 e is taken as +inf, so P = exp2(s − inf) = 0, not NaN. Causal with
Nq != Nk is aligned bottom-right: query i sees keys j <= i + N_K − N_Q; the query blocks before
the first row that sees the block's first key are not visited, and only blocks on the diagonal
(some row misses some key of this consumer's 64) pay for the mask. A window (left, right) sees keys
[i + shift − left, i + shift + right]: the query blocks visited are those between the first row
that sees the block's first key and the last that sees its last, and the mask is paid on both of
the window's edges.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashrun.kernels.flash.jit import _softcap_r

# Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load (3.9 keeps
# the old name as a stub that raises)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor``):
    Triton 3.6 has the op (its Triton-language descriptors' atomic_add lowers to it) but no Gluon
    wrapper; later releases name it ``tma.async_atomic_add``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36
LOG2E = 1.4426950408889634
HALF_N = 64  # keys per consumer warpgroup (wgmma's M is 64 per warpgroup)
LOG2E_C = gl.constexpr(LOG2E)
HALF_N_C = gl.constexpr(HALF_N)
DQ_COLS = 64  # the transposed kernel's dQ tiles (_fa3_bwd_dkdv_t)
DQ_COLS_C = gl.constexpr(DQ_COLS)


@gluon.jit
def _query_blocks(start_n, N_Q, N_K, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(first query block, query blocks from there) that see some key of the BLOCK_N keys at
    start_n. Query i faces key i + shift (shift = N_K - N_Q, bottom-right alignment): causal, key
    j is seen from row j - shift on; WINDOW, by rows [j - shift - right, j - shift + left]."""
    n_m = gl.cdiv(N_Q, BLOCK_M)
    shift = N_K - N_Q
    if WINDOW:
        first = gl.minimum(gl.maximum(start_n - shift - right, 0), N_Q) // BLOCK_M
        end = gl.cdiv(gl.minimum(gl.maximum(start_n + BLOCK_N - shift + left, 0), N_Q), BLOCK_M)
        count = gl.maximum(end - first, 0)
    elif CAUSAL:
        first = gl.minimum(gl.maximum(start_n - shift, 0) // BLOCK_M, n_m)
        count = n_m - first
    else:
        first = n_m * 0  # (a tensor, as in the other branches)
        count = n_m
    return first, count


@gluon.jit
def _key_tile(BLOCK_N: gl.constexpr, BLOCKS_LAST: gl.constexpr):
    """This program's (first key of its BLOCK_N, k/v head or GQA part, batch entry). BLOCKS_LAST: the launcher put
    the key blocks on the grid's last axis (``hopper_bwd.launch_args``, causal or windowed where
    the heads' Q and dO are few enough, ``args.across_heads``): programs start x fastest, so the first key blocks of every
    head, seen by the most queries, start first and the grid ends on light programs. (Indices from
    the grid, not computed: the head_dim 128 kernel spilled 4-16 B on Triton 3.6 with them kept
    in registers.)"""
    if BLOCKS_LAST:
        block = gl.program_id(2)
        off_hkv = gl.program_id(0)
        off_z = gl.program_id(1)
    else:
        block = gl.program_id(0)
        off_hkv = gl.program_id(1)
        off_z = gl.program_id(2)
    return block * BLOCK_N, off_hkv, off_z


@gluon.jit
def _next_block(off_h, start_m, first_m, end_m, BLOCK_M: gl.constexpr):
    """The loop step after (query head off_h, first row start_m): the next query block, or at
    end_m the next query head of the GQA group from its first block (head-major)."""
    start_m += BLOCK_M
    wrap = start_m >= end_m
    return gl.where(wrap, off_h + 1, off_h), gl.where(wrap, first_m, start_m)


@gluon.jit
def _bwd_producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q1_desc, k1_desc, v1_desc, do1_desc,
                  dk_desc, dv_desc, dk1_desc, dv1_desc,
                  q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem,
                  lse_smem, delta_smem, kv_bars, q_bars, do_bars, empty_bars, out_bars, N_Q, N_K, left, right,
                  GROUP: gl.constexpr, KV_SPLIT: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D1: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, BLOCKS_LAST: gl.constexpr, TMA_OUT: gl.constexpr, KV_ADD: gl.constexpr):
    KEYS: gl.constexpr = k_desc.block_type.shape[2]  # each consumer's keys
    start_n, off_hkv, off_z = _key_tile(CONSUMERS * KEYS, BLOCKS_LAST)
    # each consumer's K and V rows, once: they stay in shared memory for the whole loop
    for c in gl.static_range(CONSUMERS):
        key = start_n + c * KEYS
        if HEAD_D1 > 0:  # the second column block from column HEAD_D, on the same barrier
            mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + k1_desc.block_type.nbytes + v1_desc.block_type.nbytes)
            _tma_load(k1_desc, [off_z, off_hkv // KV_SPLIT, key, HEAD_D], kv_bars.index(c), k1_smem.index(c))
            _tma_load(v1_desc, [off_z, off_hkv // KV_SPLIT, key, HEAD_D], kv_bars.index(c), v1_smem.index(c))
        else:
            mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [off_z, off_hkv // KV_SPLIT, key, 0], kv_bars.index(c), k_smem.index(c))
        _tma_load(v_desc, [off_z, off_hkv // KV_SPLIT, key, 0], kv_bars.index(c), v_smem.index(c))
    first, n_m = _query_blocks(start_n, N_Q, N_K, left, right, BLOCK_M, CONSUMERS * KEYS, CAUSAL, WINDOW)
    off_h = off_hkv * GROUP
    start_m = first * BLOCK_M
    for i in range(GROUP * n_m):
        s = i % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the first lap passes
        mbarrier.wait(empty_bars.index(s), ((i // STAGES) & 1) ^ 1)
        # Q with its rows' LSE, dO with their delta: rows past N_Q (and past the head) land as zeros
        if HEAD_D1 > 0:
            mbarrier.expect(q_bars.index(s), q_desc.block_type.nbytes + q1_desc.block_type.nbytes
                            + lse_desc.block_type.nbytes)
            _tma_load(q1_desc, [off_z, off_h, start_m, HEAD_D], q_bars.index(s), q1_smem.index(s))
        else:
            mbarrier.expect(q_bars.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        _tma_load(q_desc, [off_z, off_h, start_m, 0], q_bars.index(s), q_smem.index(s))
        _tma_load(lse_desc, [off_z, off_h, start_m], q_bars.index(s), lse_smem.index(s))
        if HEAD_D1 > 0:
            mbarrier.expect(do_bars.index(s), do_desc.block_type.nbytes + do1_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
            _tma_load(do1_desc, [off_z, off_h, start_m, HEAD_D], do_bars.index(s), do1_smem.index(s))
        else:
            mbarrier.expect(do_bars.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        _tma_load(do_desc, [off_z, off_h, start_m, 0], do_bars.index(s), do_smem.index(s))
        _tma_load(delta_desc, [off_z, off_h, start_m], do_bars.index(s), delta_smem.index(s))
        off_h, start_m = _next_block(off_h, start_m, first * BLOCK_M, (first + n_m) * BLOCK_M, BLOCK_M)
    if TMA_OUT and KV_ADD == 0:  # the consumers' dK and dV out of their K and V tiles (_hand_over), rows
        # past N_K clipped (with KV_ADD the consumers add theirs themselves: _add_out)
        mbarrier.wait(out_bars.index(1), 0)
        for c in gl.static_range(CONSUMERS):
            key = start_n + c * KEYS
            _tma_store(dk_desc, [off_z, off_hkv, key, 0], k_smem.index(c))
            _tma_store(dv_desc, [off_z, off_hkv, key, 0], v_smem.index(c))
            if HEAD_D1 > 0:
                _tma_store(dk1_desc, [off_z, off_hkv, key, HEAD_D], k1_smem.index(c))
                _tma_store(dv1_desc, [off_z, off_hkv, key, HEAD_D], v1_smem.index(c))
        tma.store_wait(0)


@gluon.jit
def _probs(sT, lse2, offs_m, lo, hi, qk_scale, MASKED: gl.constexpr, WINDOW: gl.constexpr,
           KEY_AXIS: gl.constexpr = 0):
    """Pᵀ = exp2(Sᵀ · qk_scale − lse2) for keys (Sᵀ's rows) x queries start_m + offs_m (its
    columns); MASKED: 0 where query i does not see key j, i.e. where offs_m (per column) < ``lo``
    (per key: causal j − shift − start_m, right of the diagonal; WINDOW j − shift − right −
    start_m) or, WINDOW, offs_m > ``hi`` (j − shift + left − start_m: past the window's left side).
    KEY_AXIS = 1: the keys are the columns, i.e. P = exp2(S · qk_scale − lse2) with S (queries, keys)."""
    QUERY_AXIS: gl.constexpr = 1 - KEY_AXIS
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse2, KEY_AXIS))
    if MASKED:
        keep = gl.expand_dims(lo, QUERY_AXIS) <= gl.expand_dims(offs_m, KEY_AXIS)
        if WINDOW:
            keep = keep & (gl.expand_dims(offs_m, KEY_AXIS) <= gl.expand_dims(hi, QUERY_AXIS))
        pT = gl.where(keep, pT, 0.0)
    return pT


@gluon.jit
def _scored(sT, offs_m, rel, qk_scale, softcap2, slope2, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
            CAUSAL: gl.constexpr):
    """The variants' base-2 scores of Sᵀ (keys x queries start_m + offs_m) as the portable kernels
    make them (``jit._scores``, its fast tanh in the form compiled code takes, ``jit._tanh``'s
    SOFTCAP_FAST_PTX: 4 instructions a score fewer in the sm_90 SASS than the clamped one): SOFTCAP,
    sᵀ = softcap · tanh(Sᵀ · sm_scale / softcap) (qk_scale = sm_scale / softcap, softcap2 =
    softcap · log2 e), returned less softcap2, as −2 softcap2 · rᵀ with rᵀ = 1 / (1 + e^(2 Sᵀ
    qk_scale)) (tanh = 1 − 2r, ``jit._softcap_r``), and rᵀ itself: the caller takes softcap2 + 2
    off its LSE (P comes out 4 P) and dPᵀ − delta times r − r² = (1 − t²) / 4, so that dSᵀ is
    right as 4 P's product and only dV, summed from 4 P, takes a 1/4 at the end: one FMA a
    score fewer than forming t; ALIBI, minus slope2 · |i + shift − j| (slope2 = the head's slope · log2 e),
    i + shift − j being offs_m + ``rel`` (rel = start_m + shift − j per key). CAUSAL keeps only
    i + shift − j >= 0, so the bias splits into a per-key part, subtracted here, and a per-query
    part, slope2 · offs_m, which the caller folds into LSE: no tile of indices, and no second
    per-query vector (16 registers a thread in this layout; the head_dim 128 kernel spilled 32-80 B
    with them). Both parts stay small where P is not: no cancellation. Without SOFTCAP, rᵀ is Sᵀ."""
    if SOFTCAP:
        rT = _softcap_r(sT, qk_scale)
        s2 = rT * (-2.0 * softcap2)
    else:
        rT = sT
        s2 = sT * qk_scale
    if ALIBI:
        if CAUSAL:
            s2 = s2 - gl.expand_dims(slope2 * rel.to(gl.float32), 1)
        else:
            s2 = s2 - slope2 * gl.abs((gl.expand_dims(offs_m, 0) + gl.expand_dims(rel, 1)).to(gl.float32))
    return s2, rT


@gluon.jit
def _store_rows(DST, base, rows, n_rows, stride_m, acc, COL0: gl.constexpr, WIDTH: gl.constexpr,
                layout: gl.constexpr, ADD: gl.constexpr, ROW_AXIS: gl.constexpr = 0):
    """Store acc (its keys x WIDTH columns from COL0; ROW_AXIS = 1: WIDTH x keys, a gradient
    transposed) to DST's rows ``rows`` below n_rows, in DST's dtype (ADD: add it into DST,
    float32, in whatever order the programs land)."""
    COL_AXIS: gl.constexpr = 1 - ROW_AXIS
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(ROW_AXIS, layout))
    ptrs = DST + base + gl.expand_dims(rows.to(gl.int64) * stride_m, COL_AXIS) + gl.expand_dims(cols, ROW_AXIS)
    if ADD:
        gl.atomic_add(ptrs, acc, mask=gl.expand_dims(rows < n_rows, COL_AXIS), sem="relaxed")
    else:
        gl.store(ptrs, acc.to(DST.dtype.element_ty), mask=gl.expand_dims(rows < n_rows, COL_AXIS))


@gluon.jit
def _dq_step(ds_smem, k_smem, dq_tile, ds_bars, dq_desc, off_z, off_h, start_m, par, phase, sm_scale,
             K_COL: gl.constexpr, K_WIDTH: gl.constexpr, OUT_COL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Columns [OUT_COL, OUT_COL + DQ_COLS) of dQ (DQ_COLS: dq_desc's box) of one query block
    against this program's 128 keys, added into the float32 dQ buffer: wait until both consumers'
    dSᵀ halves of the step are in dS stage ``par``, dQ = dS K = Σ_c dS_c K_c (dS_c read transposed
    from shared memory; K_c's columns [K_COL, K_COL + DQ_COLS) of the K_WIDTH that ``k_smem``
    holds), scaled by sm_scale, through ``dq_tile`` by one TMA reduce-add (rows past N_Q are clipped)."""
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    mbarrier.wait(ds_bars.index(par), phase)
    dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
    dq = warpgroup_mma(ds_smem.index(2 * par).permute((1, 0)),
                       k_smem.index(0).reshape([HALF_N_C, K_WIDTH]).slice(K_COL, DQ_COLS, dim=1), dq,
                       use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 * par + 1).permute((1, 0)),
                       k_smem.index(1).reshape([HALF_N_C, K_WIDTH]).slice(K_COL, DQ_COLS, dim=1), dq,
                       is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    tma.store_wait(0)  # the previous reduce-add has read dq_tile
    dq_tile.reshape([BLOCK_M, DQ_COLS]).store(dq * sm_scale)
    fence_async_shared()
    _tma_add(dq_desc, [off_z, off_h, start_m, OUT_COL], dq_tile)


@gluon.jit
def _hand_over(dk, dv, dk1, dv1, k_smem, v_smem, k1_smem, v1_smem, out_bars, C: gl.constexpr, HEAD_D: gl.constexpr,
               HEAD_D1: gl.constexpr, WAIT_OTHERS: gl.constexpr, TRANSPOSED: gl.constexpr):
    """TMA_OUT: this consumer's dK (scaled) and dV, float32 (its keys x HEAD_D and x HEAD_D1;
    TRANSPOSED: head dim x keys), into its own K and V tiles in the input dtype, for the producer
    to store (:func:`_bwd_producer`): V's at once (only this consumer reads it), K's once every
    consumer has arrived on ``out_bars[0]`` (WAIT_OTHERS: the other consumer's dQ steps read it),
    then arrive on ``out_bars[1]``. (Stores from the wgmma accumulator layout write 16 bytes of a
    row per thread and cost the kernel 14-23 % at 1024 keys; from the consumers, any global
    addressing kept for the epilogue spilled the head_dim 128 kernel: NOTES v25.)"""
    dtype: gl.constexpr = k_smem.dtype
    KEYS: gl.constexpr = k_smem.shape[3]  # ([consumer, 1, 1, keys, HEAD_D])
    v_smem.index(C).reshape([KEYS, HEAD_D]).store(_as_rows(dv.to(dtype), TRANSPOSED))
    if HEAD_D1 > 0:
        v1_smem.index(C).reshape([KEYS, HEAD_D1]).store(_as_rows(dv1.to(dtype), TRANSPOSED))
    if WAIT_OTHERS:
        mbarrier.arrive(out_bars.index(0), count=1)
        mbarrier.wait(out_bars.index(0), 0)
    k_smem.index(C).reshape([KEYS, HEAD_D]).store(_as_rows(dk.to(dtype), TRANSPOSED))
    if HEAD_D1 > 0:
        k1_smem.index(C).reshape([KEYS, HEAD_D1]).store(_as_rows(dk1.to(dtype), TRANSPOSED))
    fence_async_shared()
    mbarrier.arrive(out_bars.index(1), count=1)


@gluon.jit
def _add_out(dk, dv, tile, dk_desc, dv_desc, off_z, off_h, key0):
    """TMA_OUT with KV_ADD (a split GQA group's parts adding into float32 dK and dV): add this
    consumer's dK (scaled) and dV, float32 (its keys x the head dim), into dk_desc's and dv_desc's
    head ``off_h`` from row key0 by TMA reduce-adds of the box's columns at a time, each through
    ``tile``, the consumer's dQ tile (free once its last dQ add has read it); rows past N_K are
    clipped. (From the accumulator layout the adds write 8 bytes of a row per thread: NOTES v26.)"""
    COLS: gl.constexpr = dk_desc.block_type.shape[3]
    KEYS: gl.constexpr = dk_desc.block_type.shape[2]
    gl.static_assert(dk.shape[1] == COLS or dk.shape[1] == 2 * COLS)
    if dk.shape[1] == COLS:
        _add_tile(dk, tile, dk_desc, off_z, off_h, key0, 0)
        _add_tile(dv, tile, dv_desc, off_z, off_h, key0, 0)
    else:  # two column halves, split in registers (the accumulator holds a row's halves in separate registers)
        dk0, dk1 = gl.split(gl.permute(gl.reshape(dk, [KEYS, 2, COLS]), (0, 2, 1)))
        dv0, dv1 = gl.split(gl.permute(gl.reshape(dv, [KEYS, 2, COLS]), (0, 2, 1)))
        _add_tile(dv0, tile, dv_desc, off_z, off_h, key0, 0)
        _add_tile(dv1, tile, dv_desc, off_z, off_h, key0, COLS)
        _add_tile(dk0, tile, dk_desc, off_z, off_h, key0, 0)
        _add_tile(dk1, tile, dk_desc, off_z, off_h, key0, COLS)
    tma.store_wait(0)


@gluon.jit
def _add_tile(x, tile, desc, off_z, off_h, key0, COL: gl.constexpr):
    tma.store_wait(0)  # the previous add has read the tile
    tile.reshape(x.shape).store(x)
    fence_async_shared()
    _tma_add(desc, [off_z, off_h, key0, COL], tile)


@gluon.jit
def _as_rows(x, TRANSPOSED: gl.constexpr):
    """x with keys as rows (TRANSPOSED: x is head dim x keys)."""
    if TRANSPOSED:
        return gl.permute(x, (1, 0))
    else:
        return x


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem,
                  ds_smem, dq_smem, dq1_smem, kv_bars, q_bars, do_bars, empty_bars, ds_bars, out_bars, DK, DV,
                  dq_desc, dq1_desc, dk_desc, dv_desc, stride_dkz, stride_dkh, stride_dkn, N_Q,
                  N_K, sm_scale, qk_scale, left, right, softcap2, ALIBI_SLOPES, stride_az, stride_ah,
                  C: gl.constexpr, GROUP: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D1: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, FUSED_DQ: gl.constexpr, KV_ADD: gl.constexpr, BLOCKS_LAST: gl.constexpr,
                  TMA_OUT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    # Sᵀ, dPᵀ: (64 keys, BLOCK_M queries); dK_c, dV_c: (64 keys, HEAD_D) and, with a second column
    # block, (64 keys, HEAD_D1); Pᵀ, dSᵀ as their A operands
    D1: gl.constexpr = HEAD_D1 if HEAD_D1 > 0 else 16  # the second block's width (a placeholder without one)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, D1, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    op1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc1_layout, k_width=2)
    key_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    start_n, off_hkv, off_z = _key_tile(CONSUMERS * HALF_N_C, BLOCKS_LAST)
    key0 = start_n + C * HALF_N_C  # this consumer's first key
    keys = key0 + gl.arange(0, HALF_N_C, layout=key_s)
    offs_m = gl.arange(0, BLOCK_M, layout=query_s)
    shift = N_K - N_Q  # bottom-right alignment: query i faces key i + shift
    # causal: query blocks from this row on see every key of this consumer's 64 (no mask); a
    # window's right side moves that row up by `right`, and its left side ends the unmasked blocks
    # at the last row that sees this consumer's first key, full_from - (HALF_N - 1) + left. Kept
    # as one register beside the arguments (the fused head_dim 128 kernel spilled 16 B on Triton
    # 3.6 with two more)
    full_from = key0 + HALF_N_C - 1 - shift
    first, n_m = _query_blocks(start_n, N_Q, N_K, left, right, BLOCK_M, CONSUMERS * HALF_N_C, CAUSAL, WINDOW)
    ragged = key0 + HALF_N_C > N_K  # keys past N_K: their dSᵀ rows are zeroed before dQ sees them

    k = k_smem.index(C).reshape([HALF_N_C, HEAD_D])
    v = v_smem.index(C).reshape([HALF_N_C, HEAD_D])
    if HEAD_D1 > 0:
        k1 = k1_smem.index(C).reshape([HALF_N_C, HEAD_D1])
        v1 = v1_smem.index(C).reshape([HALF_N_C, HEAD_D1])
    else:  # never read: the first blocks stand in
        k1 = k
        v1 = v
    s_zero = gl.zeros([HALF_N_C, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF_N_C, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N_C, HEAD_D], gl.float32, layout=acc_layout)
    dk1 = gl.zeros([HALF_N_C, D1], gl.float32, layout=acc1_layout)  # (unused without a second block)
    dv1 = gl.zeros([HALF_N_C, D1], gl.float32, layout=acc1_layout)
    # LSE and delta come with Q and dO through the ring and are read right before their use (a
    # per-query vector costs 16 registers a thread here, see the module docstring); −delta goes into
    # dPᵀ's accumulator. That wgmma is issued first: ptxas waits for every wgmma in flight before
    # one whose accumulator registers other instructions defined after the step's first wgmma (the
    # broadcast's register copies, here), which would serialize Sᵀ and dPᵀ
    start_m = first * BLOCK_M
    off_h = off_hkv * GROUP
    s = 0  # the ring's stage and its phase, carried (i % STAGES costs registers when STAGES is not 2^k)
    phase = 0
    mbarrier.wait(kv_bars.index(C), 0)
    for i in range(GROUP * n_m):  # head-major over the GQA group: one flat loop (see the Triton kernel)
        q = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
        do = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
        if HEAD_D1 > 0:
            q1 = q1_smem.index(s).reshape([BLOCK_M, HEAD_D1])
            do1 = do1_smem.index(s).reshape([BLOCK_M, HEAD_D1])
        else:
            q1 = q
            do1 = do
        if ALIBI:  # this step's query head's slope, loaded before the waits
            slope2 = gl.load(ALIBI_SLOPES + off_z * stride_az + off_h * stride_ah) * LOG2E_C
        else:
            slope2 = 0.0
        mbarrier.wait(do_bars.index(s), phase)
        delta = delta_smem.index(s).reshape([BLOCK_M]).load(query_s)
        dp_init = s_zero - gl.expand_dims(delta, 0)
        dpT_tok = warpgroup_mma(v, do.permute((1, 0)), dp_init, is_async=True)  # dPᵀ − delta = V_c dOᵀ − delta
        if HEAD_D1 > 0:  # summed over the column blocks
            dpT_tok = warpgroup_mma(v1, do1.permute((1, 0)), dpT_tok, is_async=True)
        mbarrier.wait(q_bars.index(s), phase)
        sT_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # Sᵀ = K_c Qᵀ
        if HEAD_D1 > 0:
            sT_tok = warpgroup_mma(k1, q1.permute((1, 0)), sT_tok, is_async=True)
        # rows past N_Q have LSE = delta = 0 and q = dO = 0: they add nothing; a row that saw no
        # key (LSE = -inf) gets +inf, so that P = exp2(s − inf) = 0, not NaN
        lse = lse_smem.index(s).reshape([BLOCK_M]).load(query_s)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        if ALIBI and CAUSAL:  # the bias's per-query part (_scored)
            lse2 = lse2 + slope2 * offs_m.to(gl.float32)
        if SOFTCAP:  # the scores come less softcap2, and P as 4 P (_scored)
            lse2 = lse2 - (softcap2 + 2.0)
        dpT, sT = warpgroup_mma_wait(0, deps=(dpT_tok, sT_tok))
        if SOFTCAP or ALIBI:  # the scores in base 2 already: _probs scales by 1
            sT, rT = _scored(sT, offs_m, start_m + shift - keys, qk_scale, softcap2, slope2, SOFTCAP, ALIBI, CAUSAL)
            p_scale = 1.0
            if SOFTCAP:  # through s' = c·tanh(s/c): ds'/ds = 1 − t² = 4 (r − r²), the 4 in P, into dPᵀ − delta
                # at once (rᵀ dies here; kept for dSᵀ, the head_dim 128 kernel spilled 24-32 B)
                dpT = dpT * (rT - rT * rT)
        else:
            p_scale = qk_scale
        if WINDOW:
            if (start_m + right < full_from) | (start_m + (BLOCK_M + HALF_N_C - 2) - left > full_from):  # an edge
                diag = keys - shift - start_m
                pT = _probs(sT, lse2, offs_m, diag - right, diag + left, p_scale, True, True)
            else:
                pT = _probs(sT, lse2, offs_m, keys, keys, p_scale, False, False)
        elif CAUSAL:
            if start_m < full_from:  # the diagonal
                pT = _probs(sT, lse2, offs_m, keys - shift - start_m, keys, p_scale, True, False)
            else:
                pT = _probs(sT, lse2, offs_m, keys, keys, p_scale, False, False)
        else:
            pT = _probs(sT, lse2, offs_m, keys, keys, p_scale, False, False)
        pT_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pT_op, do, dv, is_async=True)  # dV_c += Pᵀ dO
        if HEAD_D1 > 0:
            pT_op1 = gl.convert_layout(pT_op, op1_layout)  # the same registers (layouts equal but for N)
            dv1_tok = warpgroup_mma(pT_op1, do1, dv1, is_async=True)
        dsT = pT * dpT  # dSᵀ = Pᵀ ∘ (dPᵀ − delta) (∘ (1 − t²)), while dV's wgmma runs
        ds16 = dsT.to(dtype)
        dsT_op = gl.convert_layout(ds16, op_layout)
        dk_tok = warpgroup_mma(dsT_op, q, dk, is_async=True)  # dK_c += dSᵀ Q (scaled at the end)
        if HEAD_D1 > 0:
            dsT_op1 = gl.convert_layout(dsT_op, op1_layout)
            dk1_tok = warpgroup_mma(dsT_op1, q1, dk1, is_async=True)
        if FUSED_DQ:
            # this consumer's dSᵀ rows into dS stage i % 2: past N_K a key's P may be inf against a
            # very negative LSE (K = 0 there, and inf · 0 is NaN), so those rows go in as zeros
            ds_dst = ds_smem.index(2 * (i % 2) + C)
            if ragged:
                ds_dst.store(gl.where(gl.expand_dims(keys < N_K, 1), ds16, 0.0).to(dtype))
            else:
                ds_dst.store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_bars.index(i % 2), count=1)
        # the operands in registers stay alive until their wgmmas are done
        if HEAD_D1 > 0:
            dv, dk, dv1, dk1, pT_op, dsT_op, pT_op1, dsT_op1 = warpgroup_mma_wait(
                0, deps=(dv_tok, dk_tok, dv1_tok, dk1_tok, pT_op, dsT_op, pT_op1, dsT_op1))
        else:
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
        mbarrier.arrive(empty_bars.index(s), count=1)  # this consumer is done with stage s
        if FUSED_DQ:  # (K stays put: the stage is released already)
            if HEAD_D1 > 0:  # each consumer its column block of dQ, every step
                if C == 0:
                    _dq_step(ds_smem, k_smem, dq_smem.index(0), ds_bars, dq_desc, off_z, off_h, start_m, i % 2,
                             (i // 2) & 1, sm_scale, 0, HEAD_D, 0, BLOCK_M)
                else:
                    _dq_step(ds_smem, k1_smem, dq1_smem.index(0), ds_bars, dq1_desc, off_z, off_h, start_m, i % 2,
                             (i // 2) & 1, sm_scale, 0, HEAD_D1, HEAD_D, BLOCK_M)
            elif dq_desc.block_type.shape[3] == HEAD_D:  # the consumers take the steps' dQ in turns
                if i % 2 == C:
                    _dq_step(ds_smem, k_smem, dq_smem.index(C), ds_bars, dq_desc, off_z, off_h, start_m, C,
                             (i // 2) & 1, sm_scale, 0, HEAD_D, 0, BLOCK_M)
            else:  # each consumer its half of dQ's columns, every step
                _dq_step(ds_smem, k_smem, dq_smem.index(C), ds_bars, dq_desc, off_z, off_h, start_m, i % 2,
                         (i // 2) & 1, sm_scale, C * (HEAD_D // 2), HEAD_D, C * (HEAD_D // 2), BLOCK_M)
        off_h, start_m = _next_block(off_h, start_m, first * BLOCK_M, (first + n_m) * BLOCK_M, BLOCK_M)
        s += 1
        phase = gl.where(s == STAGES, phase ^ 1, phase)
        s = gl.where(s == STAGES, 0, s)
    if FUSED_DQ:
        tma.store_wait(0)
    if SOFTCAP:  # dV was summed from 4 P (_scored)
        dv = dv * 0.25
        if HEAD_D1 > 0:
            dv1 = dv1 * 0.25

    if TMA_OUT and KV_ADD > 0:  # a split group's float32 adds, through this consumer's dQ tile
        _add_out(dk * sm_scale, dv, dq_smem.index(C), dk_desc, dv_desc, off_z, off_hkv // KV_ADD, key0)
    elif TMA_OUT:  # the gradients themselves: the producer stores them (_hand_over)
        _hand_over(dk * sm_scale, dv, dk1 * sm_scale, dv1, k_smem, v_smem, k1_smem, v1_smem, out_bars, C, HEAD_D,
                   HEAD_D1, FUSED_DQ, False)
    else:  # float32 partials, or adds
        rows_kv = key0 + gl.arange(0, HALF_N_C, layout=gl.SliceLayout(1, acc_layout))
        # DV shares DK's (contiguous) strides; KV_ADD parts of a split group add into one head
        off_out = off_hkv // KV_ADD if KV_ADD > 0 else off_hkv
        base = off_z.to(gl.int64) * stride_dkz + off_out * stride_dkh
        _store_rows(DK, base, rows_kv, N_K, stride_dkn, dk * sm_scale, 0, HEAD_D, acc_layout, KV_ADD > 0)
        _store_rows(DV, base, rows_kv, N_K, stride_dkn, dv, 0, HEAD_D, acc_layout, KV_ADD > 0)
        if HEAD_D1 > 0:
            rows_kv1 = key0 + gl.arange(0, HALF_N_C, layout=gl.SliceLayout(1, acc1_layout))
            _store_rows(DK, base, rows_kv1, N_K, stride_dkn, dk1 * sm_scale, HEAD_D, D1, acc1_layout, KV_ADD > 0)
            _store_rows(DV, base, rows_kv1, N_K, stride_dkn, dv1, HEAD_D, D1, acc1_layout, KV_ADD > 0)


# lengths and DK's batch/head strides (multiples of N) are not specialized on divisibility by 16:
# one compile serves every N
@gluon.jit(do_not_specialize=["N_Q", "N_K", "stride_dkz", "stride_dkh", "win_left", "win_right"])
def _fa3_bwd_dkdv(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, q1_desc, k1_desc, v1_desc,
                  do1_desc, dq1_desc, dk_desc, dv_desc, dk1_desc, dv1_desc, DK, DV,
                  stride_dkz, stride_dkh, stride_dkn, N_Q, N_K, sm_scale, qk_scale, win_left, win_right,
                  softcap2, ALIBI_SLOPES, stride_az, stride_ah,
                  GROUP: gl.constexpr, KV_SPLIT: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D1: gl.constexpr,
                  BLOCK_M: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  FUSED_DQ: gl.constexpr, KV_ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  PRODUCER_REGS: gl.constexpr, BLOCKS_LAST: gl.constexpr, TMA_OUT: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """dK, dV of one block of CONSUMERS x 64 keys of one k/v head; grid (cdiv(N_K, 64 CONSUMERS),
    H_KV, B), or with BLOCKS_LAST (H_KV, B, cdiv(N_K, 64 CONSUMERS)). q_desc, do_desc: 4-D
    descriptors over q, dO (B, H, N_Q, HEAD_D), box [1, 1, BLOCK_M, HEAD_D]; k_desc, v_desc over k,
    v (B, H_KV / KV_SPLIT, N_K, HEAD_D), box [1, 1, 64, HEAD_D]; lse_desc, delta_desc: 3-D over LSE
    (natural log) and Delta = rowsum(dO ∘ O), float32 (B, H, N_Q), box [1, 1, BLOCK_M], unswizzled.
    HEAD_D1 > 0: the head dim is HEAD_D + HEAD_D1, and q1_desc, k1_desc, v1_desc, do1_desc (and
    dq1_desc) are the same tensors' descriptors with HEAD_D1-column boxes, read from column HEAD_D;
    otherwise they are None. DK, DV: (B, H_KV, N_K, head dim), one layout, last dim contiguous,
    written in their dtype. TMA_OUT (they are the gradients, in the inputs' dtype): dk_desc, dv_desc
    (and dk1_desc, dv1_desc with a second block) are descriptors over them with K's boxes; the
    consumers put their dK and dV in their K and V tiles and the producer stores those
    (:func:`_hand_over`); otherwise they are None and the consumers store (or add) through DK, DV.
    qk_scale = sm_scale · log2 e. CAUSAL or WINDOW (or neither): WINDOW, query i sees keys [i +
    shift − win_left, i + shift + win_right] (shift = N_K − N_Q; an unbounded side comes as a value
    wider than any sequence), and only the query blocks that see some key of the program's are
    visited. SOFTCAP, ALIBI: the portable kernels' score variants (:func:`_scored`): qk_scale is then
    sm_scale / softcap and softcap2 = softcap · log2 e; ALIBI_SLOPES (B, H) or (H,) float32 with
    strides stride_az (0 for (H,)) and stride_ah. Launch with num_warps=4 (the default partition, consumer 0) and maxnreg so that
    setmaxnreg can hand the consumers CONSUMER_REGS and the producer PRODUCER_REGS.

    FUSED_DQ (two consumers): dQ too, 5 matmuls per tile pair instead of 7 with the dQ kernel.
    Each step's dSᵀ halves go through shared memory, and the consumers take the steps' dQ = dS K ·
    sm_scale in turns, each added into a zeroed float32 (B, H, N_Q, HEAD_D) buffer by one TMA
    reduce-add (dq_desc, box [1, 1, BLOCK_M, HEAD_D]): the order of those adds varies from run to
    run, so dQ's last bits do (dK, dV too where KV_ADD > 2). Otherwise dq_desc is None.

    KV_SPLIT > 1 spreads each k/v head's GQA group over that many programs (as the Triton kernel:
    H_KV and GROUP are then per part, H_KV parts of GROUP query heads): part p of k/v head
    p // KV_SPLIT writes its partial dK/dV as head p of DK/DV (float32), which the launcher sums -
    or with KV_ADD = KV_SPLIT adds it into head p // KV_SPLIT of DK/DV (float32, zeroed; relaxed
    atomics, in whatever order the parts land). KV_ADD = 0 otherwise."""
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(not FUSED_DQ or CONSUMERS == 2)  # dQ's steps alternate between two consumers
    gl.static_assert(STAGES >= 2)  # a stage is reloaded only once both consumers released it
    gl.static_assert(HEAD_D == 64 or HEAD_D == 128)
    gl.static_assert(HEAD_D1 == 0 or (HEAD_D1 >= 16 and HEAD_D1 < HEAD_D))
    gl.static_assert(HEAD_D1 == 0 or not FUSED_DQ or CONSUMERS == 2)  # dQ's column blocks, one per consumer
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
    if HEAD_D1 > 0:  # the second column block's tiles
        q1_smem = gl.allocate_shared_memory(dtype, [STAGES] + q1_desc.block_type.shape, q1_desc.layout)
        do1_smem = gl.allocate_shared_memory(dtype, [STAGES] + do1_desc.block_type.shape, do1_desc.layout)
        k1_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + k1_desc.block_type.shape, k1_desc.layout)
        v1_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + v1_desc.block_type.shape, v1_desc.layout)
    else:  # never read: the first blocks stand in
        q1_smem = q_smem
        do1_smem = do_smem
        k1_smem = k_smem
        v1_smem = v_smem
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if FUSED_DQ:
        # dSᵀ: [parity][consumer] 64 keys x BLOCK_M; one dQ tile per consumer for its reduce-adds
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N_C, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF_N_C, BLOCK_M], ds_layout)
        if HEAD_D1 > 0:  # consumer 0 adds dQ's first column block, consumer 1 its second
            dq_smem = gl.allocate_shared_memory(gl.float32, [1] + dq_desc.block_type.shape, dq_desc.layout)
            dq1_smem = gl.allocate_shared_memory(gl.float32, [1] + dq1_desc.block_type.shape, dq1_desc.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
            dq1_smem = dq_smem
        ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for p in gl.static_range(2):
            mbarrier.init(ds_bars.index(p), count=CONSUMERS)  # both consumers' halves are in
    else:
        ds_smem = q_smem
        dq_smem = q_smem
        dq1_smem = q_smem
        ds_bars = q_bars
    # TMA_OUT: [0] every consumer's loop is done (K's tiles are free), [1] every consumer's dK and dV are in its tiles
    out_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(out_bars.index(b), count=CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(kv_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_bars.index(s), count=1)
        mbarrier.init(do_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=CONSUMERS)  # every consumer releases a stage
    fence_async_shared()
    # the argument tuples are written in the call: a tuple assigned to a variable first would
    # turn its constexprs (C, HEAD_D, ...) into tensors
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem,
                             delta_smem, ds_smem, dq_smem, dq1_smem, kv_bars, q_bars, do_bars, empty_bars, ds_bars,
                             out_bars, DK, DV, dq_desc, dq1_desc, dk_desc, dv_desc, stride_dkz,
                             stride_dkh, stride_dkn, N_Q, N_K, sm_scale, qk_scale, win_left, win_right, softcap2,
                             ALIBI_SLOPES, stride_az, stride_ah, 0, GROUP, HEAD_D, HEAD_D1, BLOCK_M, STAGES, CONSUMERS,
                             CAUSAL, WINDOW, FUSED_DQ, KV_ADD, BLOCKS_LAST, TMA_OUT, SOFTCAP, ALIBI)),
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem,
                             delta_smem, ds_smem, dq_smem, dq1_smem, kv_bars, q_bars, do_bars, empty_bars, ds_bars,
                             out_bars, DK, DV, dq_desc, dq1_desc, dk_desc, dv_desc, stride_dkz,
                             stride_dkh, stride_dkn, N_Q, N_K, sm_scale, qk_scale, win_left, win_right, softcap2,
                             ALIBI_SLOPES, stride_az, stride_ah, 1, GROUP, HEAD_D, HEAD_D1, BLOCK_M, STAGES, CONSUMERS,
                             CAUSAL, WINDOW, FUSED_DQ, KV_ADD, BLOCKS_LAST, TMA_OUT, SOFTCAP, ALIBI)),
            (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q1_desc, k1_desc, v1_desc,
                             do1_desc, dk_desc, dv_desc, dk1_desc, dv1_desc, q_smem, do_smem, k_smem, v_smem,
                             q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem, kv_bars, q_bars, do_bars,
                             empty_bars, out_bars, N_Q, N_K, win_left, win_right, GROUP, KV_SPLIT, HEAD_D, HEAD_D1,
                             BLOCK_M, STAGES, CONSUMERS, CAUSAL, WINDOW, BLOCKS_LAST, TMA_OUT, KV_ADD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem,
                             delta_smem, ds_smem, dq_smem, dq1_smem, kv_bars, q_bars, do_bars, empty_bars, ds_bars,
                             out_bars, DK, DV, dq_desc, dq1_desc, dk_desc, dv_desc, stride_dkz,
                             stride_dkh, stride_dkn, N_Q, N_K, sm_scale, qk_scale, win_left, win_right, softcap2,
                             ALIBI_SLOPES, stride_az, stride_ah, 0, GROUP, HEAD_D, HEAD_D1, BLOCK_M, STAGES, CONSUMERS,
                             CAUSAL, WINDOW, FUSED_DQ, KV_ADD, BLOCKS_LAST, TMA_OUT, SOFTCAP, ALIBI)),
            (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q1_desc, k1_desc, v1_desc,
                             do1_desc, dk_desc, dv_desc, dk1_desc, dv1_desc, q_smem, do_smem, k_smem, v_smem,
                             q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem, kv_bars, q_bars, do_bars,
                             empty_bars, out_bars, N_Q, N_K, win_left, win_right, GROUP, KV_SPLIT, HEAD_D, HEAD_D1,
                             BLOCK_M, STAGES, CONSUMERS, CAUSAL, WINDOW, BLOCKS_LAST, TMA_OUT, KV_ADD)),
        ], [1], [PRODUCER_REGS])


# -- head dims past 128: dK and dV transposed ------------------------------------------------------


@gluon.jit
def _bwd_consumer_t(q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem,
                    ds_smem, dq_smem, p_smem, kv_bars, q_bars, do_bars, empty_bars, ds_bars, out_bars, DK, DV,
                    dq_desc, stride_dkz, stride_dkh, stride_dkn, N_Q, N_K,
                    sm_scale, qk_scale, left, right, softcap2,
                    C: gl.constexpr, GROUP: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D1: gl.constexpr,
                    KEYS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, FUSED_DQ: gl.constexpr, KV_ADD: gl.constexpr,
                    BLOCKS_LAST: gl.constexpr, TMA_OUT: gl.constexpr, SOFTCAP: gl.constexpr):
    # S, dP: (BLOCK_M queries, KEYS keys); dKᵀ, dVᵀ: (HEAD_D, KEYS) and (HEAD_D1, KEYS); one layout
    # (wgmma's N is this consumer's keys in all four), M = 64 per instruction, repeated
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS_C, 16])
    query_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    start_n, off_hkv, off_z = _key_tile(CONSUMERS * KEYS, BLOCKS_LAST)
    key0 = start_n + C * KEYS  # this consumer's first key
    keys = key0 + gl.arange(0, KEYS, layout=key_s)
    offs_m = gl.arange(0, BLOCK_M, layout=query_s)
    shift = N_K - N_Q  # bottom-right alignment: query i faces key i + shift
    full_from = key0 + KEYS - 1 - shift  # as _bwd_consumer's
    first, n_m = _query_blocks(start_n, N_Q, N_K, left, right, BLOCK_M, CONSUMERS * KEYS, CAUSAL, WINDOW)
    ragged = key0 + KEYS > N_K  # keys past N_K: P (so dS) zeroed there, before dQ sees them

    k = k_smem.index(C).reshape([KEYS, HEAD_D])
    v = v_smem.index(C).reshape([KEYS, HEAD_D])
    k1 = k1_smem.index(C).reshape([KEYS, HEAD_D1])
    v1 = v1_smem.index(C).reshape([KEYS, HEAD_D1])
    s_zero = gl.zeros([BLOCK_M, KEYS], gl.float32, layout=s_layout)
    dk = gl.zeros([HEAD_D, KEYS], gl.float32, layout=s_layout)
    dv = gl.zeros([HEAD_D, KEYS], gl.float32, layout=s_layout)
    dk1 = gl.zeros([HEAD_D1, KEYS], gl.float32, layout=s_layout)
    dv1 = gl.zeros([HEAD_D1, KEYS], gl.float32, layout=s_layout)
    start_m = first * BLOCK_M
    off_h = off_hkv * GROUP
    s = 0
    phase = 0
    mbarrier.wait(kv_bars.index(C), 0)
    for i in range(GROUP * n_m):
        q = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
        do = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
        q1 = q1_smem.index(s).reshape([BLOCK_M, HEAD_D1])
        do1 = do1_smem.index(s).reshape([BLOCK_M, HEAD_D1])
        mbarrier.wait(do_bars.index(s), phase)
        delta = delta_smem.index(s).reshape([BLOCK_M]).load(query_s)
        dp_init = s_zero - gl.expand_dims(delta, 1)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), dp_init, is_async=True)  # dP − delta = dO V_cᵀ − delta
        dp_tok = warpgroup_mma(do1, v1.permute((1, 0)), dp_tok, is_async=True)
        mbarrier.wait(q_bars.index(s), phase)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # S = Q K_cᵀ
        s_tok = warpgroup_mma(q1, k1.permute((1, 0)), s_tok, is_async=True)
        lse = lse_smem.index(s).reshape([BLOCK_M]).load(query_s)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        dp, sc = warpgroup_mma_wait(0, deps=(dp_tok, s_tok))
        if SOFTCAP:  # as _bwd_consumer: base-2 scores less softcap2, 4 P, and ds'/ds / 4 into dP − delta at once
            sc, r = _scored(sc, offs_m, keys, qk_scale, softcap2, 0.0, True, False, CAUSAL)
            lse2 = lse2 - (softcap2 + 2.0)
            dp = dp * (r - r * r)
            p_scale = 1.0
        else:
            p_scale = qk_scale
        if WINDOW:
            if (start_m + right < full_from) | (start_m + (BLOCK_M + KEYS - 2) - left > full_from):  # an edge
                diag = keys - shift - start_m
                p = _probs(sc, lse2, offs_m, diag - right, diag + left, p_scale, True, True, 1)
            else:
                p = _probs(sc, lse2, offs_m, keys, keys, p_scale, False, False, 1)
        elif CAUSAL:
            if start_m < full_from:  # the diagonal
                p = _probs(sc, lse2, offs_m, keys - shift - start_m, keys, p_scale, True, False, 1)
            else:
                p = _probs(sc, lse2, offs_m, keys, keys, p_scale, False, False, 1)
        else:
            p = _probs(sc, lse2, offs_m, keys, keys, p_scale, False, False, 1)
        if ragged:  # past N_K, K = V = 0 but P may be inf against a very negative LSE
            p = gl.where(gl.expand_dims(keys < N_K, 0), p, 0.0)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        dv_tok = warpgroup_mma(do.permute((1, 0)), p_smem, dv, is_async=True)  # dVᵀ_c += dOᵀ P
        dv1_tok = warpgroup_mma(do1.permute((1, 0)), p_smem, dv1, is_async=True)
        ds_dst = ds_smem.index(2 * (i % 2) + C)
        ds_dst.store((p * dp).to(dtype))  # dS = P ∘ (dP − delta), while dV's wgmmas run
        fence_async_shared()
        if FUSED_DQ:
            mbarrier.arrive(ds_bars.index(i % 2), count=1)
        dk_tok = warpgroup_mma(q.permute((1, 0)), ds_dst, dk, is_async=True)  # dKᵀ_c += Qᵀ dS (scaled at the end)
        dk1_tok = warpgroup_mma(q1.permute((1, 0)), ds_dst, dk1, is_async=True)
        dv, dk, dv1, dk1 = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dv1_tok, dk1_tok))
        mbarrier.arrive(empty_bars.index(s), count=1)  # this consumer is done with stage s
        if FUSED_DQ:
            if i % 2 == C:  # the consumers take the steps' dQ in turns, DQ_COLS columns at a time
                mbarrier.wait(ds_bars.index(i % 2), (i // 2) & 1)
                for j in gl.static_range((HEAD_D + HEAD_D1) // DQ_COLS_C):
                    dq = gl.zeros([BLOCK_M, DQ_COLS_C], gl.float32, layout=dq_layout)
                    for c in gl.static_range(CONSUMERS):  # dQ = Σ_c dS_c K_c
                        if j * DQ_COLS_C < HEAD_D:
                            kc = k_smem.index(c).reshape([KEYS, HEAD_D]).slice(j * DQ_COLS_C, DQ_COLS_C, dim=1)
                        else:
                            kc = k1_smem.index(c).reshape([KEYS, HEAD_D1]).slice(j * DQ_COLS_C - HEAD_D, DQ_COLS_C,
                                                                                 dim=1)
                        dq = warpgroup_mma(ds_smem.index(2 * (i % 2) + c), kc, dq, use_acc=c > 0, is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq,))
                    tma.store_wait(0)  # the previous reduce-add has read the tile
                    dq_smem.index(C).reshape([BLOCK_M, DQ_COLS_C]).store(dq * sm_scale)
                    fence_async_shared()
                    _tma_add(dq_desc, [off_z, off_h, start_m, j * DQ_COLS_C], dq_smem.index(C))
        off_h, start_m = _next_block(off_h, start_m, first * BLOCK_M, (first + n_m) * BLOCK_M, BLOCK_M)
        s += 1
        phase = gl.where(s == STAGES, phase ^ 1, phase)
        s = gl.where(s == STAGES, 0, s)
    if FUSED_DQ:
        tma.store_wait(0)
    if SOFTCAP:  # dV was summed from 4 P (_scored)
        dv = dv * 0.25
        dv1 = dv1 * 0.25

    if TMA_OUT:  # the gradients themselves: the producer stores them (_hand_over, transposed back)
        _hand_over(dk * sm_scale, dv, dk1 * sm_scale, dv1, k_smem, v_smem, k1_smem, v1_smem, out_bars, C, HEAD_D,
                   HEAD_D1, FUSED_DQ, True)
    else:  # float32 partials, or adds
        off_out = off_hkv // KV_ADD if KV_ADD > 0 else off_hkv
        base = off_z.to(gl.int64) * stride_dkz + off_out * stride_dkh
        _store_rows(DK, base, keys, N_K, stride_dkn, dk * sm_scale, 0, HEAD_D, s_layout, KV_ADD > 0, 1)
        _store_rows(DV, base, keys, N_K, stride_dkn, dv, 0, HEAD_D, s_layout, KV_ADD > 0, 1)
        _store_rows(DK, base, keys, N_K, stride_dkn, dk1 * sm_scale, HEAD_D, HEAD_D1, s_layout, KV_ADD > 0, 1)
        _store_rows(DV, base, keys, N_K, stride_dkn, dv1, HEAD_D, HEAD_D1, s_layout, KV_ADD > 0, 1)


@gluon.jit(do_not_specialize=["N_Q", "N_K", "stride_dkz", "stride_dkh", "win_left", "win_right"])
def _fa3_bwd_dkdv_t(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, q1_desc, k1_desc, v1_desc,
                    do1_desc, dq1_desc, dk_desc, dv_desc, dk1_desc, dv1_desc, DK, DV,
                    stride_dkz, stride_dkh, stride_dkn, N_Q, N_K, sm_scale, qk_scale, win_left, win_right,
                    softcap2, ALIBI_SLOPES, stride_az, stride_ah,
                    GROUP: gl.constexpr, KV_SPLIT: gl.constexpr, HEAD_D: gl.constexpr, HEAD_D1: gl.constexpr,
                    BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                    FUSED_DQ: gl.constexpr, KV_ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, BLOCKS_LAST: gl.constexpr, TMA_OUT: gl.constexpr,
                    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """:func:`_fa3_bwd_dkdv` for head dims of two column blocks past 128 (192 = 128 + 64), as
    FlashAttention-3 runs them: dK and dV transposed. Arguments, grid and launch as
    :func:`_fa3_bwd_dkdv`'s, but for the keys per consumer: k_desc's box rows (KEYS, e.g. 32), so
    the grid's key blocks are CONSUMERS x KEYS; dq_desc's box is [1, 1, BLOCK_M, 64] and dq1_desc
    None; a softcap as :func:`_bwd_consumer` takes it, no ALiBi (ALIBI off).

    Why: _fa3_bwd_dkdv holds dK_c and dV_c as (64 keys, head dim) float32 in registers (wgmma's M
    is 64 per warpgroup), 192 a thread at head_dim 192 before Sᵀ and dPᵀ: it spills (NOTES v19).
    Here a consumer owns KEYS < 64 keys, the N of every wgmma:
        S = Q K_cᵀ, dP − delta = dO V_cᵀ − delta     (BLOCK_M, KEYS), from shared memory
        P = exp2(S · qk_scale − LSE · log2 e), dS = P ∘ (dP − delta)   (per-query LSE and delta:
                                                     two registers a thread in this layout)
        dVᵀ_c += dOᵀ P, dKᵀ_c += Qᵀ dS              (head dim, KEYS): P and dS go through shared
                                                     memory, the B operand
    so dKᵀ_c + dVᵀ_c are 2 x 192 x KEYS / 128 registers a thread (96 at KEYS = 32; register tensors
    and TMA boxes are powers of two, so not FA3's 48). FUSED_DQ: the consumers take the steps' dQ in
    turns, dQ = Σ_c dS_c K_c (both consumers' dS from the step's dS stage), 64 columns at a time,
    each added by one TMA reduce-add through the consumer's float32 dQ tile (shared memory at
    head_dim 192, KEYS = 32: K + V 48 KB, two stages of Q and dO 96 KB, P and dS 24 KB, the dQ
    tiles 32 KB).
    The edges are _fa3_bwd_dkdv's (zero-filled boxes, -inf LSE, keys past N_K), and so are the
    masks, with keys on S's columns."""
    gl.static_assert(CONSUMERS == 2)
    gl.static_assert(STAGES >= 2)
    gl.static_assert(HEAD_D == 128 and (HEAD_D1 == 64 or HEAD_D1 == 128))  # 192, 256: dQ's 64-column tiles tile both blocks
    gl.static_assert(not ALIBI)
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
    q1_smem = gl.allocate_shared_memory(dtype, [STAGES] + q1_desc.block_type.shape, q1_desc.layout)
    do1_smem = gl.allocate_shared_memory(dtype, [STAGES] + do1_desc.block_type.shape, do1_desc.layout)
    k1_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + k1_desc.block_type.shape, k1_desc.layout)
    v1_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + v1_desc.block_type.shape, v1_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # P: [consumer], dS: [parity][consumer], (BLOCK_M, KEYS) each; with dQ, each consumer's float32
    # (BLOCK_M, DQ_COLS) tile for its reduce-adds
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, KEYS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, KEYS], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, BLOCK_M, KEYS], p_layout)
    if FUSED_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_smem = ds_smem  # never read
    for p in gl.static_range(2):
        mbarrier.init(ds_bars.index(p), count=CONSUMERS)
    # TMA_OUT: [0] every consumer's loop is done (K's tiles are free), [1] every consumer's dK and dV are in its tiles
    out_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(out_bars.index(b), count=CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(kv_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_bars.index(s), count=1)
        mbarrier.init(do_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=CONSUMERS)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer_t, (q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem,
                           ds_smem, dq_smem, p_smem.index(0), kv_bars, q_bars, do_bars, empty_bars, ds_bars,
                           out_bars, DK, DV, dq_desc, stride_dkz, stride_dkh, stride_dkn,
                           N_Q, N_K, sm_scale, qk_scale, win_left, win_right, softcap2, 0, GROUP, HEAD_D, HEAD_D1,
                           KEYS, BLOCK_M, STAGES, CONSUMERS, CAUSAL, WINDOW, FUSED_DQ, KV_ADD, BLOCKS_LAST, TMA_OUT,
                           SOFTCAP)),
        (_bwd_consumer_t, (q_smem, do_smem, k_smem, v_smem, q1_smem, do1_smem, k1_smem, v1_smem, lse_smem, delta_smem,
                           ds_smem, dq_smem, p_smem.index(1), kv_bars, q_bars, do_bars, empty_bars, ds_bars,
                           out_bars, DK, DV, dq_desc, stride_dkz, stride_dkh, stride_dkn,
                           N_Q, N_K, sm_scale, qk_scale, win_left, win_right, softcap2, 1, GROUP, HEAD_D, HEAD_D1,
                           KEYS, BLOCK_M, STAGES, CONSUMERS, CAUSAL, WINDOW, FUSED_DQ, KV_ADD, BLOCKS_LAST, TMA_OUT,
                           SOFTCAP)),
        (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q1_desc, k1_desc, v1_desc,
                         do1_desc, dk_desc, dv_desc, dk1_desc, dv1_desc, q_smem, do_smem, k_smem, v_smem, q1_smem,
                         do1_smem, k1_smem, v1_smem, lse_smem, delta_smem, kv_bars, q_bars, do_bars, empty_bars,
                         out_bars, N_Q, N_K, win_left, win_right, GROUP, KV_SPLIT, HEAD_D, HEAD_D1, BLOCK_M, STAGES,
                         CONSUMERS, CAUSAL, WINDOW, BLOCKS_LAST, TMA_OUT, KV_ADD)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
