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

This starting point is a compact FlashAttention forward: one program per BLOCK_M queries walks
the keys in BLOCK_N blocks with an online softmax. It is forward only; edit it freely.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _my_attn_fwd(Q, K, V, O, sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, soz, soh, som,
                 H, N_Q, N_K, qk_scale, GROUP: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    off_z = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    q = tl.load(Q + off_z * sqz + off_h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < N_Q) & d_ok, other=0.0)
    k_base = K + off_z * skz + (off_h // GROUP) * skh
    v_base = V + off_z * svz + (off_h // GROUP) * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < N_K) & d_ok
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=kv_ok, other=0.0)
        keep = cols[None, :] < N_K
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (N_K - N_Q))
        s = tl.where(keep, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
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


def attention(q, k, v, causal=False, sm_scale=None):
    # the kernel indexes head_dim with stride 1: make that dim contiguous (a no-op if it is)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_m, block_n = 32, 32
    grid = (triton.cdiv(n_q, block_m), batch * heads)
    _my_attn_fwd[grid](q, k, v, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                       heads, n_q, n_k, sm_scale * 1.4426950408889634,  # fold log2(e): we use exp2
                       GROUP=heads // k.shape[1], CAUSAL=bool(causal), HEAD_DIM=head_dim,
                       # float32: IEEE dots; the GPU's default for float32 tl.dot is TF32 (~1e-3 error)
                       PRECISION="ieee" if q.dtype == torch.float32 else None,
                       BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n)
    return o
