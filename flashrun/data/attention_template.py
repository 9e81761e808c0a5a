"""Your own attention kernel, checked by flashrun.

    flashrun verify --kernel experiments/my_attention.py:attention
    flashrun bench  --kernel experiments/my_attention.py:attention

The contract flashrun calls you with:
  * ``attention(q, k, v, causal, sm_scale) -> o`` (keywords work too), or just ``(q, k, v)``
    - then you are judged against the case's causal flag and the default 1/sqrt(head_dim) scale;
  * q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim), any strides,
    with heads % kv_heads == 0 (GQA); float16, bfloat16 or float32; on the GPU, or on the CPU
    through Triton's interpreter (TRITON_INTERPRET=1 is set for you before this file is imported);
  * causal masks are aligned bottom-right: query i sees keys j <= i + seq_k - seq_q;
  * return a tensor shaped like q, in q's dtype. Fresh outputs are poisoned by verify, so a row
    you forget to write is reported; if ``o`` is differentiable, ``--grad`` checks dq, dk, dv.

FlashAttention-2's variants arrive as keyword arguments, and only those your function names
(``**kwargs`` takes them all). With ``off = seq_k - seq_q``:
  * ``window=(left, right)``: query i sees keys i + off - left .. i + off + right; -1, or a side
    at least seq_k wide, is unbounded; causal means right = 0;
  * ``softcap=c`` (> 0): scores s = q·kᵀ·sm_scale become c·tanh(s / c), before ALiBi and the mask;
  * ``alibi_slopes``: float32 (heads,) or (batch, heads); adds -slope·|i + off - j| to the scores;
  * packed sequences: ``cu_seqlens_q, cu_seqlens_k``, int32 offsets (batch + 1,): sequence b is
    rows cu[b]:cu[b+1] of q (total_q, heads, head_dim) and of k, v (total_k, kv_heads, head_dim),
    each attended on its own (a length may be 0); return (total_q, heads, head_dim). Name
    ``max_seqlen_q, max_seqlen_k`` too if you want the longest lengths.
A case that needs an argument your function does not name is reported ``skipped`` with the
reason, never run. To support fewer variants, delete their parameters (and the code reading
them): without ``cu_seqlens_q`` and ``cu_seqlens_k`` packed cases are skipped, without
``alibi_slopes`` ALiBi cases, and so on.

This starting point is a compact FlashAttention forward: one program per BLOCK_M queries walks
the keys in BLOCK_N blocks with an online softmax, masking what the window (or causal) hides;
packed sequences run one launch each. It is forward only; edit it freely.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _my_attn_fwd(Q, K, V, O, SLOPES, sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, soz, soh, som, ssz,
                 H, N_Q, N_K, sm_scale, softcap, left, right, GROUP: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    off_z = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    diag = offs_m[:, None] + (N_K - N_Q)  # the key each query faces (bottom-right alignment)
    q = tl.load(Q + off_z * sqz + off_h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < N_Q) & d_ok, other=0.0)
    k_base = K + off_z * skz + (off_h // GROUP) * skh
    v_base = V + off_z * svz + (off_h // GROUP) * svh
    if ALIBI:
        slope = tl.load(SLOPES + off_z * ssz + off_h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < N_K) & d_ok
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=kv_ok, other=0.0)
        # -- scores in natural units: scale, softcap, ALiBi --
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap·tanh(s / softcap)
        if ALIBI:
            s = s - slope * tl.abs(diag - cols[None, :]).to(tl.float32)
        # -- mask: keys past the end, and outside the window (an unbounded side comes as a huge one) --
        keep = (cols[None, :] < N_K) & (cols[None, :] >= diag - left) & (cols[None, :] <= diag + right)
        s = tl.where(keep, s * 1.4426950408889634, float("-inf"))  # times log2(e): we use exp2
        # -- update m_i, l_i and acc --
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # row with no key yet: avoid -inf - -inf
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key outputs 0, not NaN
    tl.store(O + off_z * soz + off_h * soh + offs_m[:, None] * som + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=(offs_m[:, None] < N_Q) & d_ok)


def _forward(q, k, v, o, causal, sm_scale, window, softcap, alibi_slopes):
    """o = attention(q, k, v) for (batch, heads, seq, head_dim) views whose head_dim is contiguous."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    if n_q == 0:  # an empty packed sequence: nothing to write
        return
    unbounded = n_q + n_k  # a side this wide masks nothing
    left, right = window
    left = unbounded if left < 0 or left >= n_k else left
    right = 0 if causal else unbounded if right < 0 or right >= n_k else right
    alibi = alibi_slopes is not None
    block_m, block_n = 32, 32
    grid = (triton.cdiv(n_q, block_m), batch * heads)
    _my_attn_fwd[grid](q, k, v, o, alibi_slopes if alibi else q,  # q: a pointer the kernel never reads
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                       alibi_slopes.stride(0) if alibi and alibi_slopes.dim() == 2 else 0,  # (H,): one row for all
                       heads, n_q, n_k, sm_scale, float(softcap), left, right,
                       GROUP=heads // k.shape[1], SOFTCAP=softcap > 0, ALIBI=alibi, HEAD_DIM=head_dim,
                       # float32: IEEE dots; the GPU's default for float32 tl.dot is TF32 (~1e-3 error)
                       PRECISION="ieee" if q.dtype == torch.float32 else None,
                       BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n)


def attention(q, k, v, causal=False, sm_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              cu_seqlens_q=None, cu_seqlens_k=None):
    # the kernel indexes head_dim with stride 1: make that dim contiguous (a no-op if it is)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    variant = {"window": tuple(window), "softcap": softcap}
    if cu_seqlens_q is None:
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        _forward(q, k, v, o, causal, sm_scale, alibi_slopes=alibi_slopes, **variant)
        return o
    # packed (total, heads, head_dim): one launch per sequence on (1, heads, n, head_dim) views;
    # simple, but slow for many short sequences (a varlen kernel reads cu_seqlens itself)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        views = (t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, keys), (v, keys), (o, rows)))
        _forward(*views, causal, sm_scale, alibi_slopes=slopes, **variant)
    return o
