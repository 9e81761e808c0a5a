"""The FP8 (e4m3) forward kernel: one query tile streams K/V, both products in fp8 with float32
accumulation. What it computes and why is in :mod:`.fp8`."""

from __future__ import annotations

import triton
import triton.language as tl

from flashrun.kernels.flash.jit import LOG2E_C, _in_window, _key_range

# P is exp2(s - m + P_SHIFT) in [0, 2**P_SHIFT] before its cast to e4m3, not in [0, 1]: more of
# e4m3's exponent range holds the probabilities, fewer of them flush to zero (FlashAttention-3's
# Max_offset = 8). The row sum carries the same factor, so it cancels in the normalization.
P_SHIFT = tl.constexpr(8.0)


@triton.jit
def _e4m3_nearest(x):
    """``x`` (>= 0) rounded to the nearest e4m3 value in float32, so that its cast to e4m3 is exact.
    Used only through Triton's interpreter, whose float -> e4m3 cast is wrong where rounding carries
    into the exponent (0.49 becomes 0.25); the GPU's cast rounds to nearest itself."""
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(x, 1e-30))), -6.0)  # e4m3: 3 mantissa bits, subnormal below 2**-6
    step = tl.exp2(e - 3.0)
    return tl.minimum(tl.floor(x / step + 0.5) * step, 448.0)


@triton.jit
def _fp8_inner(acc, l_i, m_i, q, K, V, lo, hi, offs_m, N_Q, N_K, stride_kn, stride_kk, stride_vn, stride_vk,
               qk_scale, left, right, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, INTERPRETED: tl.constexpr):
    """Keys [lo, hi) into the running softmax of the tile's rows. ``qk_scale`` holds the scale, the
    descales of q and k, and 1/ln(2) (we use exp2); MASKED blocks mask the causal diagonal, a
    window's edges and the ragged end."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    shift = N_K - N_Q  # bottom-right alignment: query i faces key i + shift
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = (cols < N_K)[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kk, mask=col_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), float32, log2 units
        if MASKED:
            keep = (cols < N_K)[None, :]
            if CAUSAL or WINDOW:
                keep = keep & _in_window(offs_m[:, None], cols[None, :], shift, left, right, CAUSAL)
            s = tl.where(keep, s, float("-inf"))
        # -- update m_i and l_i --
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij) - P_SHIFT  # a row with no key yet: exp2 gives 0
        p = tl.math.exp2(s - m_sub[:, None])  # in [0, 2**P_SHIFT]
        alpha = tl.math.exp2(m_i - m_ij)
        alpha = tl.where(m_ij == float("-inf"), 1.0, alpha)
        if INTERPRETED:
            p = _e4m3_nearest(p)
        p8 = p.to(tl.float8e4nv)
        l_i = l_i * alpha + tl.sum(p8.to(tl.float32), 1)  # the probabilities the product uses, as rounded
        # -- update the output accumulator --
        v = tl.load(V + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vk, mask=col_ok, other=0.0)
        acc = tl.dot(p8, v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_fp8(Q, K, V, O, Q_DESCALE, K_DESCALE, V_DESCALE,
                  stride_qz, stride_qh, stride_qm, stride_qk,
                  stride_kz, stride_kh, stride_kn, stride_kk,
                  stride_vz, stride_vh, stride_vn, stride_vk,
                  stride_oz, stride_oh, stride_om, stride_ok,
                  stride_dz, stride_dh,
                  H, N_Q, N_K, sm_scale, win_left, win_right,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (query tile, batch * H + head). Q, K, V are e4m3, addressed as (batch, head, seq,
    dim) through their strides (V may be laid out seq-contiguous, as :func:`.fp8.quantize_qkv`
    writes it for the GPU's fp8 products); the descales are float32 per (batch, kv head)
    (``stride_dz = stride_dh = 0``: one for the whole tensor). O is bf16."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(not (CAUSAL and WINDOW))  # the launcher folds causal into the window
    start_m = tl.program_id(0) * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)  # int64: batch offsets can pass 2**31 elements
    off_h = off_hz % H
    off_hkv = off_h // GROUP  # GQA: GROUP query heads share one k/v head
    descale = off_z * stride_dz + off_hkv * stride_dh
    qk_scale = sm_scale * LOG2E_C * tl.load(Q_DESCALE + descale) * tl.load(K_DESCALE + descale)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    q = tl.load(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qk, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_src = K + off_z * stride_kz + off_hkv * stride_kh
    v_src = V + off_z * stride_vz + off_hkv * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_range(start_m, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if WINDOW:  # stage 0: the window's left edge - masked
        acc, l_i, m_i = _fp8_inner(acc, l_i, m_i, q, k_src, v_src, lo, mid_lo, offs_m, N_Q, N_K, stride_kn,
                                   stride_kk, stride_vn, stride_vk, qk_scale, win_left, win_right, BLOCK_N,
                                   BLOCK_D, HEAD_DIM, True, CAUSAL, WINDOW, INTERPRETED)
    # stage 1: key blocks every row of the tile sees in full - no mask
    acc, l_i, m_i = _fp8_inner(acc, l_i, m_i, q, k_src, v_src, mid_lo, mid_hi, offs_m, N_Q, N_K, stride_kn,
                               stride_kk, stride_vn, stride_vk, qk_scale, win_left, win_right, BLOCK_N,
                               BLOCK_D, HEAD_DIM, False, CAUSAL, WINDOW, INTERPRETED)
    # stage 2: the causal diagonal or the window's right edge, and the ragged end - masked
    acc, l_i, m_i = _fp8_inner(acc, l_i, m_i, q, k_src, v_src, mid_hi, hi, offs_m, N_Q, N_K, stride_kn,
                               stride_kk, stride_vn, stride_vk, qk_scale, win_left, win_right, BLOCK_N,
                               BLOCK_D, HEAD_DIM, True, CAUSAL, WINDOW, INTERPRETED)

    # -- epilogue: normalize (V's descale with it); rows that saw no key output 0 --
    seen = l_i > 0.0
    inv_l = tl.load(V_DESCALE + descale) / tl.where(seen, l_i, 1.0)
    o = acc * inv_l[:, None]
    tl.store(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
             + offs_d[None, :] * stride_ok, o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
