"""The decode kernels: flash-decoding with GQA packing over a contiguous or paged KV cache, and
the combine that merges its splits. What they compute and why is in :mod:`.decode`."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashrun.kernels.flash.jit import (
    LOG2E_C,
    NO_BLOCK,
    _dot_cols,
    _in_window,
    _key_range,
    _row_dots,
    _scores,
    _store_tile,
)

# The KV_FP8 constexpr: 0 (a float16/bfloat16 cache), or how an e4m3 cache's tiles meet the
# queries: widened to their dtype, or (bfloat16 queries) both in float16
KV_FP8_WIDEN = tl.constexpr(1)
KV_FP8_F16 = tl.constexpr(2)

# ---------------------------------------------------------------------------------------------
# @triton.jit helpers


@triton.jit
def _load_cols(ptrs_rows, row_ok, stride_d, COL: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Columns [COL, COL + WIDTH) of the rows at ``ptrs_rows`` (one pointer per row), zeros
    where ``row_ok`` is false or past HEAD_DIM."""
    cols = COL + tl.arange(0, WIDTH)
    return tl.load(ptrs_rows[:, None] + cols[None, :] * stride_d, mask=row_ok[:, None] & (cols[None, :] < HEAD_DIM),
                   other=0.0)


@triton.jit
def _slots(PAGES, start_n, cols, n_k, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, ONE_PAGE: tl.constexpr):
    """Where keys ``cols`` (from start_n) of a sequence live: (page, slot) - slot j % PAGE_SIZE of
    page PAGES[j // PAGE_SIZE] of a paged cache, or (0, j) of a contiguous one (whose pointers are
    already at the sequence). ONE_PAGE: the keys lie in one page (a block that starts on a
    multiple of BLOCK_N, which divides PAGE_SIZE), found by one load."""
    if PAGE_SIZE > 0:
        if ONE_PAGE:  # the block starts below n_k, so its page is in the block table row
            page = tl.load(PAGES + start_n // PAGE_SIZE).to(tl.int64)
        elif MASKED:  # keys past the sequence may lie past its block table row
            page = tl.load(PAGES + cols // PAGE_SIZE, mask=cols < n_k, other=0).to(tl.int64)
        else:
            page = tl.load(PAGES + cols // PAGE_SIZE).to(tl.int64)
        slot = cols % PAGE_SIZE
    else:
        page = 0
        slot = cols.to(tl.int64)
    return page, slot


@triton.jit
def _kv_tile(rows, row_ok, stride_d, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
             MASKED: tl.constexpr):
    """(x0, x1): the rows at pointers ``rows`` as the head dim's two column blocks (x1 =
    NO_BLOCK when BLOCK_D1 = 0); only MASKED blocks (and columns past HEAD_DIM) pay for masks."""
    cols0 = tl.arange(0, BLOCK_D0)
    if MASKED:
        x0 = tl.load(rows[:, None] + cols0[None, :] * stride_d, mask=row_ok[:, None] & (cols0[None, :] < HEAD_DIM),
                     other=0.0)
    elif BLOCK_D0 > HEAD_DIM:
        x0 = tl.load(rows[:, None] + cols0[None, :] * stride_d, mask=cols0[None, :] < HEAD_DIM, other=0.0)
    else:
        x0 = tl.load(rows[:, None] + cols0[None, :] * stride_d)
    x1 = NO_BLOCK
    if BLOCK_D1 > 0:
        cols1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
        mask1 = cols1[None, :] < HEAD_DIM
        if MASKED:
            mask1 = mask1 & row_ok[:, None]
        x1 = tl.load(rows[:, None] + cols1[None, :] * stride_d, mask=mask1, other=0.0)
    return x0, x1


@triton.jit
def _widen(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """An e4m3 tile as ``dtype`` (float16 or bfloat16; exact). PTX (compiled code only): through
    cvt.rn.f16x2.e4m3x2 in inline PTX, which the compiler cannot move: the tile is widened where it
    sits in registers as read from shared memory (16 bytes a read), then laid out for the MMA as
    16-bit values (ldmatrix.trans). Triton moves its own cast into the MMA operand's read, and for
    V (whose keys, the dot's reduction, are not contiguous) that read is one 1-byte shared load an
    element: 64 a thread per 64-key tile at head_dim 128 (the sm_90 PTX: 128 ld.shared.b8 and 8-byte
    copies into shared memory, against none and 16-byte copies this way)."""
    if PTX:
        if dtype == tl.float16:  # four e4m3 in a 32-bit register, two float16 pairs out
            y = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
        else:  # bfloat16: through float16 and float32, as Triton's cast goes
            y = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi, h<4>; .reg .b32 a, b; .reg .f32 f<4>; mov.b32 {lo, hi}, $2; "
                "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {h0, h1}, a; mov.b32 {h2, h3}, b; "
                "cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3; "
                "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }",
                "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _queries_f16(q0, q1, qk_scale, BLOCK_D1: tl.constexpr):
    """(q0, q1, r): the tile's queries times ``qk_scale`` in float16, divided by the power of two r
    that puts their largest magnitude near 2**14 (an exact scaling: no overflow, no digits lost
    to float16's narrow range); the scores' dots come out divided by r, so r takes qk_scale's
    place. For bfloat16 queries against an fp8 cache: e4m3 widens to float16 in one instruction
    per pair, to bfloat16 in three."""
    q0 = q0.to(tl.float32) * qk_scale
    amax = tl.max(tl.max(tl.abs(q0), 1), 0)
    if BLOCK_D1 > 0:
        q1 = q1.to(tl.float32) * qk_scale
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(q1), 1), 0))
    r = tl.where(amax > 0.0, tl.math.exp2(tl.math.ceil(tl.math.log2(amax)) - 14.0), 1.0)
    q0 = (q0 * (1.0 / r)).to(tl.float16)
    if BLOCK_D1 > 0:
        q1 = (q1 * (1.0 / r)).to(tl.float16)
    return q0, q1, r


@triton.jit
def _append(K, V, K_NEW, V_NEW, K_SCALE, V_SCALE, K_NEW_SCALE, V_NEW_SCALE, PAGES, lo, hi, n_cache, n_k,
            stride_kz, stride_kn, stride_kk, stride_vz, stride_vn, stride_vk, stride_nn, stride_nk,
            stride_sz, stride_sn, stride_tn, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            PAGE_SIZE: tl.constexpr, TOKEN_SCALES: tl.constexpr):
    """Copy the new keys and values among [lo, hi) (positions n_cache .. n_k) from K_NEW, V_NEW
    into the cache, 16 rows at a time (few keys are new: a small tile keeps registers free); with
    TOKEN_SCALES, each new key's and value's scale (K_NEW_SCALE, V_NEW_SCALE) into the cache's."""
    offs_n = tl.arange(0, 16)
    cols_d = tl.arange(0, BLOCK_D)
    for start_n in range(tl.maximum(lo, n_cache), tl.minimum(hi, n_k), 16):
        cols = start_n + offs_n
        page, slot = _slots(PAGES, start_n, cols, n_k, PAGE_SIZE, True, False)
        row_ok = cols < tl.minimum(hi, n_k)
        mask = row_ok[:, None] & (cols_d[None, :] < HEAD_DIM)
        new = (cols - n_cache).to(tl.int64)
        k = tl.load((K_NEW + new * stride_nn)[:, None] + cols_d[None, :] * stride_nk, mask=mask)
        tl.store((K + page * stride_kz + slot * stride_kn)[:, None] + cols_d[None, :] * stride_kk, k, mask=mask)
        v = tl.load((V_NEW + new * stride_nn)[:, None] + cols_d[None, :] * stride_nk, mask=mask)
        tl.store((V + page * stride_vz + slot * stride_vn)[:, None] + cols_d[None, :] * stride_vk, v, mask=mask)
        if TOKEN_SCALES:
            at = page * stride_sz + slot * stride_sn
            tl.store(K_SCALE + at, tl.load(K_NEW_SCALE + new * stride_tn, mask=row_ok), mask=row_ok)
            tl.store(V_SCALE + at, tl.load(V_NEW_SCALE + new * stride_tn, mask=row_ok), mask=row_ok)


@triton.jit
def _decode_inner(acc0, acc1, l_i, m_i, v_unit, q0, q1, K, V, K_SCALE, V_SCALE, PAGES, lo, hi, n_k, N_Q,
                  stride_kz, stride_kn, stride_kk, stride_vz, stride_vn, stride_vk, stride_sz, stride_sn,
                  offs_i, qk_scale, softcap2, slope2, left, right,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr, KV_FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr, V_PTX: tl.constexpr):
    """Keys [lo, hi) of one sequence and kv head into the running softmax of the tile's rows
    (``offs_i``: each row's query). K, V point at the kv head (and the sequence, contiguous
    cache); PAGES at the sequence's block table row (paged cache). KV_FP8: the cache holds fp8,
    widened to q's dtype tile by tile (exact; KV_FP8_F16: q is bfloat16 turned float16 by
    :func:`_queries_f16`, V and P float16 too, but bfloat16 with TOKEN_SCALES: on the H200 the
    float16 route below ran 1.1-1.2x slower there); TOKEN_SCALES: each key's and value's scale
    (K_SCALE, V_SCALE, laid out as the cache without head_dim) multiplies its score's column and
    its probability's column (q·(s k) = s (q·k); Σ p (s v) = Σ (p s) v), not the tile; in float16
    (fp16 queries) P · scale could leave its range, so P takes each scale over the tile's largest
    and the accumulator is kept in units of that largest (``v_unit``, the caller's scale).
    V_PTX: V's tiles widened by :func:`_widen`'s PTX (K's are read in the operand's own layout)."""
    offs_n = tl.arange(0, BLOCK_N)
    shift = n_k - N_Q  # bottom-right alignment: query i faces key i + shift
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        page, slot = _slots(PAGES, start_n, cols, n_k, PAGE_SIZE, MASKED, PAGE_SIZE % BLOCK_N == 0)
        k_rows = K + page * stride_kz + slot * stride_kn
        v_rows = V + page * stride_vz + slot * stride_vn
        k0, k1 = _kv_tile(k_rows, cols < n_k, stride_kk, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED)
        v0, v1 = _kv_tile(v_rows, cols < n_k, stride_vk, HEAD_DIM, BLOCK_D0, BLOCK_D1, MASKED)
        if KV_FP8:
            k0 = k0.to(q0.dtype)
            if BLOCK_D1 > 0:
                k1 = k1.to(q0.dtype)
            if KV_FP8 == KV_FP8_F16 and TOKEN_SCALES:
                v0 = _widen(v0, tl.bfloat16, V_PTX)
                if BLOCK_D1 > 0:
                    v1 = _widen(v1, tl.bfloat16, V_PTX)
            else:
                v0 = _widen(v0, q0.dtype, V_PTX)
                if BLOCK_D1 > 0:
                    v1 = _widen(v1, q0.dtype, V_PTX)
        qk = _row_dots(q0, q1, k0, k1, BLOCK_D1, UPCAST, PRECISION)  # (BLOCK_M, BLOCK_N), float32
        if TOKEN_SCALES:
            at = page * stride_sz + slot * stride_sn
            k_scale = tl.load(K_SCALE + at, mask=cols < n_k, other=0.0)
            v_scale = tl.load(V_SCALE + at, mask=cols < n_k, other=0.0)
            qk = qk * k_scale[None, :]
        # -- update m_i and l_i --
        if MASKED:
            qk, _ = _scores(qk, offs_i[:, None], cols[None, :], shift, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
            keep = cols[None, :] < n_k
            if CAUSAL or WINDOW:
                keep = keep & _in_window(offs_i[:, None], cols[None, :], shift, left, right, CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # a row with no key yet: exp2 gives 0, not NaN
        elif SOFTCAP or ALIBI:
            qk, _ = _scores(qk, offs_i[:, None], cols[None, :], shift, qk_scale, softcap2, slope2, SOFTCAP, ALIBI)
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
        if TOKEN_SCALES and v0.dtype == tl.float16:
            # P · scale can leave float16's range: P times each scale over the tile's largest
            # (in [0, 1]), the accumulator kept in units of that largest (v_unit)
            v_top = tl.max(v_scale, 0)
            v_top = tl.where(v_top > 0.0, v_top, v_unit)  # a tile of masked keys: scales 0, P 0
            alpha = alpha * (v_unit / v_top)
            p = p * (v_scale * (1.0 / v_top))[None, :]
            v_unit = v_top
        elif TOKEN_SCALES:
            p = p * v_scale[None, :]
        acc0 = acc0 * alpha[:, None]
        if BLOCK_D1 > 0:
            acc1 = acc1 * alpha[:, None]
        acc0, acc1 = _dot_cols(p.to(v0.dtype), v0, v1, acc0, acc1, BLOCK_D1, UPCAST, PRECISION)
        m_i = m_ij
    return acc0, acc1, l_i, m_i, v_unit


# ---------------------------------------------------------------------------------------------
# Kernels


# The per-call N_K and the plan's counts vary between calls of one compiled kernel (or would
# compile a variant per value for nothing): not specialized. Strides are, as they decide vector widths.
@triton.jit(do_not_specialize=["N_K", "H_KV", "N_NEW", "CAPACITY", "SPLITS"])
def _attn_decode(Q, K, V, O, LSE, K_NEW, V_NEW, CACHE_SEQLENS, BLOCK_TABLE, ALIBI_SLOPES, O_PART, LSE_PART,
                 K_SCALE, V_SCALE, K_NEW_SCALE, V_NEW_SCALE, N_K,
                 stride_qz, stride_qm, stride_qh, stride_qk,
                 stride_kz, stride_kn, stride_kh, stride_kk,
                 stride_vz, stride_vn, stride_vh, stride_vk,
                 stride_oz, stride_om, stride_oh, stride_ok,
                 stride_nz, stride_nn, stride_nh, stride_nk,
                 stride_bz, stride_az, stride_ah,
                 stride_sz, stride_sn, stride_sh, stride_tz, stride_tn, stride_th,
                 H_KV, N_Q, N_NEW, CAPACITY, SPLITS, qk_scale, v_scale, softcap2, win_left, win_right,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUERIES: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 SEQLENS: tl.constexpr, APPEND: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr,
                 V_PTX: tl.constexpr, PDL: tl.constexpr):
    """Program (split, row tile, batch * H_KV + kv head). Q and O are addressed as (batch, query,
    head, dim) through their strides, K and V as (batch or page, key, kv head, dim). The
    sequence holds N_K cached keys (or CACHE_SEQLENS[batch]) and N_NEW appended ones (APPEND).
    A length outside [0, CAPACITY - N_NEW] (the launcher refuses one, but cannot read the lengths
    while a CUDA graph is captured) makes the sequence read and write nothing, its output and LSE
    NaN. SPLIT: write this split's normalized output and log2-sum-exp2
    into O_PART (splits, BLOCK_M, HEAD_DIM) and LSE_PART per (batch, kv head, row tile), for
    :func:`_attn_decode_combine`; otherwise the output itself (and with WRITE_LSE the
    natural-log LSE, (batch, heads, N_Q)). An fp8 cache (KV_FP8: KV_FP8_WIDEN or KV_FP8_F16, how
    its tiles meet the queries, see :func:`_decode_inner`) is dequantized as it is read: a
    scale for the whole cache (K's folded into qk_scale by the launcher, ``v_scale`` applied with
    the normalization), or with TOKEN_SCALES one per key and kv head (K_SCALE, V_SCALE laid out as
    (batch or page, key, kv head); appended keys bring theirs in K_NEW_SCALE, V_NEW_SCALE), V's
    tiles widened through PTX with V_PTX (compiled code, :func:`_widen`). PDL: launched as a programmatic
    dependent launch (sm_90+): the program may start while the kernel before it drains, so it waits for that
    kernel's writes before reading anything, and lets the combine launch as the grid's last
    programs start (the combine waits for this grid's writes in turn)."""
    tl.static_assert(BLOCK_D0 + BLOCK_D1 >= HEAD_DIM)
    tl.static_assert(not (CAUSAL and WINDOW))  # the launcher folds causal into the window
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    split = tl.program_id(0)
    tile = tl.program_id(1)
    pair = tl.program_id(2)
    off_z = (pair // H_KV).to(tl.int64)  # int64: batch and page offsets can pass 2**31 elements
    off_hkv = pair % H_KV
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N_Q * GROUP
    offs_i = rows // GROUP  # each row's query
    offs_h = off_hkv * GROUP + rows % GROUP  # and query head
    if SEQLENS:
        n_cache = tl.load(CACHE_SEQLENS + off_z)
        past = (n_cache < 0) | (n_cache > CAPACITY - N_NEW)  # no slot of the cache may be written or read
        n_cache = tl.where(past, 0, n_cache)
    else:
        n_cache = N_K
        past = False
    n_k = n_cache + N_NEW

    # keys the tile's queries may see ([lo, hi); [mid_lo, mid_hi) needs no mask), over at most
    # QUERIES queries from the tile's first
    lo, mid_lo, mid_hi, hi = _key_range((tile * BLOCK_M) // GROUP, N_Q, n_k, win_left, win_right, QUERIES, BLOCK_N,
                                        CAUSAL, WINDOW)
    if APPEND:  # every new key lies in some split's share, seen by a query or not (it is written there)
        lo = tl.minimum(lo, (n_cache // BLOCK_N) * BLOCK_N)
        hi = tl.maximum(hi, n_k)
    hi = tl.where(past, lo, hi)  # a length past the cache: no key to append or read
    # this split's share of [lo, hi), in whole key blocks (an empty share: an empty partial)
    chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
    k_lo = lo + split * chunk
    k_hi = tl.minimum(k_lo + chunk, hi)

    # q stays in registers for the whole loop
    q_rows = Q + off_z * stride_qz + offs_i * stride_qm + offs_h * stride_qh
    q0 = _load_cols(q_rows, row_ok, stride_qk, 0, BLOCK_D0, HEAD_DIM)
    q1 = NO_BLOCK
    if BLOCK_D1 > 0:
        q1 = _load_cols(q_rows, row_ok, stride_qk, BLOCK_D0, BLOCK_D1, HEAD_DIM)
    if KV_FP8 == KV_FP8_F16:
        q0, q1, qk_scale = _queries_f16(q0, q1, qk_scale, BLOCK_D1)
    if PAGE_SIZE > 0:  # pages: dim 0 of the cache is the page, found in the block table
        k_src = K + off_hkv * stride_kh
        v_src = V + off_hkv * stride_vh
    else:
        k_src = K + off_z * stride_kz + off_hkv * stride_kh
        v_src = V + off_z * stride_vz + off_hkv * stride_vh
    k_scales = K_SCALE  # (absent without TOKEN_SCALES: used only where it says they exist)
    v_scales = V_SCALE
    if TOKEN_SCALES:
        at = off_hkv * stride_sh
        if PAGE_SIZE == 0:
            at += off_z * stride_sz
        k_scales = K_SCALE + at
        v_scales = V_SCALE + at
    pages = BLOCK_TABLE  # (an absent argument is None: used only where a constexpr says it exists)
    if PAGE_SIZE > 0:
        pages = BLOCK_TABLE + off_z * stride_bz
    if APPEND:
        # this split's new keys and values go into the cache first; every program with them in
        # its share writes the same values there, so whichever write a read sees is right
        k_new_scales = K_NEW_SCALE  # (absent without TOKEN_SCALES)
        v_new_scales = V_NEW_SCALE
        if TOKEN_SCALES:
            k_new_scales = K_NEW_SCALE + off_z * stride_tz + off_hkv * stride_th
            v_new_scales = V_NEW_SCALE + off_z * stride_tz + off_hkv * stride_th
        _append(k_src, v_src, K_NEW + off_z * stride_nz + off_hkv * stride_nh,
                V_NEW + off_z * stride_nz + off_hkv * stride_nh, k_scales, v_scales, k_new_scales,
                v_new_scales, pages, k_lo, k_hi, n_cache, n_k, stride_kz, stride_kn, stride_kk,
                stride_vz, stride_vn, stride_vk, stride_nn, stride_nk, stride_sz, stride_sn, stride_tn, HEAD_DIM,
                BLOCK_D0 if BLOCK_D1 == 0 else 2 * BLOCK_D0, PAGE_SIZE, TOKEN_SCALES)
        tl.debug_barrier()  # the program's own copies are visible to all its threads
    if ALIBI:  # one slope per row's head, times log2 e
        slope2 = (tl.load(ALIBI_SLOPES + off_z * stride_az + offs_h * stride_ah, mask=row_ok, other=0.0)
                  * LOG2E_C)[:, None]
    else:
        slope2 = 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    v_unit = 1.0  # the accumulator's unit (token scales into float16 P, see _decode_inner)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, BLOCK_D0], dtype=tl.float32)
    acc1 = NO_BLOCK
    if BLOCK_D1 > 0:
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    if WINDOW:  # stage 0: the window's left edge - masked
        acc0, acc1, l_i, m_i, v_unit = _decode_inner(acc0, acc1, l_i, m_i, v_unit, q0, q1, k_src, v_src, k_scales,
                                             v_scales, pages, tl.maximum(k_lo, lo), tl.minimum(k_hi, mid_lo), n_k, N_Q,
                                             stride_kz, stride_kn, stride_kk, stride_vz, stride_vn, stride_vk,
                                             stride_sz, stride_sn, offs_i, qk_scale, softcap2, slope2, win_left,
                                             win_right, BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, PAGE_SIZE, True,
                                             CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION, KV_FP8,
                                             TOKEN_SCALES, V_PTX)
    # stage 1: key blocks every row of the tile sees in full - no mask
    acc0, acc1, l_i, m_i, v_unit = _decode_inner(acc0, acc1, l_i, m_i, v_unit, q0, q1, k_src, v_src, k_scales,
                                         v_scales, pages, tl.maximum(k_lo, mid_lo), tl.minimum(k_hi, mid_hi), n_k, N_Q,
                                         stride_kz, stride_kn, stride_kk, stride_vz, stride_vn, stride_vk,
                                         stride_sz, stride_sn, offs_i, qk_scale, softcap2, slope2, win_left,
                                         win_right, BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, PAGE_SIZE, False,
                                         CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION, KV_FP8,
                                             TOKEN_SCALES, V_PTX)
    # stage 2: the causal diagonal or the window's right edge, and the ragged end - masked
    acc0, acc1, l_i, m_i, v_unit = _decode_inner(acc0, acc1, l_i, m_i, v_unit, q0, q1, k_src, v_src, k_scales,
                                         v_scales, pages, tl.maximum(k_lo, mid_hi), k_hi, n_k, N_Q,
                                         stride_kz, stride_kn, stride_kk, stride_vz, stride_vn, stride_vk,
                                         stride_sz, stride_sn, offs_i, qk_scale, softcap2, slope2, win_left,
                                         win_right, BLOCK_N, HEAD_DIM, BLOCK_D0, BLOCK_D1, PAGE_SIZE, True,
                                         CAUSAL, WINDOW, SOFTCAP, ALIBI, UPCAST, PRECISION, KV_FP8,
                                             TOKEN_SCALES, V_PTX)

    # -- epilogue: normalize; rows that saw no key output 0 and LSE = -inf (weight 0 in the combine) --
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    inv_l = v_scale * v_unit / l_safe  # one reciprocal per row, a multiply per output (a whole-cache V scale with it)
    acc0 = acc0 * inv_l[:, None]
    if BLOCK_D1 > 0:
        acc1 = acc1 * inv_l[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    if SEQLENS:  # a length past the cache: NaN, not a plausible output
        acc0 = tl.where(past, float("nan"), acc0)
        if BLOCK_D1 > 0:
            acc1 = tl.where(past, float("nan"), acc1)
        lse2 = tl.where(past, float("nan"), lse2)
    if SPLIT:
        part = ((pair * tl.num_programs(1) + tile).to(tl.int64) * SPLITS + split) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(LSE_PART + part, lse2, mask=row_ok)
        _store_tile(O_PART, part, row_ok, HEAD_DIM, 1, acc0, acc1, HEAD_DIM, BLOCK_D0, BLOCK_D1, False)
    else:
        if WRITE_LSE:
            tl.store(LSE + (off_z * H_KV * GROUP + offs_h) * N_Q + offs_i, lse2 / LOG2E_C, mask=row_ok)
        _store_tile(O + off_z * stride_oz, offs_i * stride_om + offs_h * stride_oh, row_ok, 1, stride_ok, acc0, acc1,
                    HEAD_DIM, BLOCK_D0, BLOCK_D1, False)


@triton.jit(do_not_specialize=["H_KV", "SPLITS"])
def _attn_decode_combine(O_PART, LSE_PART, O, LSE, stride_oz, stride_om, stride_oh, stride_ok, H_KV, N_Q, SPLITS,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr):
    """Program (row of the group, batch * H_KV + kv head, column block): merges columns
    [BLOCK_D · c, BLOCK_D · (c + 1)) of the row's SPLITS partials, BLOCK_S at a time with a
    running maximum (every column block recomputes the weights from the LSEs, a few bytes per
    split; column block 0 writes the LSE). A step costs a memory round trip, so BLOCK_S is as
    wide as the registers allow (the plan's COMBINE_TILE): one or two steps at most splits.
    Column blocks spread a long merge - one (batch, kv head) of MQA has SPLITS in the hundreds -
    over more programs than the group's rows. PDL:
    launched as a programmatic dependent of :func:`_attn_decode`, so it may start before that
    grid ends: it waits for its partials first."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    pair = tl.program_id(1)
    col = tl.program_id(2)
    tiles = tl.cdiv(N_Q * GROUP, BLOCK_M)
    first = ((pair * tiles + row // BLOCK_M).to(tl.int64) * SPLITS) * BLOCK_M + row % BLOCK_M  # split 0's row
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = col * BLOCK_D + tl.arange(0, BLOCK_D)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        part = first + (s0 + offs_s) * BLOCK_M
        lse_s = tl.load(LSE_PART + part, mask=s0 + offs_s < SPLITS, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split has seen a key yet: weights 0
        w = tl.math.exp2(lse_s - m_sub)
        scale = tl.math.exp2(m - m_sub)
        # every split wrote its partial (an empty one: zeros), so the load needs no weight: both
        # loads of a step go out together, one memory round trip per step, not two
        o_s = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=(s0 + offs_s < SPLITS)[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        acc = acc * scale + tl.sum(w[:, None] * o_s, 0)
        total = total * scale + tl.sum(w, 0)
        m = m_new
    o = acc * (1.0 / tl.where(total > 0.0, total, 1.0))
    off_z = (pair // H_KV).to(tl.int64)
    off_i = row // GROUP
    off_h = (pair % H_KV) * GROUP + row % GROUP
    if WRITE_LSE:
        if col == 0:
            lse = tl.where(total > 0.0, (m + tl.math.log2(tl.where(total > 0.0, total, 1.0))) / LOG2E_C,
                           float("-inf"))
            tl.store(LSE + (off_z * H_KV * GROUP + off_h) * N_Q + off_i, lse)
    tl.store(O + off_z * stride_oz + off_i * stride_om + off_h * stride_oh + offs_d * stride_ok,
             o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
