"""The swap: a flashrun kernel as a transformers attention implementation.

transformers 5.x calls every registered attention function as
``fn(module, query, key, value, attention_mask, scaling=, dropout=, [sliding_window=, softcap=,]
**kwargs)`` with query ``(B, H, Nq, D)`` and key/value ``(B, H_kv, Nk, D)`` (GQA not repeated;
strided views of the projections) and expects ``((B, Nq, H, D), weights or None)``
(research/models.md section 1). :func:`register` registers a :class:`Swap` under :data:`NAME` - a
name without "flash", "sdpa" or "flex_attention", which transformers reads as requests for its
own kernels - together with transformers' FlashAttention mask function, so the layers receive
either no mask or a 2D key-padding mask, never a dense one.

What arrives becomes the kernel's arguments:

* causal: ``module.is_causal`` (or an ``is_causal`` keyword), bottom-right aligned when Nk > Nq
  (decode against a cache), which is flashrun's convention;
* ``sliding_window`` W: transformers lets query i see keys i - W < j <= i, i.e. ``window=(W-1, -1)``
  with causal; ``softcap``; ``scaling`` as ``sm_scale``; GQA as is;
* a 2D padding mask, or ``position_ids`` that restart inside one row (packed sequences), or
  ``cu_seq_lens_q/k``: the packed (varlen) call on the valid rows; padded query rows get zeros.

Whatever the kernel cannot express - an arbitrary 4-D mask, dropout, a padding mask with holes, a
variant or packed call the kernel's signature does not take - raises :class:`Unsupported` with
the reason: the model fails, it never falls back to SDPA.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch

from flashrun.errors import KernelError

NAME = "fr_kernel"
REFERENCE = "fr_reference"  # the checks' reference: the family's eager attention, blind rows zeroed
FLOOR = "fr_floor"  # speed's floor: no attention at all (:func:`floor_attention`), not a model

# id(new keys a cache layer handed on unwritten) -> (those keys, the layer), whose ``attend(query,
# causal, sm_scale, variant)`` makes the one kernel call that writes them into its cache and reads
# it (:mod:`flashrun.model.fp8cache`); the keys are held so that their id stays theirs
PENDING: dict[int, tuple[torch.Tensor, Any]] = {}


class Unsupported(KernelError):
    """The model asks something of the attention that the kernel cannot express."""

    exit_code = 1


class Swap:
    """The attention function transformers calls; counts what it was asked (``calls``)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel  # flashrun.kernels.Kernel
        self.calls: Counter[str] = Counter()
        self._batch: tuple[tuple, tuple, dict | None] | None = None  # (key, its tensors, _packing's answer)

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, softcap: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout and module.training:
            raise Unsupported(f"the model asks for attention dropout p={dropout}, which flashrun's kernels do not do",
                              hint="set the config's attention_dropout to 0")
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        variant: dict[str, Any] = {}
        if sliding_window:
            variant["window"] = (int(sliding_window) - 1, -1)  # W keys including the query's own
        if softcap:
            variant["softcap"] = float(softcap)
        dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) \
            else query.dtype  # autocast hands fp32 q/k with a bf16 v: one compute dtype
        pending = PENDING.get(id(key))
        if pending is not None and pending[0] is key:
            return self._cached(pending[1], query, attention_mask, causal, scaling, variant), None
        q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))
        packed = self._packing(attention_mask, q, k, kwargs)
        if packed is not None:
            variant.update(packed)
        self._refuse_missing(variant, packed is not None)
        self.calls["packed" if packed is not None else "dense"] += 1
        if variant:
            self.calls.update(name for name in variant if not name.startswith(("_", "cu_", "max_")))
        if packed is None:  # (B, H, Nq, D) -> (B, Nq, H, D): a view when the kernel wrote o like q
            out = self.kernel(q, k, v, causal=causal, sm_scale=scaling, **variant).transpose(1, 2)
        else:
            out = _packed_call(self.kernel, q, k, v, causal, scaling, variant, packed)
        return out.to(query.dtype), None

    def _cached(self, layer: Any, query: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                scaling: float | None, variant: dict[str, Any]) -> torch.Tensor:
        """Attention through a cache layer that left its new keys to the kernel (an fp8 cache)."""
        if mask is not None:
            raise Unsupported("generation over an fp8 KV cache takes unpadded batches",
                              hint="give every sequence the same prompt length")
        self.calls["kv-cache"] += 1
        self.calls.update(variant.keys())
        return layer.attend(query, causal, scaling, variant)

    def _packing(self, mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> dict | None:
        """:func:`_packing` once per forward, not once per layer: every layer gets the same mask and
        position_ids, and reading them back (is the padding contiguous? do positions restart?)
        waits for the GPU - on the H200 those per-layer syncs idled it between layers. Keyed on the
        tensors' identity and version (held while remembered, so that their ids stay theirs)."""
        sources = (mask, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
        key = (tuple(None if t is None else (id(t), t._version) for t in sources), q.shape[0], q.shape[2], k.shape[2])
        if self._batch is not None and self._batch[0] == key:
            return self._batch[2]
        packed = _packing(mask, q, k, kwargs)
        self._batch = (key, sources, packed)
        return packed

    def _refuse_missing(self, variant: dict[str, Any], packed: bool) -> None:
        missing = self.kernel.missing({name: value for name, value in variant.items() if not name.startswith("_")})
        if missing:
            need = "a padded or packed batch" if packed and "cu_seqlens_q" in missing else "this model's layers"
            raise Unsupported(f"kernel {self.kernel.name} does not take {', '.join(sorted(missing))}, which "
                              f"{need} need(s)", hint="add the argument to the kernel's signature (see `flashrun "
                              "init`'s template), or pick a model/batch without that variant")


# -- padded and packed batches ------------------------------------------------------------------


def _packing(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> dict | None:
    """The varlen arguments for a padded or packed batch, or None for a plain one. Internal keys
    (``_rows_q``/``_rows_k``, the valid rows' indices into the flattened (B·N) rows) say where rows
    come from."""
    batch, _, n_q, _ = q.shape
    n_k = k.shape[2]
    if mask is not None:
        if mask.dim() != 2 or mask.dtype != torch.bool:
            raise Unsupported(f"the model passed a {mask.dim()}-D {str(mask.dtype).removeprefix('torch.')} attention "
                              "mask; flashrun's kernels take causal/window/padding, not an arbitrary mask",
                              hint="this happens with a custom 4-D mask or a static cache; use the model's own "
                                   "masks and a dynamic cache")
        rows_k = mask[:, -n_k:]
        _contiguous_rows(rows_k, right_aligned=n_q < n_k)
        rows_q = rows_k[:, -n_q:]
        return _varlen(rows_q, rows_k)
    starts = kwargs.get("cu_seq_lens_q")
    if starts is not None and n_q == n_k and batch == 1:
        lengths = torch.diff(starts.to(torch.int64))
        return _split(lengths, n_q)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and n_q == n_k and n_q > 1 and batch == 1:
        restarts = torch.diff(position_ids[0]) != 1
        if bool(restarts.any()):
            edges = torch.nonzero(restarts).flatten() + 1
            bounds = torch.cat([edges.new_zeros(1), edges, edges.new_full((1,), n_q)])
            return _split(torch.diff(bounds), n_q)
    return None


def _contiguous_rows(rows: torch.Tensor, right_aligned: bool) -> None:
    """A padding mask must mark one contiguous run of keys per row (left or right padding);
    against a cache (Nq < Nk) the run must end at the last key (left padding)."""
    count = rows.sum(dim=1)
    index = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    first = torch.where(rows, index, rows.shape[1]).amin(dim=1)
    last = torch.where(rows, index, -1).amax(dim=1)
    ok = (count == 0) | (last - first + 1 == count)
    if right_aligned:
        ok &= (count == 0) | (last == rows.shape[1] - 1)
    if not bool(ok.all()):
        raise Unsupported("the padding mask has holes (or right padding against a cache); flashrun's packed call "
                          "takes one contiguous run of tokens per sequence",
                          hint="pad on one side only (left padding for generation)")


def _varlen(rows_q: torch.Tensor, rows_k: torch.Tensor) -> dict:
    """The packed call's arguments, and the flat indices of the valid rows (``_rows_q``/``_rows_k``),
    worked out once per forward so that the layers gather and scatter without waiting for the GPU."""
    lengths_q, lengths_k = rows_q.sum(dim=1), rows_k.sum(dim=1)
    return {"cu_seqlens_q": _offsets(lengths_q), "cu_seqlens_k": _offsets(lengths_k),
            "max_seqlen_q": int(lengths_q.max()), "max_seqlen_k": int(lengths_k.max()),
            "_rows_q": _flat_index(rows_q), "_rows_k": _flat_index(rows_k)}


def _flat_index(rows: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(rows.flatten()).squeeze(1)


def _split(lengths: torch.Tensor, n: int) -> dict:
    """Sequences packed back to back in the one row of a batch of 1."""
    offsets = _offsets(lengths)
    longest = int(lengths.max())
    return {"cu_seqlens_q": offsets, "cu_seqlens_k": offsets, "max_seqlen_q": longest, "max_seqlen_k": longest}


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def _packed_call(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scaling: float | None, variant: dict, packed: dict) -> torch.Tensor:
    """q (B, H, Nq, D) -> the valid rows packed (total, H, D), the kernel, and back to
    (B, Nq, H, D) with zeros in padded query rows."""
    args = {name: value for name, value in variant.items() if not name.startswith("_")}
    rows_q, rows_k = packed.get("_rows_q"), packed.get("_rows_k")
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D)
    if rows_q is None:  # one row of back-to-back sequences
        out = kernel(q_t[0], k_t[0], v_t[0], causal=causal, sm_scale=scaling, **args)
        return out.unsqueeze(0)
    rows = [t.flatten(0, 1).index_select(0, index) for t, index in ((q_t, rows_q), (k_t, rows_k), (v_t, rows_k))]
    out_rows = kernel(*rows, causal=causal, sm_scale=scaling, **args)
    out = q_t.new_zeros(q_t.shape)
    out.view(-1, *out.shape[2:]).index_copy_(0, rows_q, out_rows)
    return out


def reference_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The module's own family's eager attention (softcap and all), with every query row that may
    see no key - a padded position - set to zero, as flashrun's kernels write it. Eager leaves such
    rows NaN in float64 (its additive mask overflows to -inf), and a NaN row reaches every real
    row of the next layer through 0 x NaN in P·V; real rows never see padded keys, so zeroing the
    padded rows changes no real one."""
    family = sys.modules[type(module).__module__]
    eager = getattr(family, "eager_attention_forward", None)
    if eager is None:  # a family without its own: the plain one
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:  # eager's additive float mask: (B, 1, Nq, Nk), 0 or the dtype's min
        blind = (attention_mask <= torch.finfo(attention_mask.dtype).min / 2).all(-1)  # (B, 1, Nq)
        out = out.masked_fill(blind.transpose(1, 2).unsqueeze(-1), 0.0)  # out: (B, Nq, H, D)
    return out, weights


def floor_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """No attention: each query's own position of V, with q and k added times zero so that their
    projections still take a backward. What a phase costs around its attention - the time no
    attention kernel can win back (Amdahl's bound on a speedup); not a model."""
    groups, nq = query.shape[1] // value.shape[1], query.shape[2]
    v, k = (t[:, :, -nq:].repeat_interleave(groups, dim=1) for t in (value, key))
    return (v + (query + k) * 0).transpose(1, 2), None


def register(kernel: Any) -> Swap:
    """Register ``kernel`` as the attention implementation :data:`NAME`, and the checks'
    reference as :data:`REFERENCE` and speed's floor as :data:`FLOOR` (process-wide, as
    transformers' registry is); returns the
    :class:`Swap`, whose ``calls`` count its uses."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, flash_attention_mask

    swap = Swap(kernel)
    AttentionInterface.register(NAME, swap)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    AttentionInterface.register(FLOOR, floor_attention)
    AttentionMaskInterface.register(FLOOR, flash_attention_mask)
    return swap
