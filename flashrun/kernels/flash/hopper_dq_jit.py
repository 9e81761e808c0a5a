"""The dQ kernel of the Hopper (sm_90) backward in Gluon, Triton 3.6's API: the kernel only; the
launcher is :func:`flashrun.kernels.flash.hopper_bwd.gluon_dq`. It runs where the Gluon dK/dV kernel
has no room for dQ inside (head_dim 256: ``_fa3_bwd_dkdv_t``), instead of the portable ``_attn_bwd_dq``.

The loop is the Gluon forward's (:mod:`.hopper_jit`) with dO beside Q: a tile is ``CONSUMERS`` x 64
query rows of one (batch, head), walking the key blocks its rows see. Per key block, in each
consumer (one warpgroup, its 64 rows):

    S  = Q Kᵀ,  dP = dO Vᵀ          two async wgmmas from shared memory
    P  = exp2(S · qk_scale − LSE · log2 e)              (masked on the causal diagonal and past N_K)
    dS = P ∘ (dP − delta)
    dQ += dS K                       async wgmma, dS in fp16/bf16 registers as the A operand

and dQ · sm_scale is stored once, at the end. SOFTCAP (gemma2's): the scores are
c · tanh(S · sm_scale / c), taken from r = 1 / (1 + e^2x) as the Gluon dK/dV kernel takes them
(``hopper_bwd_jit._scored``: P formed as 4 P, dS's derivative 1 − t² as r − r²). A producer warp
loads each consumer's Q and dO rows once and K and V blocks into a ring of ``STAGES`` stages (K
read twice per step: as Kᵀ for S and as K for dQ). Shared memory at head_dim 256 with 32-key blocks: Q and dO 2 x 2 x 32 KB, two
stages of K and V 2 x 32 KB: 192 KB. Registers per consumer thread: dQ 64 x 256 / 128 = 128, S
and dP 2 x 16, dS's operand 8.

Edges as the forward's: the descriptors' boxes zero-fill rows past a head's sequence; query rows
past N_Q compute on zeros (LSE = delta = 0 there: P = 1 times dP − delta = 0) and are never stored;
a row that sees no key has LSE = -inf, taken as +inf (P = 0, not NaN); keys past N_K are masked.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashrun.kernels.flash.hopper_jit import HALF_M_C, LOG2E_C, _tma_load, _unmasked_blocks
from flashrun.kernels.flash.jit import _softcap_r


@gluon.jit
def _dq_tile(H, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """This program's (batch, head, first query row, key blocks its rows see): grid (query tiles,
    batch x heads); causal tiles heaviest (last) first."""
    n_m = gl.cdiv(N_Q, BLOCK_M)
    m = gl.program_id(0)
    if CAUSAL:
        start_m = (n_m - 1 - m) * BLOCK_M
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + N_K - N_Q, 0), N_K)
    else:
        start_m = m * BLOCK_M
        hi = N_K
    off_zh = gl.program_id(1)
    return off_zh // H, off_zh % H, start_m, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars, empty_bars,
                 H, N_Q, N_K, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr):
    off_z, off_h, start_m, n_blocks = _dq_tile(H, N_Q, N_K, CONSUMERS * HALF_M_C, BLOCK_N, CAUSAL)
    for c in gl.static_range(CONSUMERS):  # each consumer's Q and dO rows, once
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [off_z, off_h, start_m + c * HALF_M_C, 0], q_bars.index(c), q_smem.index(c))
        _tma_load(do_desc, [off_z, off_h, start_m + c * HALF_M_C, 0], q_bars.index(c), do_smem.index(c))
    for i in range(n_blocks):
        s = i % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the first lap passes
        mbarrier.wait(empty_bars.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_bars.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [off_z, off_h // GROUP, i * BLOCK_N, 0], kv_bars.index(s), k_smem.index(s))
        _tma_load(v_desc, [off_z, off_h // GROUP, i * BLOCK_N, 0], kv_bars.index(s), v_smem.index(s))


@gluon.jit
def _dq_probs(s2, lse2, cols, rows, N_K, shift, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """P = exp2(s2 − lse2) of the base-2 scores s2 (rows x cols); MASKED: 0 past N_K and, CAUSAL,
    right of the bottom-right diagonal (query i sees keys j <= i + shift)."""
    p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
    if MASKED:
        keep = gl.expand_dims(cols, 0) < N_K
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        p = gl.where(keep, p, 0.0)
    return p


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars, empty_bars, LSE, DELTA, DQ,
                 stride_lz, stride_lh, stride_dz, stride_dh, stride_qz, stride_qh, stride_qm,
                 H, N_Q, N_K, qk_scale, sm_scale, softcap2,
                 C: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    off_z, off_h, start_m, n_blocks = _dq_tile(H, N_Q, N_K, CONSUMERS * HALF_M_C, BLOCK_N, CAUSAL)
    first_row = start_m + C * HALF_M_C
    rows = first_row + gl.arange(0, HALF_M_C, layout=row_s)
    shift = N_K - N_Q  # bottom-right alignment: row i faces key i + shift
    n_unmasked = _unmasked_blocks(first_row, shift, N_K, n_blocks, BLOCK_N, CAUSAL)
    row_ok = rows < N_Q
    lse = gl.load(LSE + off_z * stride_lz + off_h * stride_lh + rows, mask=row_ok, other=0.0)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    if SOFTCAP:
        lse2 = lse2 - (softcap2 + 2.0)
    delta = gl.load(DELTA + off_z * stride_dz + off_h * stride_dh + rows, mask=row_ok, other=0.0)

    q = q_smem.index(C).reshape([HALF_M_C, HEAD_D])
    do = do_smem.index(C).reshape([HALF_M_C, HEAD_D])
    s_zero = gl.zeros([HALF_M_C, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([HALF_M_C, HEAD_D], gl.float32, layout=acc_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    mbarrier.wait(q_bars.index(C), 0)
    for i in range(n_blocks):
        s = i % STAGES
        mbarrier.wait(kv_bars.index(s), (i // STAGES) & 1)
        k = k_smem.index(s).reshape([BLOCK_N, HEAD_D])
        v = v_smem.index(s).reshape([BLOCK_N, HEAD_D])
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_val, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        dp = dp - gl.expand_dims(delta, 1)
        if SOFTCAP:  # qk_scale = sm_scale / c, softcap2 = c · log2 e; as the dK/dV kernel (its _scored): the
            # scores less softcap2 from r (tanh = 1 − 2r), P as 4 P (lse2 below), ds'/ds / 4 = r − r²
            r = _softcap_r(s_val, qk_scale)
            s2 = r * (-2.0 * softcap2)
            dp = dp * (r - r * r)
        else:  # qk_scale = sm_scale · log2 e
            s2 = s_val * qk_scale
        if i < n_unmasked:
            p = _dq_probs(s2, lse2, i * BLOCK_N + offs_n, rows, N_K, shift, False, CAUSAL)
        else:
            p = _dq_probs(s2, lse2, i * BLOCK_N + offs_n, rows, N_K, shift, True, CAUSAL)
        ds = gl.convert_layout((p * dp).to(dtype), ds_layout)
        dq_tok = warpgroup_mma(ds, k, dq, is_async=True)
        dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
        mbarrier.arrive(empty_bars.index(s), count=1)  # K's last read (dQ's wgmma) is done
    row_o: gl.constexpr = gl.SliceLayout(1, acc_layout)
    out_rows = first_row + gl.arange(0, HALF_M_C, layout=row_o)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    ptrs = (DQ + off_z * stride_qz + off_h * stride_qh + gl.expand_dims(out_rows.to(gl.int64) * stride_qm, 1)
            + gl.expand_dims(cols, 0))
    gl.store(ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(out_rows < N_Q, 1))


# lengths, heads and the row vectors' strides are not specialized on divisibility by 16: one compile serves every N
@gluon.jit(do_not_specialize=["H", "N_Q", "N_K", "stride_lz", "stride_lh", "stride_dz", "stride_dh"])
def _fa3_bwd_dq(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DQ, stride_lz, stride_lh, stride_dz, stride_dh,
                stride_qz, stride_qh, stride_qm, H, N_Q, N_K, qk_scale, sm_scale, softcap2,
                GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr):
    """q_desc, do_desc: 4-D descriptors over q, dO (B, H, N_Q, D), box [1, 1, 64, HEAD_D]; k_desc,
    v_desc over k, v (B, H_KV, N_K, D), box [1, 1, BLOCK_N, HEAD_D]. LSE, DELTA: (B, H, N_Q) float32
    (natural-log LSE; delta = rowsum(dO ∘ O)), rows contiguous; DQ: (B, H, N_Q, D), last dim
    contiguous, written in its dtype. qk_scale = sm_scale · log2 e, or with SOFTCAP sm_scale / c
    (softcap2 = c · log2 e). Grid (cdiv(N_Q, 64 CONSUMERS),
    B x H); launch with num_warps=4 (the default partition, consumer 0)."""
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=CONSUMERS)  # every consumer releases a stage
    fence_async_shared()

    # the argument tuples are written in the call: a tuple assigned to a variable first would turn
    # its constexprs into tensors
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars, empty_bars, LSE, DELTA, DQ,
                            stride_lz, stride_lh, stride_dz, stride_dh, stride_qz, stride_qh, stride_qm,
                            H, N_Q, N_K, qk_scale, sm_scale, softcap2, 0, HEAD_D, BLOCK_N, STAGES, CONSUMERS, CAUSAL,
                            SOFTCAP)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars, empty_bars, LSE, DELTA, DQ,
                            stride_lz, stride_lh, stride_dz, stride_dh, stride_qz, stride_qh, stride_qm,
                            H, N_Q, N_K, qk_scale, sm_scale, softcap2, 1, HEAD_D, BLOCK_N, STAGES, CONSUMERS, CAUSAL,
                            SOFTCAP)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars,
                            empty_bars, H, N_Q, N_K, GROUP, BLOCK_N, STAGES, CONSUMERS, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars, empty_bars, LSE, DELTA, DQ,
                            stride_lz, stride_lh, stride_dz, stride_dh, stride_qz, stride_qh, stride_qm,
                            H, N_Q, N_K, qk_scale, sm_scale, softcap2, 0, HEAD_D, BLOCK_N, STAGES, CONSUMERS, CAUSAL,
                            SOFTCAP)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, kv_bars,
                            empty_bars, H, N_Q, N_K, GROUP, BLOCK_N, STAGES, CONSUMERS, CAUSAL)),
        ], [1], [PRODUCER_REGS])
