"""Reference attention in plain PyTorch. Kernels never import this module.

``attention_ref(..., upcast=True)`` is the truth: float64 on the CPU, float32 on a GPU (where
float64 matmuls are slow). ``upcast=False`` is PyTorch doing the same maths in the inputs'
own precision: the *yardstick* a low-precision kernel's error is judged against.

Conventions shared with the kernels:
  * layout ``(batch, heads, seq, head_dim)``; ``k``/``v`` may have fewer heads (GQA/MQA);
  * ``sm_scale`` defaults to ``1/sqrt(head_dim)``;
  * causal with ``Nq != Nk`` is aligned bottom-right (FlashAttention >= 2.1): query ``i``
    sees keys ``j <= i + Nk - Nq``;
  * a query row that sees no key outputs zeros (its log-sum-exp is ``-inf``).
"""

from __future__ import annotations

import math

import torch


def causal_mask(n_q: int, n_k: int, device: torch.device | str) -> torch.Tensor:
    """``True`` where query ``i`` may see key ``j`` (bottom-right aligned)."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + (n_k - n_q)


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H, N, D): each kv head serves ``H / H_kv`` query heads."""
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    upcast: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive attention: scores materialized, softmax, weighted sum. Differentiable."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if upcast:
        dtype = torch.float64 if q.device.type == "cpu" else torch.float32
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * sm_scale  # (B, H, Nq, Nk)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)  # (B, H, Nq)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key: all -inf -> NaN -> 0
    out = torch.matmul(probs.to(v.dtype), v)
    return (out, lse) if return_lse else out


def logit_range(q: torch.Tensor, k: torch.Tensor, sm_scale: float | None = None) -> tuple[float, float]:
    """min/max of ``q·kᵀ·scale``: far outside about [-10, 10], softmax saturates."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    k = expand_kv(k, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * sm_scale
    return scores.min().item(), scores.max().item()
