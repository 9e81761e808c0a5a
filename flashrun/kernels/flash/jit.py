"""Shared pieces of the flash kernels: constants and ``@triton.jit`` helpers (masks, scores,
loads and stores, loop bounds, matmuls over a head dim split into two column blocks). The maths
is in :mod:`flashrun.kernels.flash`."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # 1/ln(2): we use exp2
LOG2E_C = tl.constexpr(LOG2E)
# An unbounded side of a window, as the kernels see it: wider than any key or query range, and
# small enough that i + off ± UNBOUNDED stays inside int32.
UNBOUNDED = 2**30
UNBOUNDED_C = tl.constexpr(UNBOUNDED)
# The second column block of a head dim that is not split (BLOCK_D1 = 0): a placeholder that no
# code reads. Not None: Triton (3.6, 3.9) cannot return None from a @triton.jit helper.
NO_BLOCK = tl.constexpr(0)
# The SOFTCAP constexpr: 0 (off) or which tanh the kernels compute (:func:`_tanh`). The fast one's
# absolute error (3e-7) times the cap is the scores' error: up to SOFTCAP_FAST_CAP it stays below
# 1e-4, a fifth of float16's rounding of P (bfloat16's is 8x coarser still). SOFTCAP_FAST_PTX is
# the fast one as compiled code computes it (its reciprocal in PTX: not the interpreter)
SOFTCAP_FAST = tl.constexpr(1)
SOFTCAP_PRECISE = tl.constexpr(2)
SOFTCAP_FAST_PTX = tl.constexpr(3)
SOFTCAP_FAST_CAP = 256.0



# ---------------------------------------------------------------------------------------------
# @triton.jit helpers


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Triton's CPU interpreter computes bfloat16 tl.dot wrongly (seen with triton 3.9): there,
    # and only there, bf16 operands go through float32 - exact for bf16 values, like an MMA.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _key_range(start_m, N_Q, N_K, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Keys for query rows [start_m, start_m + BLOCK_M) as block-aligned ranges: [lo, mid_lo) and
    [mid_hi, hi) need a mask, [mid_lo, mid_hi) none; keys outside [lo, hi) are never visited."""
    full = (N_K // BLOCK_N) * BLOCK_N  # blocks entirely inside the sequence
    shift = N_K - N_Q  # bottom-right alignment: row i faces key i + shift
    if WINDOW:
        # row i sees keys [i + shift - left, i + shift + right]; rows past N_Q widen nothing
        end_m = tl.minimum(start_m + BLOCK_M, N_Q)
        lo = (tl.maximum(start_m + shift - left, 0) // BLOCK_N) * BLOCK_N
        hi = tl.maximum(tl.minimum(tl.maximum(end_m + shift + right, 0), N_K), lo)
        # whole blocks that every row sees: from the last row's first key to the first row's last
        mid_lo = tl.cdiv(tl.maximum(end_m - 1 + shift - left, 0), BLOCK_N) * BLOCK_N
        mid_hi = tl.minimum((tl.maximum(start_m + shift + right + 1, 0) // BLOCK_N) * BLOCK_N, full)
        # clamped into [lo, hi]; where a clamp cuts a boundary off its block grid, every range
        # after it is empty, so the loops still step over whole blocks
        mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    elif CAUSAL:
        lo = 0
        mid_lo = 0
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), N_K)
        # the tile's first row sees keys <= start_m + shift: whole blocks below that are unmasked
        mid_hi = tl.minimum((tl.maximum(start_m + shift + 1, 0) // BLOCK_N) * BLOCK_N, full)
        mid_hi = tl.minimum(mid_hi, hi)
    else:
        lo = 0
        mid_lo = 0
        mid_hi = full
        hi = N_K
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_range(start_n, N_Q, N_K, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Query rows that see keys [start_n, start_n + BLOCK_N), as :func:`_key_range` gives keys:
    [lo, mid_lo) and [mid_hi, hi) need a mask, [mid_lo, mid_hi) none, other rows see no key here.
    Keys of the block past N_K need no mask (their dK/dV are never stored), nor rows past N_Q
    (they load as zeros)."""
    shift = N_K - N_Q
    if WINDOW:
        # query i sees key j iff j - shift - right <= i <= j - shift + left
        end_n = tl.minimum(start_n + BLOCK_N, N_K)
        lo = (tl.maximum(start_n - shift - right, 0) // BLOCK_M) * BLOCK_M
        hi = tl.maximum(tl.minimum(tl.maximum(end_n - shift + left, 0), N_Q), lo)
        # whole blocks of rows that see every key: from the row that sees the last key to the
        # last row that sees the first (or to N_Q when every row up to the end does)
        mid_lo = tl.cdiv(tl.maximum(end_n - 1 - shift - right, 0), BLOCK_M) * BLOCK_M
        mid_hi = (tl.maximum(start_n - shift + left + 1, 0) // BLOCK_M) * BLOCK_M
        mid_hi = tl.where(start_n - shift + left + 1 >= N_Q, N_Q, mid_hi)
        mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    elif CAUSAL:
        # queries that see some key of this block start at start_n - shift; all of it, at
        # start_n + BLOCK_N - 1 - shift
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        mid_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
        mid_lo = tl.maximum(tl.minimum(mid_lo, N_Q), lo)
        mid_hi = N_Q
        hi = N_Q
    else:
        lo = 0
        mid_lo = 0
        mid_hi = N_Q
        hi = N_Q
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _in_window(rows, cols, shift, left, right, CAUSAL: tl.constexpr):
    """Whether query ``rows`` may see key ``cols`` (broadcast against each other): query i faces
    key i + shift (bottom-right alignment) and sees keys [i + shift - left, i + shift + right]."""
    diag = rows + shift
    if CAUSAL:
        keep = cols <= diag
    else:
        keep = (cols >= diag - left) & (cols <= diag + right)
    return keep


@triton.jit
def _softcap_r(x, scale):
    # r = 1 / (1 + e^(2 x scale)) in [0, 1], tanh(x · scale) = 1 - 2r, by rcp.approx (compiled code
    # only: PTX), unclamped (e^2x = inf gives r = 0). 1 - tanh² = 4 r (1 - r): a backward may take
    # r itself, one FMA a score fewer than forming t (hopper_bwd_jit._scored)
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f",
                                     [1.0 + tl.math.exp2(x * (scale * (2.0 * LOG2E_C)))],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tanh(x, scale, KIND: tl.constexpr):
    # tanh(x · scale) (a scalar scale: folded into the exp2's factor) from exp2 (the interpreter has no libdevice), as 1 - 2 / (1 + e^2x): one exp2 and one
    # reciprocal, within 3e-7 of tanh everywhere (absolute), which is what a score c·tanh(s / c)
    # needs while c·3e-7 stays far below the P's rounding (SOFTCAP_FAST; SOFTCAP_FAST_PTX takes
    # the reciprocal as rcp.approx, within 1 ulp, and unclamped: e^2x = inf gives t = 1, where the
    # division compiled to a full-range one after a clamp, 5 instructions more a score on sm_90).
    # SOFTCAP_PRECISE keeps the relative precision of float32 near 0 too, where that form cancels:
    # the odd Taylor series below 0.4, (1 - e)/(1 + e) with e = exp(-2|x|) above (both within
    # about 1e-7 relative there), for float32 inputs and caps too wide for the other
    if KIND == SOFTCAP_FAST_PTX:
        t = 1.0 - 2.0 * _softcap_r(x, scale)
    elif KIND == SOFTCAP_PRECISE:
        x = x * scale
        a = tl.abs(x)
        e = tl.math.exp2(a * (-2.0 * LOG2E_C))  # exp(-2|x|) in (0, 1]: cannot overflow
        far = (1.0 - e) / (1.0 + e)
        x2 = x * x
        near = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * (
                -0.008863235529902197 + x2 * 0.003592128036572481)))))
        t = tl.where(a < 0.4, near, tl.where(x < 0.0, -far, far))
    else:
        # clamped where t is 1 in float32 already (x > 43): e^2x stays finite (no overflow for
        # the interpreter's numpy to warn about) and 1 - 2 / (1 + 2^126) rounds to 1
        t = 1.0 - 2.0 / (1.0 + tl.math.exp2(tl.minimum(x * (scale * (2.0 * LOG2E_C)), 126.0)))
    return t


@triton.jit
def _scores(qk, rows, cols, shift, qk_scale, softcap2, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 scores s · log2 e from the dot products ``qk`` (``rows``/``cols`` broadcast to its
    shape), and t = tanh(s / softcap) for the softcap backward (``qk`` when SOFTCAP is off: unused).
    SOFTCAP: 0 off, else which tanh (SOFTCAP_FAST, _FAST_PTX or _PRECISE, see :func:`_tanh`)."""
    if SOFTCAP:
        t = _tanh(qk, qk_scale, SOFTCAP)  # qk_scale = sm_scale / softcap: the tanh's argument, natural units
        s = t * softcap2  # softcap · log2 e: base 2 only after the tanh
    else:
        t = qk
        s = qk * qk_scale  # qk_scale = sm_scale · log2 e
    if ALIBI:
        s = s - slope2 * tl.abs(rows + shift - cols).to(tl.float32)  # slope2 = slope · log2 e
    return s, t


@triton.jit
def _row_dots(a0, a1, b0, b1, BLOCK_D1: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a bᵀ (every row of a dotted with every row of b, float32) for a and b given as their two
    column blocks [a0 | a1], [b0 | b1]: the head dim is the sum, so the blocks' products add up."""
    x = _dot(a0, tl.trans(b0), None, UPCAST, PRECISION)
    if BLOCK_D1 > 0:
        x = _dot(a1, tl.trans(b1), x, UPCAST, PRECISION)
    return x


@triton.jit
def _dot_cols(a, b0, b1, acc0, acc1, BLOCK_D1: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a [b0 | b1] + [acc0 | acc1], column block by column block (an acc None: no addend)."""
    x0 = _dot(a, b0, acc0, UPCAST, PRECISION)
    x1 = NO_BLOCK
    if BLOCK_D1 > 0:
        x1 = _dot(a, b1, acc1, UPCAST, PRECISION)
    return x0, x1


@triton.jit
def _load_rows(src, off_z, off_h, start, stride_row, stride_d, N,
               BLOCK: tl.constexpr, COL: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK) x columns [COL, COL + WIDTH) of one head's (seq, head_dim) matrix.

    TMA: ``src`` is a 4-D tensor descriptor over (batch, heads, seq, head_dim), its box one head's
    (1, 1, BLOCK, WIDTH), and the head is (``off_z``, ``off_h``); the copy engine zero-fills rows
    past that head's N and columns past head_dim, so no mask is needed. Pointers: ``src`` points
    at the head (``off_z``/``off_h`` unused); only MASKED tiles (and columns past head_dim) pay
    for masks.
    """
    if TMA:
        x = src.load([off_z, off_h, start, COL]).reshape([BLOCK, WIDTH])
    else:
        rows = start + tl.arange(0, BLOCK)
        cols = COL + tl.arange(0, WIDTH)
        ptrs = src + rows[:, None] * stride_row + cols[None, :] * stride_d
        if MASKED:
            x = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < HEAD_DIM), other=0.0)
        elif COL + WIDTH > HEAD_DIM:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _load_tile(src, src1, off_z, off_h, start, stride_row, stride_d, N,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr):
    """(x0, x1): rows [start, start + BLOCK) of one head as the column blocks [0, BLOCK_D0) and
    [BLOCK_D0, BLOCK_D0 + BLOCK_D1) (x1 = NO_BLOCK when BLOCK_D1 = 0). TMA: ``src1`` is the
    descriptor for the second block; pointers: ``src`` serves both (see :func:`_load_rows`)."""
    x0 = _load_rows(src, off_z, off_h, start, stride_row, stride_d, N, BLOCK, 0, BLOCK_D0, HEAD_DIM, MASKED, TMA)
    x1 = NO_BLOCK
    if BLOCK_D1 > 0:
        x1 = _load_rows(src1 if TMA else src, off_z, off_h, start, stride_row, stride_d, N,
                        BLOCK, BLOCK_D0, BLOCK_D1, HEAD_DIM, MASKED, TMA)
    return x0, x1


@triton.jit
def _store_rows(dst, rows, row_ok, stride_row, stride_d, x, COL: tl.constexpr, WIDTH: tl.constexpr,
                HEAD_DIM: tl.constexpr, ATOMIC: tl.constexpr):
    cols = COL + tl.arange(0, WIDTH)
    ptrs = dst + rows[:, None] * stride_row + cols[None, :] * stride_d
    mask = row_ok[:, None]
    if COL + WIDTH > HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    if ATOMIC:  # float32 partial sums, added in whatever order they land
        tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(dst, rows, row_ok, stride_row, stride_d, x0, x1,
                HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, ATOMIC: tl.constexpr):
    """Store (or ATOMIC: add) the column blocks x0, x1 of rows ``rows`` where ``row_ok``."""
    _store_rows(dst, rows, row_ok, stride_row, stride_d, x0, 0, BLOCK_D0, HEAD_DIM, ATOMIC)
    if BLOCK_D1 > 0:
        _store_rows(dst, rows, row_ok, stride_row, stride_d, x1, BLOCK_D0, BLOCK_D1, HEAD_DIM, ATOMIC)


@triton.jit
def _attn_fwd_inner(acc0, acc1, l_i, m_i, q0, q1, k_src, k1_src, v_src, v1_src, off_z, off_hkv,
                    stride_kn, stride_kk, stride_vn, stride_vk,
                    offs_m, lo, hi, N_Q, N_K, qk_scale, softcap2, slope2, left, right,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    TMA: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    # WS: let the compiler split the loop into producer (TMA) and consumer warps (Hopper+)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        k0, k1 = _load_tile(k_src, k1_src, off_z, off_hkv, start_n, stride_kn, stride_kk, N_K,
                            BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED, TMA)
        v0, v1 = _load_tile(v_src, v1_src, off_z, off_hkv, start_n, stride_vn, stride_vk, N_K,
                            BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED, TMA)
        qk = _row_dots(q0, q1, k0, k1, BLOCK_D1, UPCAST, PRECISION)  # (BLOCK_M, BLOCK_N), float32
        # -- update m_i and l_i --
        if MASKED:
            qk, _ = _scores(qk, offs_m[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
            keep = cols[None, :] < N_K
            if CAUSAL or WINDOW:
                keep = keep & _in_window(offs_m[:, None], cols[None, :], N_K - N_Q, left, right, CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet keeps m = -inf (a window's row may see its first key
            # in a later block); subtracting 0 instead keeps exp2 below at 0, not NaN
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        elif SOFTCAP or ALIBI:
            qk, _ = _scores(qk, offs_m[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_ij
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale
            m_sub = m_ij
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update the output accumulator --
        acc0 = acc0 * alpha[:, None]
        if BLOCK_D1 > 0:
            acc1 = acc1 * alpha[:, None]
        acc0, acc1 = _dot_cols(p.to(v0.dtype), v0, v1, acc0, acc1, BLOCK_D1, UPCAST, PRECISION)
        m_i = m_ij
    return acc0, acc1, l_i, m_i


@triton.jit
def _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right, VARLEN: tl.constexpr, WINDOW: tl.constexpr):
    """Where sequence ``off_z`` is: (off_zq, off_zk, N_Q, N_K, right). Tensors are addressed as
    ``off_zq * stride_qz`` (and k's likewise): dense ones by batch index, packed ones (VARLEN)
    by their first row, the launcher passing a row's stride as the batch stride."""
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_z)
        k_start = tl.load(CU_SEQLENS_K + off_z)
        N_Q = tl.load(CU_SEQLENS_Q + off_z + 1) - q_start
        N_K = tl.load(CU_SEQLENS_K + off_z + 1) - k_start
        off_zq = q_start.to(tl.int64)
        off_zk = k_start.to(tl.int64)
        if WINDOW:  # a right side as wide as this sequence's keys is unbounded (dense: the launcher did it)
            win_right = tl.where(N_K <= win_right, UNBOUNDED_C, win_right)
    else:
        off_zq = off_z
        off_zk = off_z
    return off_zq, off_zk, N_Q, N_K, win_right


@triton.jit
def _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI: tl.constexpr):
    """This (batch, head)'s ALiBi slope times log2 e (slopes (H,) come with stride_az = 0)."""
    if ALIBI:
        slope2 = tl.load(ALIBI_SLOPES + off_z * stride_az + off_h * stride_ah) * LOG2E_C
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def tile_of(t, heads, blocks, ACROSS):
    """The t-th program of a grid over ``heads`` x ``blocks`` tiles (``t`` in the order programs
    start) as (head, rank), rank 0 being a head's heaviest block (causal: most keys or queries to
    visit). Head by head, or with ACROSS (1) rank r of every head before rank r + 1 of any: the
    grid then ends on light tiles instead of the last heads' heavy ones (at qwen2-1b's prefill,
    4 x 12 heads x 16 query tiles on 132 SMs, 1.18x an even load head by head and 1.01x across, in
    a dispatch model, NOTES v18) - but a head's tiles no longer run together, so the K/V (or Q/dO)
    they share is read again from HBM once the grid's exceeds L2 (``args.across_heads`` decides,
    NOTES v18)."""
    head = t // blocks
    rank = t % blocks
    if ACROSS:
        head = t % heads
        rank = t // heads
    return head, rank
