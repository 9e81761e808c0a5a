"""Reference attention in plain PyTorch. Kernels never import this module.

``attention_ref(..., upcast=True)`` is the truth: float64 on the CPU, float32 on a GPU (where
float64 matmuls are slow). ``upcast=False`` is PyTorch doing the same maths in the inputs'
own precision: the *yardstick* a low-precision kernel's error is judged against.

Conventions shared with the kernels (FlashAttention-2's semantics):
  * layout ``(batch, heads, seq, head_dim)``; ``k``/``v`` may have fewer heads (GQA/MQA);
  * ``sm_scale`` defaults to ``1/sqrt(head_dim)``;
  * scores ``s = q·kᵀ·sm_scale``; with ``softcap > 0``, ``s = softcap·tanh(s / softcap)``; then
    ALiBi adds ``-slope[h]·|i + off - j|``; then the mask;
  * with ``off = Nk - Nq`` (bottom-right alignment), key ``j`` is allowed for query ``i`` iff
    ``j >= i + off - left`` (when ``left >= 0``) and ``j <= i + off + right`` (when
    ``right >= 0``); ``window = (left, right)``, ``-1`` unbounded; ``causal`` means ``right = 0``;
  * a query row that sees no key outputs zeros (its log-sum-exp is ``-inf``), never NaN.

Any block of query rows can be computed on its own (``q_start``, ``seq_len_q``) with exactly the
result it has in the whole matrix, so callers bound the memory to one ``block x Nk`` score tile.
"""

from __future__ import annotations

import itertools
import math

import torch


def _positions(n_q: int, n_k: int, device: torch.device | str, q_start: int, seq_len_q: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i + off)`` as a column and ``j`` as a row, for query rows ``q_start .. q_start + n_q``."""
    seq_len_q = n_q if seq_len_q is None else seq_len_q
    rows = torch.arange(q_start, q_start + n_q, device=device)[:, None] + (n_k - seq_len_q)
    return rows, torch.arange(n_k, device=device)[None, :]


def allowed(n_q: int, n_k: int, device: torch.device | str, causal: bool = False,
            window: tuple[int, int] = (-1, -1), q_start: int = 0, seq_len_q: int | None = None) -> torch.Tensor:
    """``True`` where query ``i`` (rows ``q_start .. q_start + n_q`` of ``seq_len_q``) may see key ``j``.

    A side of the window at least as wide as the keys is unbounded (FlashAttention-2 does the same)."""
    left, right = window
    left = -1 if left >= n_k else left  # a window wider than the keys is unbounded
    right = 0 if causal else -1 if right >= n_k else right
    rows, cols = _positions(n_q, n_k, device, q_start, seq_len_q)
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= cols >= rows - left
    if right >= 0:
        keep &= cols <= rows + right
    return keep


def causal_mask(n_q: int, n_k: int, device: torch.device | str) -> torch.Tensor:
    """``True`` where query ``i`` may see key ``j`` under bottom-right causal masking."""
    return allowed(n_q, n_k, device, causal=True)


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H, N, D): each kv head serves ``H / H_kv`` query heads."""
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def alibi_bias(slopes: torch.Tensor, n_q: int, n_k: int, q_start: int = 0, seq_len_q: int | None = None
               ) -> torch.Tensor:
    """``-slope·|i + off - j|`` as ``(B or 1, H, n_q, n_k)`` from slopes ``(H,)`` or ``(B, H)``."""
    rows, cols = _positions(n_q, n_k, slopes.device, q_start, seq_len_q)
    distance = (rows - cols).abs().to(slopes.dtype)  # (n_q, n_k)
    per_head = slopes if slopes.dim() == 2 else slopes[None]  # (B or 1, H)
    return -per_head[:, :, None, None] * distance


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    upcast: bool = True,
    return_lse: bool = False,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    q_start: int = 0,
    seq_len_q: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive attention: scores materialized, softmax, weighted sum. Differentiable.

    ``q`` may be a block of query rows ``[q_start, q_start + q.shape[2])`` of a sequence of
    ``seq_len_q`` queries (default: the whole sequence); masks and biases use the global rows.
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if upcast:
        dtype = torch.float64 if q.device.type == "cpu" else torch.float32
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    n_q, n_k = q.shape[2], k.shape[2]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * sm_scale  # (B, H, Nq, Nk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), n_q, n_k, q_start, seq_len_q)
    if causal or window != (-1, -1):
        keep = allowed(n_q, n_k, q.device, causal, window, q_start, seq_len_q)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)  # (B, H, Nq)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key: all -inf -> NaN -> 0
    out = torch.matmul(probs.to(v.dtype), v)
    return (out, lse) if return_lse else out


def attention_ref_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    upcast: bool = True,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed sequences: ``q (total_q, H, D)``, ``k, v (total_k, H_kv, D)``; sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``; each is attended on its own (``off`` per sequence).
    ``alibi_slopes``: ``(H,)`` or ``(B, H)``. Returns ``(total_q, H, D)`` in the reference dtype."""
    outs = []
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        qb = q[starts_q[b]:starts_q[b + 1]].transpose(0, 1)[None]  # (1, H, Nq_b, D)
        kb = k[starts_k[b]:starts_k[b + 1]].transpose(0, 1)[None]
        vb = v[starts_k[b]:starts_k[b + 1]].transpose(0, 1)[None]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        ob = attention_ref(qb, kb, vb, causal, sm_scale, upcast, window=window, softcap=softcap, alibi_slopes=slopes)
        outs.append(ob[0].transpose(0, 1))  # (Nq_b, H, D)
    return torch.cat(outs, dim=0)


def attention_fp8_yardstick(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            sm_scale: float | None = None, window: tuple[int, int] = (-1, -1), q_start: int = 0,
                            seq_len_q: int | None = None, out_e4m3: bool = False) -> torch.Tensor:
    """What an fp8 forward cannot avoid, computed plainly: the yardstick of an e4m3 attention
    (FlashAttention-3's rule, research/fp8.md section 5). On the dequantized inputs (B, H, N, D),
    scores in float32, P = exp2(s - rowmax + 8) rounded to e4m3 (round to nearest), O = P·V / ΣP
    in float32, returned in bf16 - the maths of :mod:`flashrun.kernels.flash.fp8` with one max per
    row instead of a running one. ``q_start``/``seq_len_q``: a block of query rows, as
    :func:`attention_ref` takes them. ``out_e4m3``: a kernel that writes O in e4m3 (cuDNN's, scale
    1) cannot avoid rounding it there too: O is rounded to e4m3 before bf16."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = q.float(), expand_kv(k.float(), q.shape[1]), expand_kv(v.float(), q.shape[1])
    n_q, n_k = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * (sm_scale / math.log(2))  # log2 units
    if causal or window != (-1, -1):
        scores = scores.masked_fill(~allowed(n_q, n_k, q.device, causal, window, q_start, seq_len_q), float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row that sees no key
    p = torch.exp2(scores - top + 8.0).to(torch.float8_e4m3fn).float()
    total = p.sum(-1, keepdim=True)
    o = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
    return (o.to(torch.float8_e4m3fn) if out_e4m3 else o).to(torch.bfloat16)


def cached_sequence(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, keys: int) -> torch.Tensor:
    """Sequence b's first ``keys`` slots of a cache, ``(keys, H_kv, D)``: its row of a contiguous
    cache ``(B, capacity, H_kv, D)``, or its pages of a paged one ``(pages, page_size, H_kv, D)``
    back to back, in ``block_table[b]`` order - only the pages that hold them (the rest of a
    block-table row is never read, so it may hold anything)."""
    if block_table is None:
        return cache[b, :keys]
    pages = block_table[b, :-(-keys // cache.shape[1])].long()
    return cache.index_select(0, pages).flatten(0, 1)[:keys]


def gather_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                   block_table: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                   v_new: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A KV-cache call as packed sequences: ``(q, k, v, cu_seqlens_q, cu_seqlens_k)`` with q
    ``(B·Nq, H, D)`` and sequence b's keys its first ``cache_seqlens[b]`` cached ones (pages in
    ``block_table`` order when paged) followed by its new ones - what FlashAttention-2's
    ``flash_attn_with_kvcache`` attends to. Layouts (batch, seq, heads, head_dim)."""
    batch, n_q = q.shape[:2]
    lengths = cache_seqlens.tolist()
    keys, values = [], []
    for b in range(batch):
        keys.append(cached_sequence(k_cache, block_table, b, lengths[b]))
        values.append(cached_sequence(v_cache, block_table, b, lengths[b]))
        if k_new is not None:
            keys.append(k_new[b])
            values.append(v_new[b])
    new = 0 if k_new is None else k_new.shape[1]
    cu_q = torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, *itertools.accumulate(n + new for n in lengths)], dtype=torch.int32, device=q.device)
    return q.flatten(0, 1), torch.cat(keys), torch.cat(values), cu_q, cu_k


def logit_range(q: torch.Tensor, k: torch.Tensor, sm_scale: float | None = None) -> tuple[float, float]:
    """min/max of ``q·kᵀ·scale``: far outside about [-10, 10], softmax saturates."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    k = expand_kv(k, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * sm_scale
    return scores.min().item(), scores.max().item()
