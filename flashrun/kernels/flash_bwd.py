"""The flash backward kernels: delta = rowsum(dO·O), then dK/dV per key block, which with
``ATOMIC_DQ`` also adds each tile's dQ partial into a float32 buffer (5 matmuls per tile pair):
on Hopper as one TMA reduce-add of the whole tile (``DQ_TMA``: ``cp.reduce.async.bulk``, what
FlashAttention-3 does), elsewhere as one float32 atomic per element; without it, dQ per query
block in a second kernel (7 matmuls, no atomics: deterministic). The maths is in
:mod:`flashrun.kernels.flash`."""

from __future__ import annotations

import triton
import triton.language as tl

from flashrun.kernels.flash_jit import (
    LOG2E_C,
    _alibi_slope2,
    _dot,
    _in_window,
    _key_range,
    _query_range,
    _scores,
    _sequence,
)

# ---------------------------------------------------------------------------------------------
# Backward kernels


@triton.jit
def _attn_bwd_preprocess(O, DO, Delta,
                         stride_oz, stride_oh, stride_om, stride_ok,
                         stride_doz, stride_doh, stride_dom, stride_dok,
                         H, N_Q,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok,
                mask=ok, other=0.0)
    do = tl.load(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dok, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # delta_i = rowsum(dO * O)
    tl.store(Delta + off_hz.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_row,
                         stride_qm, stride_qk, stride_dom, stride_dok, stride_dqm, stride_dqk,
                         offs_n, offs_d, lo, hi, N_Q, N_K, sm_scale, qk_scale, softcap2, slope2, left, right,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                         DQ_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
    key_ok = offs_n < N_K
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_Q
        # rows past N_Q load as zeros: their q, dO and delta are 0, so they add nothing
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dok,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        # a row that saw no key (LSE = -inf) has P = 0: make exp2 give 0, not inf
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        qkT = _dot(k, tl.trans(q), None, UPCAST, PRECISION)  # (BLOCK_N, BLOCK_M) = (Q Kᵀ)ᵀ
        sT, tT = _scores(qkT, offs_m[None, :], offs_n[:, None], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASKED:  # the causal diagonal or a window's edges
            pT = tl.where(_in_window(offs_m[None, :], offs_n[:, None], N_K - N_Q, left, right, CAUSAL), pT, 0.0)
        dv = _dot(pT.to(do.dtype), do, dv, UPCAST, PRECISION)  # dV += Pᵀ dO
        dpT = _dot(v, tl.trans(do), None, UPCAST, PRECISION)  # (dO Vᵀ)ᵀ
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # through s' = c·tanh(s/c): ds'/ds = 1 - tanh²
            dsT = dsT * (1.0 - tT * tT)
        if ATOMIC_DQ:
            # keys past N_K load as zeros, but against a very negative LSE their P = exp2(0 - lse2)
            # may be inf, and inf · 0 would put NaN into dQ: their dS must be exactly 0
            dsT = tl.where(key_ok[:, None], dsT, 0.0)
        dsT = dsT.to(q.dtype)
        dk = _dot(dsT, q, dk, UPCAST, PRECISION)  # dK += dSᵀ Q (scaled at the end)
        if ATOMIC_DQ:  # dQ[rows] += dS K · sm_scale, summed over key blocks in whatever order they land
            dq = _dot(tl.trans(dsT), k, None, UPCAST, PRECISION)  # (BLOCK_M, BLOCK_D)
            if DQ_TMA:
                # one bulk reduce-add of the tile through shared memory. Rows past N_Q belong to
                # the next head: zeroed (dS is 0 there, but 0 · a NaN key is NaN), they add 0.0
                dq = tl.where(row_ok[:, None], dq * sm_scale, 0.0)
                dq_base.atomic_add([dq_row + start_m, 0], dq)
            else:
                tl.atomic_add(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqk, dq * sm_scale,
                              mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, DQ,
                   stride_qz, stride_qh, stride_qm, stride_qk,
                   stride_kz, stride_kh, stride_kn, stride_kk,
                   stride_vz, stride_vh, stride_vn, stride_vk,
                   stride_doz, stride_doh, stride_dom, stride_dok,
                   stride_dkz, stride_dkh, stride_dkn, stride_dkk,
                   stride_dqz, stride_dqh, stride_dqm, stride_dqk,
                   stride_lz, stride_lh,
                   H, H_KV, N_Q, N_K, sm_scale,
                   qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                   CU_SEQLENS_Q, CU_SEQLENS_K,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                   ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr):
    """dK, dV for one block of keys of one k/v head; with ATOMIC_DQ also the dQ partials of every
    query block it visits, added into DQ (float32, zeroed by the launcher, any strides; scaled by
    sm_scale here) - with DQ_TMA, DQ is a tensor descriptor over its (batch*heads*Nq, head_dim)
    rows. LSE and Delta: (batch, heads, Nq) or, packed, (heads, total_q), addressed
    through stride_lz/stride_lh like the tensors (see _sequence)."""
    tl.static_assert(not (CAUSAL and WINDOW))
    start_n = tl.program_id(0) * BLOCK_N
    off_zh = tl.program_id(1)
    off_z = (off_zh // H_KV).to(tl.int64)
    off_hkv = off_zh % H_KV
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:
        if start_n >= N_K:  # a block past this sequence's keys
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    # k and v stay on chip while every query block that sees them streams past
    k = tl.load(K + off_zk * stride_kz + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk,
                mask=kv_ok, other=0.0)
    v = tl.load(V + off_zk * stride_vz + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vk,
                mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _query_range(start_n, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # GQA: dK/dV of a shared k/v head sum over its query heads - here, in order, without atomics
    # (each query head's dQ rows are its own: the group adds nothing to dQ's contention)
    for g in range(GROUP):
        off_h = off_hkv * GROUP + g
        q_base = Q + off_zq * stride_qz + off_h * stride_qh
        do_base = DO + off_zq * stride_doz + off_h * stride_doh
        lse_base = LSE + off_zq * stride_lz + off_h * stride_lh
        delta_base = Delta + off_zq * stride_lz + off_h * stride_lh  # Delta is laid out as LSE
        dq_base = DQ  # None unless ATOMIC_DQ; the descriptor itself with DQ_TMA
        dq_row = ((off_z * H + off_h) * N_Q).to(tl.int32)  # DQ_TMA: this head's first row (< 2**31)
        if ATOMIC_DQ and not DQ_TMA:
            dq_base = DQ + off_zq * stride_dqz + off_h * stride_dqh
        slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
        if CAUSAL or WINDOW:  # the causal diagonal or the window's first edge - masked
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                          dq_row, stride_qm, stride_qk, stride_dom, stride_dok, stride_dqm, stride_dqk,
                                          offs_n, offs_d, lo, mid_lo, N_Q, N_K, sm_scale, qk_scale, softcap2,
                                          slope2, win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL,
                                          WINDOW, SOFTCAP, ALIBI, ATOMIC_DQ, DQ_TMA, UPCAST, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                      dq_row, stride_qm, stride_qk, stride_dom, stride_dok, stride_dqm, stride_dqk,
                                      offs_n, offs_d, mid_lo, mid_hi, N_Q, N_K, sm_scale, qk_scale, softcap2,
                                      slope2, win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, False, CAUSAL,
                                      WINDOW, SOFTCAP, ALIBI, ATOMIC_DQ, DQ_TMA, UPCAST, PRECISION)
        if WINDOW:  # the window's other edge - masked
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                          dq_row, stride_qm, stride_qk, stride_dom, stride_dok, stride_dqm, stride_dqk,
                                          offs_n, offs_d, mid_hi, hi, N_Q, N_K, sm_scale, qk_scale, softcap2,
                                          slope2, win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL,
                                          WINDOW, SOFTCAP, ALIBI, ATOMIC_DQ, DQ_TMA, UPCAST, PRECISION)
    dk *= sm_scale
    out = off_zk * stride_dkz + off_hkv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkk
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)  # DV shares DK's (contiguous) strides


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                       offs_m, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap2, slope2, left, right,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = d_ok[None, :]
        if MASKED:
            kv_ok = kv_ok & (cols[:, None] < N_K)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kk, mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vk, mask=kv_ok, other=0.0)
        qk = _dot(q, tl.trans(k), None, UPCAST, PRECISION)
        s, t = _scores(qk, offs_m[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < N_K
            if CAUSAL or WINDOW:
                keep = keep & _in_window(offs_m[:, None], cols[None, :], N_K - N_Q, left, right, CAUSAL)
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), None, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # through s' = c·tanh(s/c): ds'/ds = 1 - tanh²
            ds = ds * (1.0 - t * t)
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST, PRECISION)  # dQ += dS K (scaled at the end)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ,
                 stride_qz, stride_qh, stride_qm, stride_qk,
                 stride_kz, stride_kh, stride_kn, stride_kk,
                 stride_vz, stride_vh, stride_vn, stride_vk,
                 stride_doz, stride_doh, stride_dom, stride_dok,
                 stride_dqz, stride_dqh, stride_dqm, stride_dqk,
                 stride_lz, stride_lh,
                 H, N_Q, N_K, sm_scale,
                 qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                 CU_SEQLENS_Q, CU_SEQLENS_K,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    tl.static_assert(not (CAUSAL and WINDOW))
    pid_m = tl.program_id(0)
    if CAUSAL or WINDOW:  # heaviest query tiles first, as in the forward
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    off_hkv = off_h // GROUP
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:
        if start_m >= N_Q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + off_zq * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                mask=ok, other=0.0)
    do = tl.load(DO + off_zq * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dok, mask=ok, other=0.0)
    lse = tl.load(LSE + off_zq * stride_lz + off_h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    delta = tl.load(Delta + off_zq * stride_lz + off_h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)  # no key seen -> P = 0
    k_base = K + off_zk * stride_kz + off_hkv * stride_kh
    v_base = V + off_zk * stride_vz + off_hkv * stride_vh
    slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_range(start_m, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if WINDOW:  # the window's left edge - masked
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                                offs_m, offs_d, lo, mid_lo, N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                                BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                            offs_m, offs_d, mid_lo, mid_hi, N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                            BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kk, stride_vn, stride_vk,
                            offs_m, offs_d, mid_hi, hi, N_Q, N_K, qk_scale, softcap2, slope2, win_left, win_right,
                            BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION)
    dq *= sm_scale
    tl.store(DQ + off_zq * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqk,
             dq.to(DQ.dtype.element_ty), mask=ok)


