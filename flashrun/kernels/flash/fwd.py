"""The flash forward kernel: one query tile streams K/V (``_attn_fwd``). The maths is in
:mod:`flashrun.kernels.flash`; flash-decoding's kernels are in :mod:`.decode_jit`."""

from __future__ import annotations

import triton
import triton.language as tl

from flashrun.kernels.flash.jit import (
    LOG2E_C,
    NO_BLOCK,
    _alibi_slope2,
    _attn_fwd_inner,
    _key_range,
    _load_tile,
    _sequence,
    _store_tile,
    tile_of,
)

# ---------------------------------------------------------------------------------------------
# Forward kernel


# ACROSS (jit.tile_of's order, 0 or 1) is not specialized: the two would compile apart
@triton.jit(do_not_specialize=["ACROSS"])
def _attn_fwd(Q, K, V, Q1, K1, V1, O, LSE,
              stride_qz, stride_qh, stride_qm, stride_qk,
              stride_kz, stride_kh, stride_kn, stride_kk,
              stride_vz, stride_vh, stride_vn, stride_vk,
              stride_oz, stride_oh, stride_om, stride_ok,
              stride_lz, stride_lh,
              H, N_Q, N_K, ACROSS,
              qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right, CU_SEQLENS_Q, CU_SEQLENS_K,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """Q, K, V are tensors, or (TMA) 4-D descriptors over their (batch, heads, seq, head_dim).
    The head dim is the column blocks [0, BLOCK_D0) and [BLOCK_D0, BLOCK_D0 + BLOCK_D1)
    (BLOCK_D1 = 0: one block); Q1, K1, V1 are the second block's descriptors (TMA and
    BLOCK_D1 > 0), None otherwise.
    VARLEN: sequence z is rows [CU_SEQLENS_Q[z], CU_SEQLENS_Q[z + 1]) of the packed tensors, and
    N_Q/N_K (the grid's) are the longest lengths; each program reads its sequence's own."""
    tl.static_assert(BLOCK_D0 + BLOCK_D1 >= HEAD_DIM)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(not (CAUSAL and WINDOW))  # the launcher folds causal into the window
    tl.static_assert(not (TMA and VARLEN))  # a packed head's rows are not one block of rows
    pid_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    if CAUSAL or WINDOW:  # the last query tiles see the most keys: start them first, so no straggler ends the grid
        off_hz, rank = tile_of(pid_m + off_hz * tl.num_programs(0), tl.num_programs(1), tl.num_programs(0),
                               ACROSS)
        pid_m = tl.num_programs(0) - 1 - rank
    start_m = pid_m * BLOCK_M
    off_z = (off_hz // H).to(tl.int64)  # int64: batch offsets can pass 2**31 elements
    off_h = off_hz % H
    off_hkv = off_h // GROUP  # GQA: GROUP query heads share one k/v head
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:  # (a constexpr: dense kernels compile no check)
        if start_m >= N_Q:  # a tile past this (shorter) sequence's end
            return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # the output as its column blocks (acc1: (BLOCK_M, BLOCK_D1), or none)
    acc0 = tl.zeros([BLOCK_M, BLOCK_D0], dtype=tl.float32)
    acc1 = NO_BLOCK
    if BLOCK_D1 > 0:
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    # q stays in registers/SRAM for the whole loop over K/V
    if TMA:  # 4-D descriptors, addressed by (batch, head): rows past N_Q come back zero, never stored
        off_b = off_hz // H
        q0, q1 = _load_tile(Q, Q1, off_b, off_h, start_m, stride_qm, stride_qk, N_Q,
                            BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, False, True)
        k_src = K
        v_src = V
    else:
        off_b = 0
        q_src = Q + off_zq * stride_qz + off_h * stride_qh
        q0, q1 = _load_tile(q_src, q_src, 0, 0, start_m, stride_qm, stride_qk, N_Q,
                            BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, False)
        k_src = K + off_zk * stride_kz + off_hkv * stride_kh
        v_src = V + off_zk * stride_vz + off_hkv * stride_vh
    slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)

    lo, mid_lo, mid_hi, hi = _key_range(start_m, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if WINDOW:  # stage 0: the window's left edge - masked
        acc0, acc1, l_i, m_i = _attn_fwd_inner(acc0, acc1, l_i, m_i, q0, q1, k_src, K1, v_src, V1, off_b, off_hkv,
                                               stride_kn, stride_kk, stride_vn, stride_vk, offs_m, lo, mid_lo,
                                               N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                                               BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, CAUSAL, WINDOW,
                                               SOFTCAP, ALIBI, UPCAST, PRECISION, TMA, False)
    # stage 1: key blocks every row of the tile sees in full - no mask
    acc0, acc1, l_i, m_i = _attn_fwd_inner(acc0, acc1, l_i, m_i, q0, q1, k_src, K1, v_src, V1, off_b, off_hkv,
                                           stride_kn, stride_kk, stride_vn, stride_vk, offs_m, mid_lo, mid_hi,
                                           N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                                           BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, False, CAUSAL, WINDOW,
                                           SOFTCAP, ALIBI, UPCAST, PRECISION, TMA, WS)
    # stage 2: the causal diagonal or the window's right edge, and the ragged end of the sequence - masked
    acc0, acc1, l_i, m_i = _attn_fwd_inner(acc0, acc1, l_i, m_i, q0, q1, k_src, K1, v_src, V1, off_b, off_hkv,
                                           stride_kn, stride_kk, stride_vn, stride_vk, offs_m, mid_hi, hi,
                                           N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                                           BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, CAUSAL, WINDOW,
                                           SOFTCAP, ALIBI, UPCAST, PRECISION, TMA, False)

    # -- epilogue: normalize; rows that saw no key output 0 and LSE = -inf --
    # (one reciprocal per row and a multiply per output: a division per output is several
    # instructions, 32 per thread at 64 x 64)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    inv_l = 1.0 / l_safe
    acc0 = acc0 * inv_l[:, None]
    if BLOCK_D1 > 0:
        acc1 = acc1 * inv_l[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) / LOG2E_C, float("-inf"))
    row_ok = offs_m < N_Q
    tl.store(LSE + off_zq * stride_lz + off_h * stride_lh + offs_m, lse, mask=row_ok)
    _store_tile(O + off_zq * stride_oz + off_h * stride_oh, offs_m, row_ok, stride_om, stride_ok, acc0, acc1,
                HEAD_DIM, BLOCK_D0, BLOCK_D1, False)
