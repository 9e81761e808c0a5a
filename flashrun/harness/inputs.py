"""Random inputs for a :class:`~flashrun.harness.shapes.Shape`: one generator for verify, bench
and the tests, so the same seed gives the same tensors everywhere (a failing bench row is
reproduced by ``flashrun verify`` with that seed).

Draws are N(0, 1) in float32 from a generator seeded with ``seed`` on the target device, then
cast to the shape's dtype, in the order q, k, v, dout (then the next set, if several). Never
zeros: some kernels are faster on zeros.

Packed shapes (``shape.seqlens``) draw q and dout as ``(total_q, H, D)`` and k, v as
``(total_k, H_kv, D)``, in the same order. KV-cache shapes (``shape.cache_seqlens``) use
FlashAttention's ``(batch, seq, heads, head_dim)`` layout: q and dout ``(B, Nq, H, D)``, k and v
the caches - ``(B, capacity, H_kv, D)``, or paged ``(pages, page_size, H_kv, D)`` with a
:func:`block_table` - filled whole (slots past a sequence's length hold keys too), then the new
keys and values ``(B, new_keys, H_kv, D)``. An fp8 cache (``shape.kv_scale``) is those caches
quantized to float8_e4m3fn (:func:`to_e4m3`), the originals kept for the error against them.
An e4m3 shape (the fp8 forward) draws q, k, v, dout in bf16 (its output's dtype) and quantizes
q, k, v with a descale per (batch, kv head) (:func:`to_e4m3_heads`), keeping the originals too.
Each :class:`Inputs` also carries what a kernel and
the judge need besides the tensors: the variant arguments, the ALiBi slopes, the
``cu_seqlens`` offsets and the cache's lengths and block table (:meth:`Inputs.variant_args`,
:meth:`Inputs.reference_args`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from flashrun.harness.shapes import Shape
from flashrun.limits import FP8_DTYPE


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # (B, H, Nq, D), packed (total_q, H, D)
    k: torch.Tensor  # (B, H_kv, Nk, D), packed (total_k, H_kv, D)
    v: torch.Tensor  # as k
    dout: torch.Tensor  # as q, the upstream gradient
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # float32 (H,)
    cu_seqlens_q: torch.Tensor | None = None  # int32 (B + 1,): packed sequence b is rows cu[b]:cu[b+1]
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    cache_seqlens: torch.Tensor | None = None  # KV cache: int32 (B,), keys each sequence holds
    block_table: torch.Tensor | None = None  # paged: int32 (B, pages per sequence)
    k_new: torch.Tensor | None = None  # (B, new_keys, H_kv, D), appended to the cache by the call
    v_new: torch.Tensor | None = None
    k_scale: float | torch.Tensor | None = None  # an fp8 cache's scales (one, or one per key and kv head)
    v_scale: float | torch.Tensor | None = None
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # e4m3 q, k, v's: float32 (B, H_kv)
    unquantized: dict[str, torch.Tensor] | None = None  # what was quantized (k, v; or q, k, v), as drawn

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]

    def per_set(self) -> dict[str, Any]:
        """What a bench call on this input set takes besides ``(q, k, v)`` and differs from set to
        set: an fp8 cache's scales (drawn with its values); empty otherwise."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def variant_args(self) -> dict[str, Any]:
        """The keyword arguments a kernel needs for this case beyond ``(q, k, v, causal,
        sm_scale)``, FlashAttention-2's names; empty for plain attention."""
        args: dict[str, Any] = {}
        if self.window != (-1, -1):
            args["window"] = self.window
        if self.softcap:
            args["softcap"] = self.softcap
        if self.alibi_slopes is not None:
            args["alibi_slopes"] = self.alibi_slopes
        if self.cu_seqlens_q is not None:
            args.update(cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=self.cu_seqlens_k,
                        max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)
        if self.cache_seqlens is not None:
            args["cache_seqlens"] = self.cache_seqlens
            if self.block_table is not None:
                args["block_table"] = self.block_table
            if self.k_new is not None:
                args.update(k_new=self.k_new, v_new=self.v_new)
            if self.k_scale is not None:
                args.update(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.descales is not None:
            args.update(zip(("q_descale", "k_descale", "v_descale"), self.descales))
        return args

    def reference_args(self) -> dict[str, Any]:
        """The variant as :class:`~flashrun.harness.judge.Reference` takes it."""
        return {"window": self.window, "softcap": self.softcap, "alibi_slopes": self.alibi_slopes,
                "cu_seqlens_q": self.cu_seqlens_q, "cu_seqlens_k": self.cu_seqlens_k}


def cu_seqlens(lengths: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """int32 offsets ``(B + 1,)`` of sequences of these lengths packed back to back."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def block_table(shape: Shape, device: torch.device | str) -> torch.Tensor | None:
    """A paged shape's block table, int32 (B, capacity / page_size): sequence b's j-th page is
    page P - 1 - (j·B + b) of P, so no sequence's pages are in order or side by side (an
    addressing bug cannot pass). None for a contiguous cache."""
    if not shape.page_size:
        return None
    per_sequence = shape.capacity // shape.page_size
    pages = per_sequence * shape.batch_size
    j, b = torch.meshgrid(torch.arange(per_sequence), torch.arange(shape.batch_size), indexing="ij")
    return (pages - 1 - (j * shape.batch_size + b)).T.contiguous().to(device=device, dtype=torch.int32)


def slopes(shape: Shape, device: torch.device | str) -> torch.Tensor | None:
    """The standard ALiBi slopes of the shape's heads (float32 (H,)), or None without ALiBi."""
    if not shape.alibi:
        return None
    from flashrun.kernels.flash.args import (
        alibi_slopes,  # callers have selected the device already
    )

    return alibi_slopes(shape.num_heads, device=device)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two at or above ``amax / 448`` (1 where amax is 0): the scale that keeps every
    value finite in e4m3, and whose products with e4m3 values are exact in bf16 and fp16 (the
    rule ``flash_attention_with_kvcache`` quantizes new keys by, restated here as the spec)."""
    scale = torch.exp2(torch.ceil(torch.log2(amax.float() / FP8_MAX)))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def to_e4m3(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, float | torch.Tensor]:
    """``x`` (..., D) in float8_e4m3fn and its scale: one for the whole tensor (``"tensor"``, a
    float) or one per row of D (``"token"``: per key and kv head, x's shape without D)."""
    scale = e4m3_scale(x.abs().amax()) if mode == "tensor" else e4m3_scale(x.abs().amax(-1))
    divisor = scale if mode == "tensor" else scale[..., None]
    x8 = (x.float() / divisor).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, float(scale) if mode == "tensor" else scale


def to_e4m3_heads(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, H, N, D) in float8_e4m3fn and its descales, float32 (B, kv_heads): amax / 448 over
    each kv head's group of heads (FlashAttention-3's layout; 1 where the group is all zeros).
    :func:`flashrun.kernels.quantize_qkv`'s rule, restated here on purpose: verify's inputs do not
    depend on the library they judge (and stay contiguous for users' kernels)."""
    batch, heads = x.shape[:2]
    amax = x.abs().amax(dim=(2, 3)).float().view(batch, kv_heads, heads // kv_heads).amax(-1)
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    x8 = (x.float() / head_scales(descale, heads)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def head_scales(descale: torch.Tensor, heads: int) -> torch.Tensor:
    """Descales (B, H_kv) broadcast over (B, heads, N, D); one for the whole tensor (shape ()) as it is."""
    if descale.dim() == 0:
        return descale
    return descale.repeat_interleave(heads // descale.shape[1], 1)[..., None, None]


def from_e4m3(x8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 tensor holds, ``x8 · scale``, in ``dtype`` (exact for power-of-two scales)."""
    return (x8.float() * (scale[..., None] if isinstance(scale, torch.Tensor) else scale)).to(dtype)


def as_cached(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """New keys or values as an fp8 cache holds them once appended (in x's dtype): by the whole
    cache's ``scale``, or (``scale`` a tensor: per key and kv head) by each row's own."""
    if isinstance(scale, torch.Tensor):
        return from_e4m3(*to_e4m3(x, "token"), x.dtype)
    x8 = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return from_e4m3(x8, scale, x.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device | str, sets: int = 1,
                requires_grad: bool = False, outliers: float = 0.0) -> list[Inputs]:
    """``sets`` input sets for ``shape``; ``requires_grad`` marks q, k, v as autograd leaves (not
    for a KV-cache call or an e4m3 one: they have no backward). ``outliers``: that fraction of q,
    k and v's elements drawn ten times larger (what fp8's per-head scales meet in real activations)."""
    fp8 = shape.dtype == FP8_DTYPE
    dtype = torch.bfloat16 if fp8 else getattr(torch, shape.dtype)
    requires_grad = requires_grad and not shape.forward_only
    new_shape = None
    if shape.cache_seqlens is not None:
        q_shape = (shape.batch_size, shape.seq_len, shape.num_heads, shape.head_dim)
        kv_shape = ((shape.batch_size * shape.capacity // shape.page_size, shape.page_size) if shape.page_size
                    else (shape.batch_size, shape.capacity)) + (shape.num_kv_heads, shape.head_dim)
        new_shape = (shape.batch_size, shape.new_keys, shape.num_kv_heads, shape.head_dim) if shape.new_keys else None
        packing = {"cache_seqlens": torch.tensor(shape.cache_seqlens, dtype=torch.int32, device=device),
                   "block_table": block_table(shape, device)}
        requires_grad = False
    elif shape.seqlens is not None:
        q_shape = (sum(shape.seqlens), shape.num_heads, shape.head_dim)
        kv_shape = (sum(shape.key_lengths), shape.num_kv_heads, shape.head_dim)
        packing = {"cu_seqlens_q": cu_seqlens(shape.seqlens, device),
                   "cu_seqlens_k": cu_seqlens(shape.key_lengths, device),
                   "max_seqlen_q": max(shape.seqlens), "max_seqlen_k": max(shape.key_lengths)}
    else:
        q_shape = (shape.batch_size, shape.num_heads, shape.seq_len, shape.head_dim)
        kv_shape = (shape.batch_size, shape.num_kv_heads, shape.seq_len_k, shape.head_dim)
        packing = {}
    gen = torch.Generator(device=device).manual_seed(seed)
    alibi = slopes(shape, device)

    def draw(size: tuple[int, ...], grad: bool, spread: float = 0.0) -> torch.Tensor:
        x = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
        if spread:
            x = torch.where(torch.rand(size, generator=gen, device=device) < spread, 10 * x, x)
        return x.to(dtype).requires_grad_(grad)

    def one_set() -> Inputs:
        tensors = [draw(q_shape, requires_grad, outliers), draw(kv_shape, requires_grad, outliers),
                   draw(kv_shape, requires_grad, outliers), draw(q_shape, False)]
        new = {"k_new": draw(new_shape, False), "v_new": draw(new_shape, False)} if new_shape else {}
        if shape.kv_scale:  # the caches in e4m3; the originals kept for the error against them
            (k8, k_scale), (v8, v_scale) = (to_e4m3(t, shape.kv_scale) for t in tensors[1:3])
            new.update(k_scale=k_scale, v_scale=v_scale, unquantized={"k": tensors[1], "v": tensors[2]})
            tensors[1:3] = [k8, v8]
        if fp8:  # q, k, v in e4m3; the originals kept for the error against them
            quantized = [to_e4m3_heads(t, shape.num_kv_heads) for t in tensors[:3]]
            new.update(descales=tuple(d for _, d in quantized), unquantized=dict(zip("qkv", tensors[:3])))
            tensors[:3] = [x8 for x8, _ in quantized]
        return Inputs(*tensors, shape.window, shape.softcap, alibi, **packing, **new)

    return [one_set() for _ in range(sets)]
