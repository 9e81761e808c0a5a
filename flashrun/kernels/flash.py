"""FlashAttention-2 forward and backward in Triton.

Maths (Dao, "FlashAttention-2", 2023). For one (batch, head):
    S = Q Kᵀ · sm_scale,   P = softmax(S) row-wise,   O = P V,   LSE_i = log Σ_j exp(S_ij)
Forward: one program owns BLOCK_M query rows and streams K/V in BLOCK_N blocks, keeping the
running row max ``m_i``, running sum ``l_i`` and the unnormalized output ``acc`` on chip
(online softmax); it never materializes S. Exponentials run in base 2: exp(x) = exp2(x·log2 e),
with ``sm_scale · log2 e`` folded into one multiplier ``qk_scale``.
Backward: ``delta_i = Σ_d dO_id O_id`` (a preprocess kernel), P is recomputed from LSE, then
    dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − delta),  dQ = dS K · sm_scale,  dK = dSᵀ Q · sm_scale
in two kernels without atomics (so results are deterministic): dK/dV per key block (looping over
query blocks, and over the query heads of a GQA group), and dQ per query block.

Conventions (shared with ``flashrun.harness.reference``, which this module never imports):
  * layout (batch, heads, seq, head_dim), any strides; k/v may have fewer heads than q (GQA/MQA);
  * causal with Nq != Nk is aligned bottom-right (FlashAttention >= 2.1): query i sees keys
    j <= i + Nk - Nq; a query that sees no key outputs zeros and LSE = -inf, never NaN;
  * head_dim 16..256: the tile is padded to the next power of two and the padding masked;
  * float16/bfloat16 use tensor cores with float32 accumulation; float32 inputs use IEEE fp32
    dots (``input_precision="ieee"``, no TF32), so float32 is exact enough to check against, not fast.
  * Causal work is split into the key blocks every query of the tile sees (no mask) and the few
    diagonal/edge blocks that need one, so only those pay for masking.

Variants (FlashAttention-2's arguments ``window``, ``softcap``, ``alibi_slopes``). Each is a
constexpr of the kernels (``WINDOW``, ``SOFTCAP``, ``ALIBI``), so plain and causal attention
compile as they did without them. With ``off = Nk - Nq``:
  * scores  s_ij = q_i·k_j · sm_scale;  softcap c > 0:  s = c · tanh(s / c);
    ALiBi:  s -= slope_h · |i + off - j|  (slopes (H,) or (B, H), float32);  then the mask;
  * mask    key j is allowed for query i iff  i + off - left <= j <= i + off + right, for
    ``window = (left, right)``; -1, or a side at least as wide as the keys, is unbounded;
    ``causal`` is right = 0. A query with no allowed key outputs zeros (LSE = -inf);
  * base 2  the tanh needs its argument in natural units, so with a softcap ``qk_scale`` is
    sm_scale / c and log2 e is folded in after the tanh (``softcap2 = c · log2 e``); ALiBi slopes
    are multiplied by log2 e once per program;
  * backward  through s' = c · tanh(s / c):  dS = P ∘ (dP − delta) ∘ (1 − tanh²(s / c)), the tanh
    recomputed from Q Kᵀ; the ALiBi bias is a constant (slopes get no gradient);
  * skipping  a window bounds the keys each query tile sees on both sides: blocks outside are
    never visited (loop bounds), blocks inside that every row of the tile sees whole run
    unmasked, and only the blocks on the window's two edges pay for the mask. The backward
    bounds its query loops (dK/dV) and key loops (dQ) the same way;
  * paths   TMA loads support every variant as they are (masks and scores do not depend on how
    a tile was loaded); flash-decoding too, its splits sharing out only the keys a window
    leaves visible.
Packed sequences (``flash_attention_varlen``, constexpr ``VARLEN``): q (total_q, H, D) and k, v
(total_k, H_kv, D) hold B sequences back to back, sequence b in rows cu_seqlens[b] ..
cu_seqlens[b+1] (int32). The grid spans the longest sequence; a program reads its sequence's
bounds, addresses it as a batch entry whose "batch stride" is the row stride (so ``off`` and the
window are per sequence), and returns at once when its tile lies past that sequence's end.
LSE is (H, total_q). Flash-decoding and TMA loads are bypassed for packed sequences (the split
plan would differ per sequence; a head's packed rows are not one block of rows).
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import (
    TensorDescriptor,  # host-side TMA descriptors (triton >= 3.4)
)

from flashrun.errors import ArgumentError, KernelError
from flashrun.kernels.tuning import INTERPRETER, Launch, LaunchConfig, choose

LOG2E = 1.4426950408889634  # 1/ln(2): we use exp2
LOG2E_C = tl.constexpr(LOG2E)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# An unbounded side of a window, as the kernels see it: wider than any key or query range, and
# small enough that i + off ± UNBOUNDED stays inside int32.
UNBOUNDED = 2**30
UNBOUNDED_C = tl.constexpr(UNBOUNDED)


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
def _tanh(x):
    # tanh from exp2 (the interpreter has no libdevice; one code path for CPU and GPU): the odd
    # Taylor series below 0.4, where (1 - e)/(1 + e) would lose digits to cancellation (both are
    # within about 1e-7 relative there), that formula above
    a = tl.abs(x)
    e = tl.math.exp2(a * (-2.0 * LOG2E_C))  # exp(-2|x|) in (0, 1]: cannot overflow
    far = (1.0 - e) / (1.0 + e)
    x2 = x * x
    near = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * (
            -0.008863235529902197 + x2 * 0.003592128036572481)))))
    return tl.where(a < 0.4, near, tl.where(x < 0.0, -far, far))


@triton.jit
def _scores(qk, rows, cols, shift, qk_scale, softcap2, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 scores s · log2 e from the dot products ``qk`` (``rows``/``cols`` broadcast to its
    shape), and t = tanh(s / softcap) for the softcap backward (``qk`` when SOFTCAP is off: unused)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)  # qk_scale = sm_scale / softcap: the tanh's argument, natural units
        s = t * softcap2  # softcap · log2 e: base 2 only after the tanh
    else:
        t = qk
        s = qk * qk_scale  # qk_scale = sm_scale · log2 e
    if ALIBI:
        s = s - slope2 * tl.abs(rows + shift - cols).to(tl.float32)  # slope2 = slope · log2 e
    return s, t


@triton.jit
def _load_rows(src, head_row, start, stride_row, stride_d, N, offs_d,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK) x [0, BLOCK_D) of one head's (seq, head_dim) matrix.

    TMA: ``src`` is a tensor descriptor over all (batch*heads*seq, head_dim) rows and the head
    starts at row ``head_row``; the copy engine zero-fills past the tensor and past head_dim, but
    rows past N belong to the next head, so MASKED tiles zero them (a NaN there must not leak).
    Pointers: ``src`` points at the head; only MASKED tiles (and padded head dims) pay for masks.
    """
    rows = start + tl.arange(0, BLOCK)
    if TMA:
        x = src.load([head_row + start, 0])
        if MASKED:
            x = tl.where(rows[:, None] < N, x, 0.0)
    else:
        ptrs = src + rows[:, None] * stride_row + offs_d[None, :] * stride_d
        if MASKED:
            x = tl.load(ptrs, mask=(rows[:, None] < N) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, kv_row, stride_kn, stride_kk, stride_vn, stride_vk,
                    offs_m, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap2, slope2, left, right,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    TMA: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    # WS: let the compiler split the loop into producer (TMA) and consumer warps (Hopper+)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        k = _load_rows(k_src, kv_row, start_n, stride_kn, stride_kk, N_K, offs_d, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED, TMA)
        v = _load_rows(v_src, kv_row, start_n, stride_vn, stride_vk, N_K, offs_d, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED, TMA)
        qk = _dot(q, tl.trans(k), None, UPCAST, PRECISION)  # (BLOCK_M, BLOCK_N), float32
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
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, UPCAST, PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


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


# ---------------------------------------------------------------------------------------------
# Forward kernel


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qz, stride_qh, stride_qm, stride_qk,
              stride_kz, stride_kh, stride_kn, stride_kk,
              stride_vz, stride_vh, stride_vn, stride_vk,
              stride_oz, stride_oh, stride_om, stride_ok,
              stride_lz, stride_lh,
              H, N_Q, N_K,
              qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right, CU_SEQLENS_Q, CU_SEQLENS_K,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """Q, K, V are tensors, or (TMA) descriptors over their (batch*heads*seq, head_dim) rows.
    VARLEN: sequence z is rows [CU_SEQLENS_Q[z], CU_SEQLENS_Q[z + 1]) of the packed tensors, and
    N_Q/N_K (the grid's) are the longest lengths; each program reads its sequence's own."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(not (CAUSAL and WINDOW))  # the launcher folds causal into the window
    tl.static_assert(not (TMA and VARLEN))  # a packed head's rows are not one block of rows
    pid_m = tl.program_id(0)
    if CAUSAL or WINDOW:  # the last query tiles see the most keys: start them first, so no straggler ends the grid
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)  # int64: batch offsets can pass 2**31 elements
    off_h = off_hz % H
    off_hkv = off_h // GROUP  # GQA: GROUP query heads share one k/v head
    off_zq, off_zk, N_Q, N_K, win_right = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, off_z, N_Q, N_K, win_right,
                                                    VARLEN, WINDOW)
    if VARLEN:  # (a constexpr: dense kernels compile no check)
        if start_m >= N_Q:  # a tile past this (shorter) sequence's end
            return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # q stays in registers/SRAM for the whole loop over K/V
    if TMA:
        # rows past N_Q are the next head's: computed, never stored
        q = Q.load([off_hz * N_Q + start_m, 0])
        k_src = K
        v_src = V
        kv_row = ((off_hz // H) * (H // GROUP) + off_hkv) * N_K
    else:
        q_ptrs = Q + off_zq * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        k_src = K + off_zk * stride_kz + off_hkv * stride_kh
        v_src = V + off_zk * stride_vz + off_hkv * stride_vh
        kv_row = 0
    slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)

    lo, mid_lo, mid_hi, hi = _key_range(start_m, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if WINDOW:  # stage 0: the window's left edge - masked
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, kv_row, stride_kn, stride_kk,
                                        stride_vn, stride_vk, offs_m, offs_d, lo, mid_lo, N_Q, N_K,
                                        qk_scale, softcap2, slope2, win_left, win_right,
                                        BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        UPCAST, PRECISION, TMA, False)
    # stage 1: key blocks every row of the tile sees in full - no mask
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, kv_row, stride_kn, stride_kk, stride_vn, stride_vk,
                                    offs_m, offs_d, mid_lo, mid_hi, N_Q, N_K, qk_scale, softcap2, slope2,
                                    win_left, win_right, BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, WINDOW,
                                    SOFTCAP, ALIBI, UPCAST, PRECISION, TMA, WS)
    # stage 2: the causal diagonal or the window's right edge, and the ragged end of the sequence - masked
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, kv_row, stride_kn, stride_kk, stride_vn, stride_vk,
                                    offs_m, offs_d, mid_hi, hi, N_Q, N_K, qk_scale, softcap2, slope2,
                                    win_left, win_right, BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW,
                                    SOFTCAP, ALIBI, UPCAST, PRECISION, TMA, False)

    # -- epilogue: normalize; rows that saw no key output 0 and LSE = -inf --
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / LOG2E_C, float("-inf"))
    row_ok = offs_m < N_Q
    tl.store(LSE + off_zq * stride_lz + off_h * stride_lh + offs_m, lse, mask=row_ok)
    o_ptrs = O + off_zq * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _attn_fwd_split(Q, K, V, O_PART, LSE_PART,
                    stride_qz, stride_qh, stride_qm, stride_qk,
                    stride_kz, stride_kh, stride_kn, stride_kk,
                    stride_vz, stride_vh, stride_vn, stride_vk,
                    H, N_Q, N_K, FIRST_KEY, KEYS_PER_SPLIT,
                    qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                    CU_SEQLENS_Q, CU_SEQLENS_K,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Flash-decoding: when a few query rows face many keys, B*H programs cannot fill the GPU,
    so program (split, batch*head) attends the head's (<= BLOCK_M) queries to one key range
    [FIRST_KEY + split * KEYS_PER_SPLIT, ...) only. It writes that range's normalized output
    (float32) and its log2-sum-exp2; :func:`_attn_fwd_combine` merges the splits. Windows, the
    softcap and ALiBi apply as in :func:`_attn_fwd`; a window's keys start at FIRST_KEY. Packed
    sequences (VARLEN) do not come here: each has its own length, the launcher one split plan."""
    tl.static_assert(not (CAUSAL and WINDOW))
    tl.static_assert(not VARLEN)
    split = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    off_hkv = off_h // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + off_z * stride_qz + off_h * stride_qh, 0, 0, stride_qm, stride_qk, N_Q, offs_d,
                   BLOCK_M, HEAD_DIM, BLOCK_D, True, False)
    k_src = K + off_z * stride_kz + off_hkv * stride_kh
    v_src = V + off_z * stride_vz + off_hkv * stride_vh
    slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the masked/unmasked split of the whole key range, each part clipped to this split's keys
    lo, mid_lo, mid_hi, hi = _key_range(0, N_Q, N_K, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    k_lo = FIRST_KEY + split * KEYS_PER_SPLIT  # a multiple of BLOCK_N, as the ranges' bounds are
    k_hi = k_lo + KEYS_PER_SPLIT
    if WINDOW:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, 0, stride_kn, stride_kk, stride_vn, stride_vk,
                                        offs_m, offs_d, tl.maximum(k_lo, lo), tl.minimum(k_hi, mid_lo), N_Q, N_K,
                                        qk_scale, softcap2, slope2, win_left, win_right,
                                        BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        UPCAST, PRECISION, False, False)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, 0, stride_kn, stride_kk, stride_vn, stride_vk,
                                    offs_m, offs_d, tl.maximum(k_lo, mid_lo), tl.minimum(k_hi, mid_hi), N_Q, N_K,
                                    qk_scale, softcap2, slope2, win_left, win_right,
                                    BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                    UPCAST, PRECISION, False, False)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, 0, stride_kn, stride_kk, stride_vn, stride_vk,
                                    offs_m, offs_d, tl.maximum(k_lo, mid_hi), tl.minimum(k_hi, hi), N_Q, N_K,
                                    qk_scale, softcap2, slope2, win_left, win_right,
                                    BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                    UPCAST, PRECISION, False, False)
    # rows that saw no key of this split: output 0, log-sum -inf (weight 0 in the combine)
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    splits = tl.num_programs(0)
    row = (off_hz.to(tl.int64) * N_Q + offs_m) * splits + split  # O_PART: (B*H, N_Q, splits, BLOCK_D)
    row_ok = offs_m < N_Q
    tl.store(LSE_PART + row, lse2, mask=row_ok)
    tl.store(O_PART + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _attn_fwd_combine(O_PART, LSE_PART, O, LSE,
                      stride_oz, stride_oh, stride_om, stride_ok,
                      H, N_Q, SPLITS,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (query row, batch*head): O = Σ_s 2^(lse_s - lse) O_s, lse = log2 Σ_s 2^lse_s."""
    m = tl.program_id(0)
    off_hz = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = (off_hz.to(tl.int64) * N_Q + m) * SPLITS
    lse_s = tl.load(LSE_PART + row + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
    top = tl.max(lse_s, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: weights all 0
    w = tl.math.exp2(lse_s - top)
    total = tl.sum(w, 0)
    o_s = tl.load(O_PART + (row + offs_s[:, None]) * BLOCK_D + offs_d[None, :], mask=offs_s[:, None] < SPLITS,
                  other=0.0)
    o = tl.sum(w[:, None] * o_s, 0) / tl.where(total > 0.0, total, 1.0)
    lse = tl.where(total > 0.0, (top + tl.math.log2(tl.where(total > 0.0, total, 1.0))) / LOG2E_C, float("-inf"))
    tl.store(LSE + off_hz.to(tl.int64) * N_Q + m, lse)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    tl.store(O + off_z * stride_oz + off_h * stride_oh + m * stride_om + offs_d * stride_ok,
             o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


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
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                         stride_qm, stride_qk, stride_dom, stride_dok,
                         offs_n, offs_d, lo, hi, N_Q, N_K, qk_scale, softcap2, slope2, left, right,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
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
        dk = _dot(dsT.to(q.dtype), q, dk, UPCAST, PRECISION)  # dK += dSᵀ Q (scaled at the end)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV,
                   stride_qz, stride_qh, stride_qm, stride_qk,
                   stride_kz, stride_kh, stride_kn, stride_kk,
                   stride_vz, stride_vh, stride_vn, stride_vk,
                   stride_doz, stride_doh, stride_dom, stride_dok,
                   stride_dkz, stride_dkh, stride_dkn, stride_dkk,
                   stride_lz, stride_lh,
                   H, H_KV, N_Q, N_K, sm_scale,
                   qk_scale, softcap2, ALIBI_SLOPES, stride_az, stride_ah, win_left, win_right,
                   CU_SEQLENS_Q, CU_SEQLENS_K,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV for one block of keys of one k/v head. LSE and Delta: (batch, heads, Nq) or, packed,
    (heads, total_q), addressed through stride_lz/stride_lh like the tensors (see _sequence)."""
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
    for g in range(GROUP):
        off_h = off_hkv * GROUP + g
        q_base = Q + off_zq * stride_qz + off_h * stride_qh
        do_base = DO + off_zq * stride_doz + off_h * stride_doh
        lse_base = LSE + off_zq * stride_lz + off_h * stride_lh
        delta_base = Delta + off_zq * stride_lz + off_h * stride_lh  # Delta is laid out as LSE
        slope2 = _alibi_slope2(ALIBI_SLOPES, off_z, off_h, stride_az, stride_ah, ALIBI)
        if CAUSAL or WINDOW:  # the causal diagonal or the window's first edge - masked
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                          stride_qm, stride_qk, stride_dom, stride_dok,
                                          offs_n, offs_d, lo, mid_lo, N_Q, N_K, qk_scale, softcap2, slope2,
                                          win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW,
                                          SOFTCAP, ALIBI, UPCAST, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                      stride_qm, stride_qk, stride_dom, stride_dok,
                                      offs_n, offs_d, mid_lo, mid_hi, N_Q, N_K, qk_scale, softcap2, slope2,
                                      win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, False, CAUSAL, WINDOW,
                                      SOFTCAP, ALIBI, UPCAST, PRECISION)
        if WINDOW:  # the window's other edge - masked
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                          stride_qm, stride_qk, stride_dom, stride_dok,
                                          offs_n, offs_d, mid_hi, hi, N_Q, N_K, qk_scale, softcap2, slope2,
                                          win_left, win_right, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, WINDOW,
                                          SOFTCAP, ALIBI, UPCAST, PRECISION)
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


# ---------------------------------------------------------------------------------------------
# Python launchers


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool = False) -> None:
    """Preconditions shared by every kernel here, with messages that say what to change.

    ``packed``: varlen's (total, heads, head_dim) layout (sequences along the rows; the
    cu_seqlens are checked apart) instead of (batch, heads, seq, head_dim)."""
    dims, layout = (3, "(total, heads, head_dim)") if packed else (4, "(batch, heads, seq, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise KernelError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise KernelError(f"dtype {q.dtype} is not supported", hint="use float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise KernelError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise KernelError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise KernelError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise KernelError(f"head_dim differs: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise KernelError(
            f"q's {q.shape[1]} heads are not a multiple of k/v's {k.shape[1]} heads",
            hint="GQA/MQA needs num_heads % num_kv_heads == 0",
        )
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise KernelError(f"head_dim must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.shape[1] == 0 or (not packed and (q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] == 0)):
        raise KernelError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise KernelError(
            "tensors are on the CPU but Triton is set up for the GPU",
            hint="move them to cuda, or set TRITON_INTERPRET=1 before flashrun.kernels is imported",
        )


def _rows_collapse(t: torch.Tensor) -> bool:
    """(batch, heads, seq) strides nest, so the tensor is one (batch*heads*seq, head_dim) matrix."""
    z, h, n, _ = t.shape
    sz, sh, sn, sd = t.stride()
    return sd == 1 and (h == 1 or sh == n * sn) and (z == 1 or sz == h * n * sn)


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA needs a Hopper-class GPU (or the interpreter), row-collapsible tensors, 16-byte
    aligned bases and row strides, and row counts that fit the descriptor's int32 coordinates."""
    if q.dtype == torch.float32:
        return False
    if not INTERPRETED and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    size = q.element_size()
    return all(
        _rows_collapse(t) and t.data_ptr() % 16 == 0 and (t.stride(2) * size) % 16 == 0
        and t.shape[0] * t.shape[1] * t.shape[2] < 2**31
        for t in (q, k, v)
    )


def _rows_descriptor(t: torch.Tensor, block_rows: int):
    z, h, n, d = t.shape
    return TensorDescriptor(t, shape=[z * h * n, d], strides=[t.stride(2), 1], block_shape=[block_rows, _block_d(d)])


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


# Flash-decoding applies when every head's queries fit one tile of at most DECODE_MAX_QUERIES
# rows and B*H such tiles leave SMs idle; each split then takes at least 4 key blocks. Its launch
# config is fixed (not tuned): the work is bound by reading K and V once.
DECODE_MAX_QUERIES = 64
DECODE = LaunchConfig(block_n=64, num_warps=4, num_stages=3)


def _decode_config() -> LaunchConfig:
    return INTERPRETER if INTERPRETED else DECODE


def _decode_block_m(n_q: int) -> int:
    return max(16, triton.next_power_of_2(n_q))  # tl.dot needs 16 rows


def _multiprocessors(device: torch.device) -> int:
    if INTERPRETED:
        return 4  # small, so that the interpreter tests reach the split path with small shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_splits(q: torch.Tensor, k: torch.Tensor, keys: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(number of key splits, keys per split, first key) for flash-decoding; one split means none.

    ``keys``: the range [first, end) that the queries can see at all (a window narrows it);
    the splits share it out, starting at ``first`` rounded down to a key block."""
    z, h, n_q, _ = q.shape
    n_k = k.shape[2]
    block_n = _decode_config().block_n
    first, end = keys if keys is not None else (0, n_k)
    first = first // block_n * block_n
    span = end - first
    min_keys = 4 * block_n
    programs = z * h
    sms = _multiprocessors(q.device)
    if n_q > DECODE_MAX_QUERIES or programs >= sms or span < 2 * min_keys:
        return 1, n_k, 0
    splits = min(triton.cdiv(2 * sms, programs), span // min_keys)  # about two waves of programs
    keys_per_split = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n  # whole key blocks
    return triton.cdiv(span, keys_per_split), keys_per_split, first


def dot_options(dtype: torch.dtype) -> dict:
    """Constexprs for ``_dot``: bf16 upcast only in the interpreter; IEEE fp32 dots for float32."""
    return {
        "UPCAST": INTERPRETED and dtype == torch.bfloat16,
        "PRECISION": "ieee" if dtype == torch.float32 else None,  # None: the dtype's own MMA
    }


# -- variants: checked arguments, in the kernels' terms --------------------------------------------


@dataclass(frozen=True)
class Variant:
    """What one call asks beyond plain attention, as the kernels take it (built by ``_variant``).

    The mask is exactly one of plain, ``causal`` (the CAUSAL path: keys up to the diagonal) or
    ``window`` (WINDOW: ``(left, right)``, an unbounded side given as UNBOUNDED). Packed
    sequences (VARLEN) carry their int32 offsets and longest lengths (the grid's extent)."""

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0  # > 0: SOFTCAP
    alibi_slopes: torch.Tensor | None = None  # float32 (H,) or (B, H): ALIBI
    cu_seqlens_q: torch.Tensor | None = None  # VARLEN: (B + 1,) int32
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def tuning(self, n_q: int, n_k: int) -> dict:
        """How :func:`choose` tells these calls apart from plain ones of the same shape."""
        flags = (("window", self.window is not None), ("softcap", self.softcap > 0),
                 ("alibi", self.alibi_slopes is not None), ("varlen", self.varlen))
        return {"variants": "+".join(name for name, on in flags if on), "lengths": (n_q, n_k)}

    def kernel_args(self, sm_scale: float) -> dict:
        """The runtime arguments and constexprs every kernel here takes for the variants."""
        slopes = self.alibi_slopes
        left, right = self.window if self.window is not None else (0, 0)  # read only under WINDOW
        return {
            # with a softcap the tanh needs natural units: log2 e comes in after it, via softcap2
            "qk_scale": sm_scale / self.softcap if self.softcap else sm_scale * LOG2E,
            "softcap2": self.softcap * LOG2E,
            "ALIBI_SLOPES": slopes,
            "stride_az": slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,  # (H,): one row for all
            "stride_ah": slopes.stride(-1) if slopes is not None else 0,
            "win_left": left,
            "win_right": right,
            "CU_SEQLENS_Q": self.cu_seqlens_q,
            "CU_SEQLENS_K": self.cu_seqlens_k,
            "CAUSAL": self.causal,
            "WINDOW": self.window is not None,
            "SOFTCAP": self.softcap > 0,
            "ALIBI": slopes is not None,
            "VARLEN": self.varlen,
        }

    def key_span(self, n_q: int, n_k: int) -> tuple[int, int]:
        """Keys [first, n_k) that some of queries 0..n_q-1 may see (the last query faces the last
        key, so only a window's left side narrows it)."""
        if self.window is None:
            return 0, n_k
        return max(n_k - n_q - self.window[0], 0), n_k  # query 0 faces key n_k - n_q

    def with_sequences(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                       max_seqlen_q: int, max_seqlen_k: int) -> Variant:
        return replace(self, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _window_arg(window) -> tuple[int, int]:
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ArgumentError(f"window must be a pair of ints >= -1, (left, right), got {window!r}",
                            hint="-1 leaves a side unbounded: (-1, -1) is full attention, (W, 0) a causal "
                                 "sliding window of W keys before the diagonal")
    return int(window[0]), int(window[1])


def _softcap_arg(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ArgumentError(f"softcap must be a finite number >= 0, got {softcap!r}",
                            hint="0 turns it off; Gemma-2 caps attention logits at 50.0")
    return float(softcap)


def _alibi_arg(slopes, q: torch.Tensor, batch: int) -> torch.Tensor | None:
    heads = q.shape[1]  # (B, H, N, D) and packed (total, H, D) alike
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise ArgumentError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}",
                            hint="flashrun.kernels.alibi_slopes(num_heads) gives the standard ones")
    if slopes.dtype != torch.float32:
        raise ArgumentError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if slopes.device != q.device:
        raise ArgumentError(f"alibi_slopes is on {slopes.device}, q on {q.device}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ArgumentError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (heads, or batch x "
                            f"heads), got {tuple(slopes.shape)}")
    return slopes


def _cu_seqlens_arg(cu, name: str, rows: int, tensor: str, device: torch.device) -> list[int]:
    """Check one cu_seqlens; returns its offsets (the check reads them on the host, one sync)."""
    if not isinstance(cu, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ArgumentError(f"{name} must be int32, got {cu.dtype}", hint=f"pass {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ArgumentError(f"{name} must be 1-D, (batch + 1,) with batch >= 1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ArgumentError(f"{name} is on {cu.device}, q on {device}")
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ArgumentError(f"{name} must start at 0, got {offsets[0]}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ArgumentError(f"{name} must be non-decreasing: entry {b + 1} ({offsets[b + 1]}) < entry {b} "
                                f"({offsets[b]})")
    if offsets[-1] != rows:
        raise ArgumentError(f"{name} must end at {tensor}'s number of rows, {rows}, got {offsets[-1]}")
    return offsets


def _max_seqlen_arg(max_seqlen, name: str, longest: int) -> int:
    if max_seqlen is None:
        return longest
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < longest:
        raise ArgumentError(f"{name} must be None or an int >= the longest sequence ({longest}), got {max_seqlen!r}")
    return int(max_seqlen)


def _variant(q: torch.Tensor, batch: int, n_k: int, causal, window, softcap, alibi_slopes) -> Variant:
    """Check FlashAttention-2's arguments and fold them into one mask: ``causal`` is right = 0,
    and a side that is -1 or at least ``n_k`` keys wide is unbounded (n_k: the longest key sequence)."""
    left, right = _window_arg(window)
    if causal:
        right = 0
    left = -1 if left >= n_k else left
    right = -1 if right >= n_k else right
    if left < 0 and right < 0:
        mask = {}
    elif left < 0 and right == 0:
        mask = {"causal": True}
    else:
        mask = {"window": (UNBOUNDED if left < 0 else left, UNBOUNDED if right < 0 else right)}
    return Variant(**mask, softcap=_softcap_arg(softcap), alibi_slopes=_alibi_arg(alibi_slopes, q, batch))


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.), float32 (num_heads,): for n a power of two,
    2^(-8h/n) for h = 1..n; otherwise those of the largest power of two p < n, then every other
    slope of 2p heads' for the remaining n - p heads."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
        raise ArgumentError(f"num_heads must be a positive int, got {num_heads!r}")

    def powers_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 1 << (int(num_heads).bit_length() - 1)  # largest power of two <= num_heads
    slopes = powers_of_two(p) + powers_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


# -- launchers ----------------------------------------------------------------------------------


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """(batch, head, row, dim) strides as the kernels address ``t``. A packed (total, heads, dim)
    tensor's "batch" stride is its row stride: sequence z starts at row cu_seqlens[z] (_sequence)."""
    return tuple(t.stride()) if t.dim() == 4 else (t.stride(0), t.stride(1), t.stride(0), t.stride(2))


def _lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    """LSE and Delta, (batch, heads, Nq) or packed (heads, total_q), as (batch, head) strides."""
    return (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (lse.stride(1), lse.stride(0))


def _dims(q: torch.Tensor, k: torch.Tensor, variant: Variant) -> tuple[int, int, int, int, int, int]:
    """(Z, H, H_KV, N_Q, N_K, D); packed sequences give the longest lengths, the grid's extent."""
    if variant.varlen:
        return (variant.cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], variant.max_seqlen_q,
                variant.max_seqlen_k, q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
                  launch: Launch = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: lse (B, H, Nq), or (H, total_q) for packed sequences, natural log, float32."""
    Z, H, H_KV, N_Q, N_K, D = _dims(q, k, variant)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((H, q.shape[0]) if variant.varlen else (Z, H, N_Q), dtype=torch.float32, device=q.device)
    var = variant.kernel_args(sm_scale)
    if N_Q == 0:  # packed sequences that are all empty
        return o, lse

    # flash-decoding: a fixed config, no tuning (bandwidth-bound; see _attn_fwd_split); packed
    # sequences bypass it - the split plan would differ per sequence
    splits, keys_per_split, first_key = (1, N_K, 0) if variant.varlen else _decode_splits(q, k, variant.key_span(N_Q, N_K))
    if splits > 1:
        cfg = _decode_config()
        o_part = torch.empty((Z * H, N_Q, splits, _block_d(D)), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((Z * H, N_Q, splits), dtype=torch.float32, device=q.device)
        _attn_fwd_split[(splits, Z * H)](q, k, v, o_part, lse_part, *q.stride(), *k.stride(), *v.stride(),
                                         H, N_Q, N_K, first_key, keys_per_split, **var,
                                         GROUP=H // H_KV, HEAD_DIM=D, BLOCK_D=_block_d(D),
                                         BLOCK_M=_decode_block_m(N_Q), BLOCK_N=cfg.block_n,
                                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dot_options(q.dtype))
        _attn_fwd_combine[(N_Q, Z * H)](o_part, lse_part, o, lse, *o.stride(), H, N_Q, splits,
                                        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_S=triton.next_power_of_2(splits))
        return o, lse

    def run(cfg: LaunchConfig) -> None:
        grid = (triton.cdiv(N_Q, cfg.block_m), Z * H)
        tma = bool(cfg.tma) and not variant.varlen and _tma_ok(q, k, v)  # packed: pointers only
        srcs = (_rows_descriptor(q, cfg.block_m), _rows_descriptor(k, cfg.block_n),
                _rows_descriptor(v, cfg.block_n)) if tma else (q, k, v)
        _attn_fwd[grid](*srcs, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_lse_strides(lse),
                        H, N_Q, N_K, **var,
                        GROUP=H // H_KV, HEAD_DIM=D, BLOCK_D=_block_d(D),
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, WS=tma and bool(cfg.ws),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dot_options(q.dtype))

    run(choose("fwd", q, k, variant.causal, launch, run, **variant.tuning(N_Q, N_K)))
    return o, lse


def _attn_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, sm_scale: float, variant: Variant,
                   launch: Launch = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    Z, H, H_KV, N_Q, N_K, D = _dims(q, k, variant)
    group = H // H_KV
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    delta = torch.empty_like(lse)
    common = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), **variant.kernel_args(sm_scale), **dot_options(q.dtype))

    # delta = rowsum(dO * O), laid out as LSE; packed rows are one (1, H, total_q) batch to it
    rows = q.shape[0] if variant.varlen else N_Q
    o_strides, do_strides = ((_strides(o), _strides(do)) if not variant.varlen else
                             ((0, *_strides(o)[1:]), (0, *_strides(do)[1:])))
    pre_m = 64 if rows >= 64 else 16
    if rows:
        _attn_bwd_preprocess[(triton.cdiv(rows, pre_m), (1 if variant.varlen else Z) * H)](
            o, do, delta, *o_strides, *do_strides, H, rows, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=pre_m)

    def run_dkdv(cfg: LaunchConfig) -> None:
        _attn_bwd_dkdv[(triton.cdiv(N_K, cfg.block_n), Z * H_KV)](
            q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            *_strides(dk), *_lse_strides(lse), H, H_KV, N_Q, N_K, sm_scale, GROUP=group,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)

    def run_dq(cfg: LaunchConfig) -> None:
        _attn_bwd_dq[(triton.cdiv(N_Q, cfg.block_m), Z * H)](
            q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            *_strides(dq), *_lse_strides(lse), H, N_Q, N_K, sm_scale, GROUP=group,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)

    if N_K:  # packed: every key row belongs to a sequence of at most N_K keys; its program writes it
        run_dkdv(choose("bwd_dkdv", q, k, variant.causal, launch, run_dkdv, **variant.tuning(N_Q, N_K)))
    if N_Q:
        run_dq(choose("bwd_dq", q, k, variant.causal, launch, run_dq, **variant.tuning(N_Q, N_K)))
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sm_scale, variant, launch):
        o, lse = _attn_forward(q, k, v, sm_scale, variant, launch)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sm_scale, ctx.variant, ctx.launch = sm_scale, variant, launch
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _attn_backward(do, q, k, v, o, lse, ctx.sm_scale, ctx.variant, ctx.launch)
        return dq, dk, dv, None, None, None  # no gradient for ALiBi slopes (FlashAttention-2 has none either)


def _scale(q: torch.Tensor, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      sm_scale: float | None = None, launch: Launch = None, *,
                      window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, no autograd: returns ``(o, lse)``, lse in natural log, float32, (B, H, Nq)."""
    check_inputs(q, k, v)
    variant = _variant(q, q.shape[0], k.shape[2], causal, window, softcap, alibi_slopes)
    return _attn_forward(q, k, v, _scale(q, sm_scale), variant, launch)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, launch: Launch = None, *,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale) v, differentiable. q: (B, H, Nq, D); k, v: (B, H_kv, Nk, D).

    FlashAttention-2's variants (see the module docstring): ``window=(left, right)`` (-1
    unbounded), ``softcap`` (> 0 caps the scores at ±softcap through a tanh), ``alibi_slopes``
    (float32 (H,) or (B, H); :func:`alibi_slopes` gives the standard ones; no gradient)."""
    check_inputs(q, k, v)
    variant = _variant(q, q.shape[0], k.shape[2], causal, window, softcap, alibi_slopes)
    return FlashAttention.apply(q, k, v, _scale(q, sm_scale), variant, launch)


def _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                    alibi_slopes) -> Variant:
    check_inputs(q, k, v, packed=True)
    starts_q = _cu_seqlens_arg(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q", q.device)
    starts_k = _cu_seqlens_arg(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k", q.device)
    if len(starts_q) != len(starts_k):
        raise ArgumentError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                            f"{len(starts_q) - 1} and {len(starts_k) - 1}")
    longest_q = max(b - a for a, b in itertools.pairwise(starts_q))
    longest_k = max(b - a for a, b in itertools.pairwise(starts_k))
    max_seqlen_q = _max_seqlen_arg(max_seqlen_q, "max_seqlen_q", longest_q)
    max_seqlen_k = _max_seqlen_arg(max_seqlen_k, "max_seqlen_k", longest_k)
    # a window side as wide as the longest keys is unbounded everywhere; narrower ones are
    # decided per sequence in the kernels
    variant = _variant(q, len(starts_q) - 1, longest_k, causal, window, softcap, alibi_slopes)
    return variant.with_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def attention_forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                             max_seqlen_k: int | None = None, causal: bool = False,
                             sm_scale: float | None = None, *, window: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                             launch: Launch = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, packed sequences: ``(o, lse)``, lse (H, total_q) in natural log, float32."""
    variant = _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                              softcap, alibi_slopes)
    return _attn_forward(q, k, v, _scale(q, sm_scale), variant, launch)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, causal: bool = False,
                           sm_scale: float | None = None, *, window: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                           launch: Launch = None) -> torch.Tensor:
    """Packed sequences (FlashAttention-2's varlen): q (total_q, H, D), k, v (total_k, H_kv, D);
    sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, (B + 1,), a length may be 0) and
    attends on its own (bottom-right alignment per sequence). Returns (total_q, H, D),
    differentiable. ``max_seqlen_*``: the longest lengths if known (else read from cu_seqlens,
    which are checked on the host either way); ``alibi_slopes``: (H,) or (B, H)."""
    variant = _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                              softcap, alibi_slopes)
    return FlashAttention.apply(q, k, v, _scale(q, sm_scale), variant, launch)
