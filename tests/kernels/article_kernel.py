"""The article's "minimal Flash Attention forward", bugs and all: one program per 64-row block
of Q, a single 64-row block of K/V, causal mask, plain softmax, no 1/sqrt(d) scale."""

import torch
import triton
import triton.language as tl


@triton.jit
def _article_fwd(Q, K, V, O, N, D: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)  # one K/V block only: wrong once N > BLOCK
    offs_d = tl.arange(0, D)
    base = bh * N * D
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
    s = tl.dot(q, tl.trans(k))  # no 1/sqrt(d) scale
    s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    s = tl.where(offs_n[None, :] < N, s, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    o = tl.dot(p.to(v.dtype), v)
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=offs_m[:, None] < N)


def flash_attention_forward(q, k, v):
    z, h, n, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    _article_fwd[(triton.cdiv(n, 64), z * h)](q, k, v, o, n, D=d, BLOCK=64)
    return o
