"""Bench providers on KV-cache shapes (``shape.cache_seqlens``; see :mod:`~flashrun.harness.shapes`).

The inputs are FlashAttention's: q ``(B, Nq, H, D)``, k and v the caches (contiguous
``(B, capacity, H_kv, D)`` or paged ``(pages, page_size, H_kv, D)`` with the shape's
:func:`~flashrun.harness.inputs.block_table`). Who runs what:

  * ``flash`` and users' kernels that take ``cache_seqlens`` (and ``block_table``): the cache
    itself (:func:`~flashrun.harness.provider.variant_args`);
  * ``flash-attn``: its ``flash_attn_with_kvcache`` (paged caches with pages of a multiple of
    256 keys, FlashAttention-2's rule);
  * ``flex`` on a paged cache: FlexAttention's paged path (``torch.nn.attention.experimental.
    _paged_attention``: a block mask over the physical pages, one block per page);
  * the others (SDPA, ``torch-naive``, ``flex`` on a contiguous cache): the same shape without
    the cache, on the cache gathered into ``(B, H_kv, N, D)`` - once per input set, outside the
    timing: what they would be timed on had the keys been laid out for them.

Bench's caches are full (every sequence holds ``seq_len_k`` keys) and take no new keys; other
KV-cache shapes run only where the cache is read in place.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Callable

import torch

from flashrun.errors import KernelError
from flashrun.harness.inputs import block_table, from_e4m3
from flashrun.harness.provider import Attention, variant_args
from flashrun.harness.reference import cached_sequence
from flashrun.harness.shapes import Shape


def dense_shape(shape: Shape) -> Shape:
    """The shape a provider that reads no cache runs: the cached keys laid out as (B, H_kv, N, D)."""
    if shape.new_keys or len(set(shape.cache_seqlens)) != 1:
        raise KernelError("only kernels that read the cache run a KV-cache shape with ragged lengths or new keys")
    return replace(shape, seq_len_k=shape.cache_seqlens[0], cache_seqlens=None, page_size=0, new_keys=0, kv_scale="")


def gathered(prepare: Callable) -> Callable:
    """``prepare`` (a dense provider's) made to run a KV-cache shape on the gathered cache."""

    def prepare_cached(shape: Shape, device: torch.device):
        attn = prepare(dense_shape(shape), device)
        table, length = block_table(shape, device), shape.cache_seqlens[0]
        laid_out: dict[int, torch.Tensor] = {}

        def gather(cache: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
            """-> (B, H_kv, N, D) in q's dtype (an fp8 cache dequantized), once per input set."""
            if cache.data_ptr() not in laid_out:
                rows = [cached_sequence(cache, table, b, length) for b in range(shape.batch_size)]
                if scale is not None:
                    scales = [cached_sequence(scale, table, b, length) if isinstance(scale, torch.Tensor) else scale
                              for b in range(shape.batch_size)]
                    rows = [from_e4m3(r, s, getattr(torch, shape.dtype)) for r, s in zip(rows, scales)]
                laid_out[cache.data_ptr()] = torch.stack(rows).transpose(1, 2).contiguous()
            return laid_out[cache.data_ptr()]

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale=None, v_scale=None) -> torch.Tensor:
            # (B, Nq, H, D) in and out
            return attn.fn(q.transpose(1, 2), gather(k, k_scale), gather(v, v_scale)).transpose(1, 2)

        note = ("on the cache gathered into (B, H_kv, N, D)" + (", dequantized," if shape.kv_scale else "")
                + " once per input set, outside the timing")
        return Attention(fn, attn.scope, "; ".join(filter(None, [attn.note, note])), attn.path)

    return prepare_cached


def flex_paged(shape: Shape, device: torch.device, flex: Callable, mods: Callable):
    """FlexAttention's paged path on a paged KV-cache shape: q against the whole page pool as one
    (1, H_kv, pages x page_size, D) sequence, under a block mask whose blocks are pages (the
    logical mask converted through the block table). ``mods(shape, device)``: the dense shape's
    (mask_mod, score_mod)."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        raise KernelError(f"this torch ({torch.__version__}) has no FlexAttention paged attention") from None
    if shape.kv_scale:
        raise KernelError("FlexAttention's paged path reads no fp8 cache")
    dense = dense_shape(shape)
    table = block_table(shape, device)
    batch, per_sequence = table.shape
    pages = batch * per_sequence
    paged = PagedAttention(pages, shape.page_size, batch, device=device)
    paged.page_table[:, :per_sequence] = table.long()  # the pool's pages as the shape's block table has them
    paged.physical_to_logical.scatter_(1, table.long(), torch.arange(per_sequence, device=device).expand(batch, -1))
    paged.capacity[:] = shape.capacity
    mask_mod, score_mod = mods(dense, device)
    length = dense.seq_len_k

    def logical(b, h, q_idx, kv_idx):
        keep = kv_idx < length
        return keep & mask_mod(b, h, q_idx, kv_idx) if mask_mod is not None else keep

    block_mask = create_block_mask(logical, batch, None, shape.seq_len, shape.capacity, device=device,
                                   BLOCK_SIZE=(128, shape.page_size))
    block_mask = paged.convert_logical_block_mask(block_mask)
    score_mod = paged.get_score_mod(score_mod) if score_mod is not None else None
    kwargs = {"enable_gqa": True} if shape.num_kv_heads != shape.num_heads else {}
    if kwargs and "enable_gqa" not in inspect.signature(flex_attention).parameters:
        raise KernelError(f"this torch's FlexAttention ({torch.__version__}) has no enable_gqa for the page pool")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool_k, pool_v = (t.flatten(0, 1).transpose(0, 1)[None] for t in (k, v))  # (1, H_kv, pages x size, D)
        return flex(q.transpose(1, 2), pool_k, pool_v, score_mod=score_mod, block_mask=block_mask,
                    **kwargs).transpose(1, 2)

    return Attention(fn, note="FlexAttention's paged path: one block per page")


def flash_attn_kvcache(shape: Shape, device: torch.device):
    """Tri Dao's ``flash_attn_with_kvcache`` on the cache (paged: pages of a multiple of 256 keys)."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None
    except OSError as exc:
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None
    if shape.page_size % 256:
        raise KernelError(f"flash-attn pages hold a multiple of 256 keys, this cache's {shape.page_size}")
    if shape.kv_scale:
        raise KernelError("flash-attn (FlashAttention-2) reads no fp8 cache")
    if shape.new_keys:
        raise KernelError("bench times no new keys")
    args = variant_args(shape, device)
    kwargs = {"window_size" if name == "window" else name: value for name, value in args.items()
              if name in ("window", "softcap", "alibi_slopes", "cache_seqlens", "block_table")}
    return Attention(lambda q, k, v: flash_attn_with_kvcache(q, k, v, causal=shape.causal, **kwargs))
