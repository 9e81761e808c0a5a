"""The flash backward kernels: delta = rowsum(dO·O), then dK/dV per key block, which with
``ATOMIC_DQ`` also adds each tile's dQ partial into a float32 buffer (5 matmuls per tile pair):
on Hopper as one TMA reduce-add of the whole tile (``DQ_TMA``: ``cp.reduce.async.bulk``, what
FlashAttention-3 does), elsewhere as one float32 atomic per element; without it, dQ per query
block in a second kernel (7 matmuls, no atomics: deterministic). Each kernel has two loops, the
unmasked blocks' then the masked blocks' (see :func:`_attn_bwd_dkdv_inner`). The maths is in
:mod:`flashrun.kernels.flash`."""

from __future__ import annotations

import triton
import triton.language as tl

from flashrun.kernels.flash.jit import (
    LOG2E_C,
    NO_BLOCK,
    _alibi_slope2,
    _dot_cols,
    _in_window,
    _key_range,
    _load_tile,
    _query_range,
    _row_dots,
    _scores,
    _sequence,
    _store_tile,
    tile_of,
)

# ---------------------------------------------------------------------------------------------
# Backward kernels
#
# As in the forward, the head dim is the column blocks [0, BLOCK_D0) and [BLOCK_D0, BLOCK_D0 +
# BLOCK_D1) (BLOCK_D1 = 0: one block): every (rows, head_dim) tile is a pair x0, x1, products
# over the head dim (Q Kᵀ, dO Vᵀ) sum both blocks' dots, and dQ, dK, dV accumulate per block.


@triton.jit
def _attn_bwd_preprocess(O, DO, Delta,
                         stride_oz, stride_oh, stride_om, stride_ok,
                         stride_doz, stride_doh, stride_dom, stride_dok,
                         H, N_Q,
                         HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o_src = O + off_z * stride_oz + off_h * stride_oh
    o0, o1 = _load_tile(o_src, o_src, 0, 0, start_m, stride_om, stride_ok, N_Q, BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        True, False)
    do_src = DO + off_z * stride_doz + off_h * stride_doh
    do0, do1 = _load_tile(do_src, do_src, 0, 0, start_m, stride_dom, stride_dok, N_Q, BLOCK_M, HEAD_DIM, BLOCK_D0,
                          BLOCK_D1, True, False)
    delta = tl.sum(o0.to(tl.float32) * do0.to(tl.float32), axis=1)  # delta_i = rowsum(dO * O)
    if BLOCK_D1 > 0:
        delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), axis=1)
    tl.store(Delta + off_hz.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _block_start(j, n_a, lo_a, lo_b, BLOCK: tl.constexpr):
    """The j-th block of two block ranges walked back to back: n_a blocks from lo_a, then from lo_b."""
    return tl.where(j < n_a, lo_a + j * BLOCK, lo_b + (j - n_a) * BLOCK)


@triton.jit
def _attn_bwd_dkdv_inner(dk0, dk1, dv0, dv1, k0, k1, v0, v1, Q, DO, LSE, Delta, DQ, off_z, off_zq, off_hkv,
                         stride_qz, stride_qh, stride_qm, stride_qk, stride_doz, stride_doh, stride_dom, stride_dok,
                         stride_dqz, stride_dqh, stride_dqm, stride_dqk, stride_lz, stride_lh,
                         offs_n, n_a, lo_a, n_b, lo_b, H, N_Q, N_K, sm_scale, qk_scale, softcap2,
                         ALIBI_SLOPES, stride_az, stride_ah, left, right,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr,
                         BLOCK_D1: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                         DQ_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One loop over the query blocks [lo_a, +n_a blocks) then [lo_b, +n_b blocks) of every query
    head of the GQA group, in that order (head-major): a single loop, not one per head and
    range - ptxas serializes every wgmma of a loop that follows another loop carrying the same
    accumulators (its warning C7515), and a loop nest costs registers."""
    key_ok = offs_n < N_K
    steps = n_a + n_b
    for it in tl.range(0, GROUP * steps):
        if GROUP > 1:
            g = it // steps
            j = it - g * steps
        else:
            g = 0
            j = it
        start_m = _block_start(j, n_a, lo_a, lo_b, BLOCK_M)
        # GQA: dK/dV of a shared k/v head sum over its query heads, here in order, without atomics
        # (each query head's dQ rows are its own: the group adds nothing to dQ's contention)
        off_h = off_hkv * GROUP + g
        q_base = Q + off_zq * stride_qz + off_h * stride_qh
        do_base = DO + off_zq * stride_doz + off_h * stride_doh
        lse_base = LSE + off_zq * stride_lz + off_h * stride_lh
        delta_base = Delta + off_zq * stride_lz + off_h * stride_lh  # Delta is laid out as LSE
        slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_Q
        # rows past N_Q load as zeros: their q, dO and delta are 0, so they add nothing
        q0, q1 = _load_tile(q_base, q_base, 0, 0, start_m, stride_qm, stride_qk, N_Q,
                            BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, False)
        do0, do1 = _load_tile(do_base, do_base, 0, 0, start_m, stride_dom, stride_dok, N_Q,
                              BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, False)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        # a row that saw no key (LSE = -inf) has P = 0: make exp2 give 0, not inf
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        qkT = _row_dots(k0, k1, q0, q1, BLOCK_D1, UPCAST, PRECISION)  # (BLOCK_N, BLOCK_M) = (Q Kᵀ)ᵀ
        sT, tT = _scores(qkT, offs_m[None, :], offs_n[:, None], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASKED:  # the causal diagonal or a window's edges
            pT = tl.where(_in_window(offs_m[None, :], offs_n[:, None], N_K - N_Q, left, right, CAUSAL), pT, 0.0)
        dv0, dv1 = _dot_cols(pT.to(do0.dtype), do0, do1, dv0, dv1, BLOCK_D1, UPCAST, PRECISION)  # dV += Pᵀ dO
        dpT = _row_dots(v0, v1, do0, do1, BLOCK_D1, UPCAST, PRECISION)  # (dO Vᵀ)ᵀ
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # through s' = c·tanh(s/c): ds'/ds = 1 - tanh²
            dsT = dsT * (1.0 - tT * tT)
        if ATOMIC_DQ:
            # keys past N_K load as zeros, but against a very negative LSE their P = exp2(0 - lse2)
            # may be inf, and inf · 0 would put NaN into dQ: their dS must be exactly 0
            dsT = tl.where(key_ok[:, None], dsT, 0.0)
        dsT = dsT.to(q0.dtype)
        dk0, dk1 = _dot_cols(dsT, q0, q1, dk0, dk1, BLOCK_D1, UPCAST, PRECISION)  # dK += dSᵀ Q (scaled at the end)
        if ATOMIC_DQ:  # dQ[rows] += dS K · sm_scale, summed over key blocks in whatever order they land
            dq0, dq1 = _dot_cols(tl.trans(dsT), k0, k1, None, None, BLOCK_D1, UPCAST, PRECISION)  # (BLOCK_M, ·)
            dq0 = dq0 * sm_scale
            if BLOCK_D1 > 0:
                dq1 = dq1 * sm_scale
            if DQ_TMA:  # (one column block: the launcher splits no head dim on this path)
                # one bulk reduce-add of the tile through shared memory, DQ a descriptor over all
                # (batch*heads*Nq, head_dim) rows. Rows past N_Q belong to the next head: zeroed
                # (dS is 0 there, but 0 · a NaN key is NaN), they add 0.0
                dq_row = ((off_z * H + off_h) * N_Q).to(tl.int32)  # this head's first row (< 2**31)
                DQ.atomic_add([dq_row + start_m, 0], tl.where(row_ok[:, None], dq0, 0.0))
            else:
                _store_tile(DQ + off_zq * stride_dqz + off_h * stride_dqh, offs_m, row_ok, stride_dqm, stride_dqk,
                            dq0, dq1, HEAD_DIM, BLOCK_D0, BLOCK_D1, True)
    return dk0, dk1, dv0, dv1


@triton.jit(do_not_specialize=["ACROSS"])  # (as _attn_fwd's)
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, DQ,
                   stride_qz, stride_qh, stride_qm, stride_qk,
                   stride_kz, stride_kh, stride_kn, stride_kk,
                   stride_vz, stride_vh, stride_vn, stride_vk,
                   stride_doz, stride_doh, stride_dom, stride_dok,
                   stride_dkz, stride_dkh, stride_dkn, stride_dkk,
                   stride_dqz, stride_dqh, stride_dqm, stride_dqk,
                   stride_lz, stride_lh,
                   H, H_KV, N_Q, N_K, ACROSS, sm_scale,
                   qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                   CU_SEQLENS_Q, CU_SEQLENS_K,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                   ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, KV_SPLIT: tl.constexpr = 1, ADD_KV: tl.constexpr = False):
    """dK, dV for one block of keys of one k/v head; with ATOMIC_DQ also the dQ partials of every
    query block it visits, added into DQ (float32, zeroed by the launcher, any strides; scaled by
    sm_scale here) - with DQ_TMA, DQ is a tensor descriptor over its (batch*heads*Nq, head_dim)
    rows. LSE and Delta: (batch, heads, Nq) or, packed, (heads, total_q), addressed
    through stride_lz/stride_lh like the tensors (see _sequence).

    KV_SPLIT > 1 splits each k/v head's GQA group over that many programs (H_KV and GROUP are
    then per part: H_KV parts of GROUP query heads): part p of k/v head p // KV_SPLIT writes its
    partial dK/dV as head p of DK/DV (float32), which the launcher sums - or with ADD_KV adds it
    into head p // KV_SPLIT of DK/DV (float32, zeroed), in whatever order the parts land."""
    tl.static_assert(not (CAUSAL and WINDOW))
    pid_n = tl.program_id(0)
    off_zh = tl.program_id(1)
    if CAUSAL or WINDOW:  # the first key blocks are seen by the most queries (tile_of)
        off_zh, pid_n = tile_of(pid_n + off_zh * tl.num_programs(0), tl.num_programs(1), tl.num_programs(0),
                                ACROSS)
    start_n = pid_n * BLOCK_N
    off_z = (off_zh // H_KV).to(tl.int64)
    off_hkv = off_zh % H_KV
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:
        if start_n >= N_K:  # a block past this sequence's keys
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # k and v stay on chip while every query block that sees them streams past
    k_src = K + off_zk * stride_kz + (off_hkv // KV_SPLIT) * stride_kh
    k0, k1 = _load_tile(k_src, k_src, 0, 0, start_n, stride_kn, stride_kk, N_K, BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        True, False)
    v_src = V + off_zk * stride_vz + (off_hkv // KV_SPLIT) * stride_vh
    v0, v1 = _load_tile(v_src, v_src, 0, 0, start_n, stride_vn, stride_vk, N_K, BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        True, False)
    dk0 = tl.zeros([BLOCK_N, BLOCK_D0], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, BLOCK_D0], dtype=tl.float32)
    dk1 = NO_BLOCK
    dv1 = NO_BLOCK
    if BLOCK_D1 > 0:
        dk1 = tl.zeros([BLOCK_N, BLOCK_D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N, BLOCK_D1], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _query_range(start_n, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # the query blocks that see every key of the block first, unmasked; then the causal diagonal
    # or the window's two edges, masked, in one more loop (in this order: see _attn_bwd_dkdv_inner)
    dk0, dk1, dv0, dv1 = _attn_bwd_dkdv_inner(
        dk0, dk1, dv0, dv1, k0, k1, v0, v1, Q, DO, LSE, Delta, DQ, off_z, off_zq, off_hkv,
        stride_qz, stride_qh, stride_qm, stride_qk, stride_doz, stride_doh, stride_dom, stride_dok,
        stride_dqz, stride_dqh, stride_dqm, stride_dqk, stride_lz, stride_lh,
        offs_n, tl.cdiv(mid_hi - mid_lo, BLOCK_M), mid_lo, 0, mid_hi, H, N_Q, N_K, sm_scale, qk_scale, softcap2,
        ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
        GROUP, BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, False, CAUSAL, WINDOW, SOFTCAP, ALIBI, ATOMIC_DQ,
        DQ_TMA, UPCAST, PRECISION)
    if CAUSAL or WINDOW:
        n_right = tl.cdiv(hi - mid_hi, BLOCK_M)
        if CAUSAL:  # (a constant: the rows past the diagonal see the whole block)
            n_right = 0
        dk0, dk1, dv0, dv1 = _attn_bwd_dkdv_inner(
            dk0, dk1, dv0, dv1, k0, k1, v0, v1, Q, DO, LSE, Delta, DQ, off_z, off_zq, off_hkv,
            stride_qz, stride_qh, stride_qm, stride_qk, stride_doz, stride_doh, stride_dom, stride_dok,
            stride_dqz, stride_dqh, stride_dqm, stride_dqk, stride_lz, stride_lh,
            offs_n, tl.cdiv(mid_lo - lo, BLOCK_M), lo, n_right, mid_hi, H, N_Q, N_K,
            sm_scale, qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
            GROUP, BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, ATOMIC_DQ,
            DQ_TMA, UPCAST, PRECISION)
    dk0 *= sm_scale
    if BLOCK_D1 > 0:
        dk1 *= sm_scale
    # DV shares DK's (contiguous) strides
    off_out = off_hkv // KV_SPLIT if ADD_KV else off_hkv
    dk_dst = DK + off_zk * stride_dkz + off_out * stride_dkh
    dv_dst = DV + off_zk * stride_dkz + off_out * stride_dkh
    key_ok = offs_n < N_K
    _store_tile(dk_dst, offs_n, key_ok, stride_dkn, stride_dkk, dk0, dk1, HEAD_DIM, BLOCK_D0, BLOCK_D1, ADD_KV)
    _store_tile(dv_dst, offs_n, key_ok, stride_dkn, stride_dkk, dv0, dv1, HEAD_DIM, BLOCK_D0, BLOCK_D1, ADD_KV)


@triton.jit
def _attn_bwd_dq_inner(dq0, dq1, q0, q1, do0, do1, lse2, delta, k_base, v_base,
                       stride_kn, stride_kk, stride_vn, stride_vk,
                       offs_m, n_a, lo_a, n_b, lo_b, N_Q, N_K, qk_scale, softcap2, slope2, left, right,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One loop over the key blocks [lo_a, +n_a blocks) then [lo_b, +n_b blocks) (see
    _attn_bwd_dkdv_inner for why one)."""
    offs_n = tl.arange(0, BLOCK_N)
    for j in tl.range(0, n_a + n_b):
        start_n = _block_start(j, n_a, lo_a, lo_b, BLOCK_N)
        cols = start_n + offs_n
        k0, k1 = _load_tile(k_base, k_base, 0, 0, start_n, stride_kn, stride_kk, N_K,
                            BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED, False)
        v0, v1 = _load_tile(v_base, v_base, 0, 0, start_n, stride_vn, stride_vk, N_K,
                            BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED, False)
        qk = _row_dots(q0, q1, k0, k1, BLOCK_D1, UPCAST, PRECISION)
        s, t = _scores(qk, offs_m[:, None], cols[None, :], N_K - N_Q, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < N_K
            if CAUSAL or WINDOW:
                keep = keep & _in_window(offs_m[:, None], cols[None, :], N_K - N_Q, left, right, CAUSAL)
            p = tl.where(keep, p, 0.0)
        dp = _row_dots(do0, do1, v0, v1, BLOCK_D1, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # through s' = c·tanh(s/c): ds'/ds = 1 - tanh²
            ds = ds * (1.0 - t * t)
        # dQ += dS K (scaled at the end)
        dq0, dq1 = _dot_cols(ds.to(k0.dtype), k0, k1, dq0, dq1, BLOCK_D1, UPCAST, PRECISION)
    return dq0, dq1


@triton.jit(do_not_specialize=["ACROSS"])  # (as _attn_fwd's)
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ,
                 stride_qz, stride_qh, stride_qm, stride_qk,
                 stride_kz, stride_kh, stride_kn, stride_kk,
                 stride_vz, stride_vh, stride_vn, stride_vk,
                 stride_doz, stride_doh, stride_dom, stride_dok,
                 stride_dqz, stride_dqh, stride_dqm, stride_dqk,
                 stride_lz, stride_lh,
                 H, N_Q, N_K, ACROSS, sm_scale,
                 qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                 CU_SEQLENS_Q, CU_SEQLENS_K,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    tl.static_assert(not (CAUSAL and WINDOW))
    pid_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    if CAUSAL or WINDOW:  # heaviest query tiles first, as in the forward
        off_hz, rank = tile_of(pid_m + off_hz * tl.num_programs(0), tl.num_programs(1), tl.num_programs(0),
                               ACROSS)
        pid_m = tl.num_programs(0) - 1 - rank
    start_m = pid_m * BLOCK_M
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    off_hkv = off_h // GROUP
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:
        if start_m >= N_Q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_Q
    q_src = Q + off_zq * stride_qz + off_h * stride_qh
    q0, q1 = _load_tile(q_src, q_src, 0, 0, start_m, stride_qm, stride_qk, N_Q, BLOCK_M, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        True, False)
    do_src = DO + off_zq * stride_doz + off_h * stride_doh
    do0, do1 = _load_tile(do_src, do_src, 0, 0, start_m, stride_dom, stride_dok, N_Q, BLOCK_M, HEAD_DIM, BLOCK_D0,
                          BLOCK_D1, True, False)
    lse = tl.load(LSE + off_zq * stride_lz + off_h * stride_lh + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + off_zq * stride_lz + off_h * stride_lh + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)  # no key seen -> P = 0
    k_base = K + off_zk * stride_kz + off_hkv * stride_kh
    v_base = V + off_zk * stride_vz + off_hkv * stride_vh
    slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
    dq0 = tl.zeros([BLOCK_M, BLOCK_D0], dtype=tl.float32)
    dq1 = NO_BLOCK
    if BLOCK_D1 > 0:
        dq1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_range(start_m, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # the key blocks every row sees first, unmasked; then the window's left edge and the causal
    # diagonal, the window's right edge or the ragged end, masked, in one loop
    dq0, dq1 = _attn_bwd_dq_inner(dq0, dq1, q0, q1, do0, do1, lse2, delta, k_base, v_base,
                                  stride_kn, stride_kk, stride_vn, stride_vk, offs_m,
                                  tl.cdiv(mid_hi - mid_lo, BLOCK_N), mid_lo, 0, mid_hi, N_Q, N_K,
                                  qk_scale, softcap2, slope2, win_left, win_right,
                                  BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, False, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                  UPCAST, PRECISION)
    n_left = tl.cdiv(mid_lo - lo, BLOCK_N)
    if not WINDOW:  # (a constant: only a window has a left edge)
        n_left = 0
    dq0, dq1 = _attn_bwd_dq_inner(dq0, dq1, q0, q1, do0, do1, lse2, delta, k_base, v_base,
                                  stride_kn, stride_kk, stride_vn, stride_vk, offs_m,
                                  n_left, lo, tl.cdiv(hi - mid_hi, BLOCK_N), mid_hi, N_Q, N_K,
                                  qk_scale, softcap2, slope2, win_left, win_right,
                                  BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                  UPCAST, PRECISION)
    dq0 *= sm_scale
    if BLOCK_D1 > 0:
        dq1 *= sm_scale
    _store_tile(DQ + off_zq * stride_dqz + off_h * stride_dqh, offs_m, row_ok, stride_dqm, stride_dqk, dq0, dq1,
                HEAD_DIM, BLOCK_D0, BLOCK_D1, False)
