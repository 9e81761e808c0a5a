"""Decode over an fp8 (e4m3) KV cache in Gluon, Triton 3.6's API: the kernel only. The plan that
picks it, its launch and its gate are in :mod:`flashrun.kernels.flash.decode`; the portable kernel
it stands in for, :func:`flashrun.kernels.flash.decode_jit._attn_decode`, takes its arguments
unchanged and is the reference for what every argument means.

Why a second kernel: decode reads each byte of K and V once, and the portable kernel moves each
byte of an fp8 cache through shared memory four times (a copy in, a read, V's float16 staging and
its transposed read): MMA's B operand pairs two *keys* per 32-bit register for P V, and sm_90 has
no 8-bit transposed ldmatrix. Here K and V go from global memory straight into registers, in
layouts chosen so that each thread's bytes are contiguous in memory (16-byte loads of K, 4-byte
loads of V) *and*, after widening to float16, are exactly the MMA operands' registers:

* the head dim is relabelled. Q Kᵀ sums over it, so Q and K may share any order of its columns:
  ``k = 16b + 8c + 2a + e`` reads column ``32a + 4b + 2c + e``, which puts each thread's 32
  columns of a key side by side (``_k_load``). P V's output columns may come out in any order if
  the store puts them back: column ``n = 32r + 8w + g`` is head-dim column ``32w + 4g + r``, so a
  thread's four columns of a key are one 4-byte word (``_v_load``), and V's key pairs are made
  in registers (byte permutes), not through shared memory;
* the relabelling is reshapes and permutes of the loaded tiles, and the conversion to the MMA
  operand layout is asserted trivial (a register renaming), so a change that would move data
  fails to compile instead of running slower.

Shared memory carries only what crosses warps: the rows' maxima and P (2 KB a block). What runs
here: 16 rows (GQA group x queries), head_dim 128, no causal mask, window, softcap or ALiBi (the
plan sends those to the portable kernel); contiguous or paged caches, a scale for the whole cache
or one per key and kv head, appended keys, split keys as the portable kernel splits them.

Measured on an H100 (the decode-fp8-gluon-h100 claim) it is as fast as the portable kernel, no
faster: both reach about three quarters of the copy roof, so the shared-memory round trips were not
what holds an fp8 cache below bf16's 94 %. It is off unless ``FLASHRUN_DECODE_GLUON=1``
(:data:`flashrun.kernels.flash.decode.GLUON_FP8`). Tried on top and slower: the next block read
into registers while this one is computed (two programs an SM instead of four), 128-key blocks, an
L2 prefetch of the block two or four ahead."""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

constexpr_function = triton.constexpr_function

LOG2E_C = gl.constexpr(1.4426950408889634)
# a CTA-wide barrier: gl.thread_barrier in Triton 3.6, gl.barrier in later releases
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
BLOCK_M = 16  # the rows a program takes (mma.sync's M)
BLOCK_N = 64  # keys per block
HEAD_DIM = 128
NUM_WARPS = 4

# S = Q Kᵀ and O = P V: mma.sync m16n8k16, the four warps side by side along N (keys for S,
# output columns for O)
_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
_A = gl.DotOperandLayout(0, _MMA, 2)
_B = gl.DotOperandLayout(1, _MMA, 2)


@constexpr_function
def _k_load(block_n):
    """K as read, (key, head-dim column): a thread's registers run along 32 consecutive columns;
    after _k_operand's relabelling it is Kᵀ in _B's layout, register for register."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [32, 0]],
                                      lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[block_n, HEAD_DIM])


@constexpr_function
def _v_load(block_n):
    """V as read: a thread's first registers are four consecutive columns of a key; after
    _v_operand's relabelling it is V in _B's layout (the same registers in another order)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
                                      warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[block_n, HEAD_DIM])


# Q as read and O as written (a few rows, once a program)
_ROWS = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1], order=[1, 0])
_APPEND = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0])

BM_C = gl.constexpr(BLOCK_M)
BLOCK_N_C = gl.constexpr(BLOCK_N)
D_C = gl.constexpr(HEAD_DIM)
MMA_C = gl.constexpr(_MMA)
A_C = gl.constexpr(_A)
B_C = gl.constexpr(_B)
ROWS_C = gl.constexpr(_ROWS)
APPEND_C = gl.constexpr(_APPEND)


@gluon.jit
def _k_operand(k, BN: gl.constexpr):
    """K's tile (BN, 128) as read (_k_load, e4m3) -> Kᵀ (128, BN) float16 in _B, its
    rows in the relabelled head-dim order (column 32a + 4b + 2c + e is row 16b + 8c + 2a + e)."""
    k = k.to(gl.float16)
    k = k.reshape([BN, 4, 8, 2, 2]).permute(0, 2, 3, 1, 4).reshape([BN, D_C]).permute(1, 0)
    return gl.convert_layout(k, B_C, assert_trivial=True)


@gluon.jit
def _v_operand(v, BN: gl.constexpr):
    """V's tile (BN, 128) as read (_v_load, e4m3) -> float16 in _B, its columns in the
    relabelled order (head-dim column 32w + 4g + r is column 32r + 8w + g)."""
    v = v.to(gl.float16)
    v = v.reshape([BN, 4, 8, 4]).permute(0, 3, 1, 2).reshape([BN, D_C])
    return gl.convert_layout(v, B_C, assert_trivial=True)


@gluon.jit
def _rows_of(PAGES, start_n, keys, limit, stride_z, stride_n, PAGE_SIZE: gl.constexpr, ONE_PAGE: gl.constexpr):
    """Element offsets of keys ``start_n + keys`` (those below ``limit``; the rest 0) in a
    contiguous cache (from the sequence's start) or a paged one (PAGES: the block table row).
    ONE_PAGE: the keys lie in one page (a block starting on a multiple of BN, which divides
    PAGE_SIZE)."""
    cols = start_n + keys
    if PAGE_SIZE > 0:
        if ONE_PAGE:  # one scalar load
            page = gl.load(PAGES + start_n // PAGE_SIZE, mask=start_n < limit, other=0).to(gl.int64)
        else:
            page = gl.load(PAGES + cols // PAGE_SIZE, mask=cols < limit, other=0).to(gl.int64)
        return page * stride_z + (cols % PAGE_SIZE) * stride_n
    return cols.to(gl.int64) * stride_n


@gluon.jit
def _load_block(K, V, K_SCALE, V_SCALE, PAGES, start_n, limit, stride_kz, stride_kn, stride_vz, stride_vn,
                stride_sz, stride_sn, BN: gl.constexpr, PAGE_SIZE: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """Keys [start_n, start_n + BN) below ``limit`` (others zero): K in _k_load, V in
    _v_load, e4m3 as stored; with TOKEN_SCALES their scales along S's columns (0 past ``limit``)."""
    keys = gl.arange(0, BN, gl.SliceLayout(1, _k_load(BN)))
    cols = gl.arange(0, D_C, gl.SliceLayout(0, _k_load(BN)))
    at = _rows_of(PAGES, start_n, keys, limit, stride_kz, stride_kn, PAGE_SIZE, PAGE_SIZE % BN == 0)
    k = gl.load(K + at[:, None] + cols[None, :], mask=(start_n + keys < limit)[:, None], other=0.0)
    keys = gl.arange(0, BN, gl.SliceLayout(1, _v_load(BN)))
    cols = gl.arange(0, D_C, gl.SliceLayout(0, _v_load(BN)))
    at = _rows_of(PAGES, start_n, keys, limit, stride_vz, stride_vn, PAGE_SIZE, PAGE_SIZE % BN == 0)
    v = gl.load(V + at[:, None] + cols[None, :], mask=(start_n + keys < limit)[:, None], other=0.0)
    if TOKEN_SCALES:
        keys = gl.arange(0, BN, gl.SliceLayout(0, MMA_C))
        at = _rows_of(PAGES, start_n, keys, limit, stride_sz, stride_sn, PAGE_SIZE, PAGE_SIZE % BN == 0)
        k_scale = gl.load(K_SCALE + at, mask=start_n + keys < limit, other=0.0)
        v_scale = gl.load(V_SCALE + at, mask=start_n + keys < limit, other=0.0)
    else:
        k_scale = 0.0
        v_scale = 0.0
    return k, v, k_scale, v_scale


@gluon.jit
def _block(acc, l_i, m_i, v_unit, q, k, v, k_scale, v_scale, start_n, n_k, qk_scale, BN: gl.constexpr,
           MASKED: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """One block of keys into the rows' running softmax (the portable kernel's _decode_inner,
    without the variants): S = Q Kᵀ, token scales on S's and P's columns (P over the block's
    largest V scale, the accumulator in units of it: ``v_unit``), O += P V in float16. ``l_i``
    holds each row's sum per column of S (summed over the columns once, after the loop: a sum
    across the warps per block would cost a shared-memory round trip)."""
    s = mma_v2(q, _k_operand(k, BN), gl.zeros([BM_C, BN], gl.float32, MMA_C))
    if TOKEN_SCALES:
        s = s * k_scale[None, :]
    if MASKED:
        keys = start_n + gl.arange(0, BN, gl.SliceLayout(0, MMA_C))
        s = gl.where((keys < n_k)[None, :], s * qk_scale, float("-inf"))
        m_ij = gl.maximum(m_i, gl.max(s, 1))
        m_sub = gl.where(m_ij == float("-inf"), 0.0, m_ij)
    else:
        m_ij = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        s = s * qk_scale
        m_sub = m_ij
    p = gl.exp2(s - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha[:, None] + p
    if TOKEN_SCALES:
        v_top = gl.max(v_scale, 0)
        v_top = gl.where(v_top > 0.0, v_top, v_unit)
        alpha = alpha * (v_unit / v_top)
        p = p * (v_scale * (1.0 / v_top))[None, :]
        v_unit = v_top
    acc = acc * alpha[:, None]
    acc = mma_v2(gl.convert_layout(p.to(gl.float16), A_C), _v_operand(v, BN), acc)
    return acc, l_i, m_ij, v_unit


@gluon.jit
def _append(K, V, K_NEW, V_NEW, K_SCALE, V_SCALE, K_NEW_SCALE, V_NEW_SCALE, PAGES, lo, hi, n_cache, n_k,
            stride_kz, stride_kn, stride_vz, stride_vn, stride_nn, stride_sz, stride_sn, stride_tn,
            PAGE_SIZE: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """The portable kernel's _append: the new keys and values among [lo, hi) into the cache (16
    rows at a time), with TOKEN_SCALES their scales. K_NEW, V_NEW: contiguous head dims."""
    rows = gl.arange(0, 16, gl.SliceLayout(1, APPEND_C))
    cols = gl.arange(0, D_C, gl.SliceLayout(0, APPEND_C))
    for start_n in range(gl.maximum(lo, n_cache), gl.minimum(hi, n_k), 16):
        end = gl.minimum(hi, n_k)
        ok = (start_n + rows < end)[:, None]
        new = (start_n + rows - n_cache).to(gl.int64)
        k_at = _rows_of(PAGES, start_n, rows, end, stride_kz, stride_kn, PAGE_SIZE, False)
        v_at = _rows_of(PAGES, start_n, rows, end, stride_vz, stride_vn, PAGE_SIZE, False)
        k = gl.load(K_NEW + (new * stride_nn)[:, None] + cols[None, :], mask=ok)
        gl.store(K + k_at[:, None] + cols[None, :], k, mask=ok)
        v = gl.load(V_NEW + (new * stride_nn)[:, None] + cols[None, :], mask=ok)
        gl.store(V + v_at[:, None] + cols[None, :], v, mask=ok)
        if TOKEN_SCALES:
            s_at = _rows_of(PAGES, start_n, rows, end, stride_sz, stride_sn, PAGE_SIZE, False)
            row_ok = start_n + rows < end
            gl.store(K_SCALE + s_at, gl.load(K_NEW_SCALE + new * stride_tn, mask=row_ok), mask=row_ok)
            gl.store(V_SCALE + s_at, gl.load(V_NEW_SCALE + new * stride_tn, mask=row_ok), mask=row_ok)


@gluon.jit
def _gdc_wait():
    """griddepcontrol.wait (triton.language.extra.cuda.gdc_wait's PTX)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """griddepcontrol.launch_dependents (triton.language.extra.cuda.gdc_launch_dependents's PTX)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit(do_not_specialize=["N_K", "H_KV", "N_NEW", "CAPACITY", "SPLITS"])
def _attn_decode_fp8(Q, K, V, O, LSE, K_NEW, V_NEW, CACHE_SEQLENS, BLOCK_TABLE, ALIBI_SLOPES, O_PART, LSE_PART,
                     K_SCALE, V_SCALE, K_NEW_SCALE, V_NEW_SCALE, N_K,
                     stride_qz, stride_qm, stride_qh, stride_qk,
                     stride_kz, stride_kn: gl.constexpr, stride_kh, stride_kk,
                     stride_vz, stride_vn: gl.constexpr, stride_vh, stride_vk,
                     stride_oz, stride_om, stride_oh, stride_ok,
                     stride_nz, stride_nn, stride_nh, stride_nk,
                     stride_bz, stride_az, stride_ah,
                     stride_sz, stride_sn, stride_sh, stride_tz, stride_tn, stride_th,
                     H_KV, N_Q, N_NEW, CAPACITY, SPLITS, qk_scale, v_scale, softcap2, win_left, win_right,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QUERIES: gl.constexpr, PAGE_SIZE: gl.constexpr,
                     SEQLENS: gl.constexpr, APPEND: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
                     CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                     UPCAST: gl.constexpr, PRECISION: gl.constexpr, KV_FP8: gl.constexpr,
                     TOKEN_SCALES: gl.constexpr, V_PTX: gl.constexpr, PDL: gl.constexpr):
    """:func:`~flashrun.kernels.flash.decode_jit._attn_decode` for an e4m3 cache with
    float16/bfloat16 queries (program (split, row tile, batch * H_KV + kv head), the same
    arguments, partials and outputs), restricted to what the module docstring says: both head
    dims' strides 1 (K, V, K_NEW, V_NEW), no variant. Queries enter float16 (bfloat16 ones times
    qk_scale over a power of two, as _queries_f16 does; float16 ones as they are)."""
    gl.static_assert(BLOCK_M == BM_C and BLOCK_N == BLOCK_N_C and HEAD_DIM == D_C and BLOCK_D1 == 0)
    gl.static_assert(not (CAUSAL or WINDOW or SOFTCAP or ALIBI))
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    split = gl.program_id(0)
    tile = gl.program_id(1)
    pair = gl.program_id(2)
    off_z = (pair // H_KV).to(gl.int64)
    off_hkv = pair % H_KV
    if SEQLENS:
        n_cache = gl.load(CACHE_SEQLENS + off_z)
        past = (n_cache < 0) | (n_cache > CAPACITY - N_NEW)
        n_cache = gl.where(past, 0, n_cache)
    else:
        n_cache = N_K
        past = False
    n_k = n_cache + N_NEW
    hi = gl.where(past, 0, n_k)
    chunk = gl.cdiv(gl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
    k_lo = split * chunk
    k_hi = gl.minimum(k_lo + chunk, hi)
    k_mid = gl.maximum(k_lo, k_lo + ((k_hi - k_lo) // BLOCK_N) * BLOCK_N)  # [k_lo, k_mid): whole blocks

    # the queries: read once, float16, columns relabelled for _k_operand, in the A operand's layout
    rows = tile * BM_C + gl.arange(0, BM_C, gl.SliceLayout(1, ROWS_C))
    dims = gl.arange(0, D_C, gl.SliceLayout(0, ROWS_C))
    row_ok = rows < N_Q * GROUP
    q = gl.load(Q + off_z * stride_qz + ((rows // GROUP) * stride_qm + (off_hkv * GROUP + rows % GROUP) * stride_qh
                                         )[:, None] + dims[None, :] * stride_qk, mask=row_ok[:, None], other=0.0)
    if Q.dtype.element_ty == gl.bfloat16:  # exact scaling by a power of two into float16's range
        q = q.to(gl.float32) * qk_scale
        amax = gl.max(gl.max(gl.abs(q), 1), 0)
        r = gl.where(amax > 0.0, gl.exp2(gl.ceil(gl.log2(amax)) - 14.0), 1.0)
        q = q * (1.0 / r)
        qk_scale = r
    q = q.to(gl.float16).reshape([BM_C, 4, 8, 2, 2]).permute(0, 2, 3, 1, 4).reshape([BM_C, D_C])
    q = gl.convert_layout(q, A_C)

    if PAGE_SIZE > 0:
        k_src = K + off_hkv * stride_kh
        v_src = V + off_hkv * stride_vh
    else:
        k_src = K + off_z * stride_kz + off_hkv * stride_kh
        v_src = V + off_z * stride_vz + off_hkv * stride_vh
    k_scales = K_SCALE
    v_scales = V_SCALE
    if TOKEN_SCALES:
        at = off_hkv * stride_sh
        if PAGE_SIZE == 0:
            at += off_z * stride_sz
        k_scales = K_SCALE + at
        v_scales = V_SCALE + at
    pages = BLOCK_TABLE
    if PAGE_SIZE > 0:
        pages = BLOCK_TABLE + off_z * stride_bz
    if APPEND:
        k_new_scales = K_NEW_SCALE
        v_new_scales = V_NEW_SCALE
        if TOKEN_SCALES:
            k_new_scales = K_NEW_SCALE + off_z * stride_tz + off_hkv * stride_th
            v_new_scales = V_NEW_SCALE + off_z * stride_tz + off_hkv * stride_th
        _append(k_src, v_src, K_NEW + off_z * stride_nz + off_hkv * stride_nh,
                V_NEW + off_z * stride_nz + off_hkv * stride_nh, k_scales, v_scales, k_new_scales, v_new_scales,
                pages, k_lo, k_hi, n_cache, n_k, stride_kz, stride_kn, stride_vz, stride_vn, stride_nn,
                stride_sz, stride_sn, stride_tn, PAGE_SIZE, TOKEN_SCALES)
        _barrier()  # the program's own copies are visible to all its threads

    m_i = gl.full([BM_C], float("-inf"), gl.float32, gl.SliceLayout(1, MMA_C))
    l_i = gl.zeros([BM_C, BLOCK_N], gl.float32, MMA_C)
    v_unit = 1.0
    acc = gl.zeros([BM_C, D_C], gl.float32, MMA_C)
    for start_n in range(k_lo, k_mid, BLOCK_N):  # whole blocks
        k, v, ks, vs = _load_block(k_src, v_src, k_scales, v_scales, pages, start_n, k_mid, stride_kz, stride_kn,
                                   stride_vz, stride_vn, stride_sz, stride_sn, BLOCK_N, PAGE_SIZE, TOKEN_SCALES)
        acc, l_i, m_i, v_unit = _block(acc, l_i, m_i, v_unit, q, k, v, ks, vs, start_n, n_k, qk_scale,
                                       BLOCK_N, False, TOKEN_SCALES)
    if k_mid < k_hi:  # the ragged end
        k, v, ks, vs = _load_block(k_src, v_src, k_scales, v_scales, pages, k_mid, n_k, stride_kz, stride_kn,
                                   stride_vz, stride_vn, stride_sz, stride_sn, BLOCK_N, PAGE_SIZE, TOKEN_SCALES)
        acc, l_i, m_i, v_unit = _block(acc, l_i, m_i, v_unit, q, k, v, ks, vs, k_mid, n_k, qk_scale,
                                       BLOCK_N, True, TOKEN_SCALES)

    # -- epilogue: as _attn_decode's; O's columns back in head-dim order by the store's addresses --
    l_i = gl.sum(l_i, 1)
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    inv_l = v_scale * v_unit / l_safe
    acc = acc * inv_l[:, None]
    lse2 = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))
    if SEQLENS:
        acc = gl.where(past, float("nan"), acc)
        lse2 = gl.where(past, float("nan"), lse2)
    rows = tile * BM_C + gl.arange(0, BM_C, gl.SliceLayout(1, MMA_C))
    n = gl.arange(0, D_C, gl.SliceLayout(0, MMA_C))
    cols = 32 * ((n // 8) % 4) + 4 * (n % 8) + n // 32  # column n = 32r + 8w + g is 32w + 4g + r
    row_ok = rows < N_Q * GROUP
    if SPLIT:
        part = ((pair * gl.num_programs(1) + tile).to(gl.int64) * SPLITS + split) * BM_C + gl.arange(
            0, BM_C, gl.SliceLayout(1, MMA_C))
        gl.store(LSE_PART + part, lse2, mask=row_ok)
        gl.store(O_PART + (part * D_C)[:, None] + cols[None, :], acc, mask=row_ok[:, None])
    else:
        offs_i = rows // GROUP
        offs_h = off_hkv * GROUP + rows % GROUP
        if WRITE_LSE:
            gl.store(LSE + (off_z * H_KV * GROUP + offs_h) * N_Q + offs_i, lse2 / LOG2E_C, mask=row_ok)
        gl.store(O + off_z * stride_oz + (offs_i * stride_om + offs_h * stride_oh)[:, None] + cols[None, :] * stride_ok,
                 acc.to(O.dtype.element_ty), mask=row_ok[:, None])
