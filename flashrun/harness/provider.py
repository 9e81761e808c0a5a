"""What a bench provider is, shared by the registry (:mod:`~flashrun.harness.providers`) and the
providers that live in their own modules (:mod:`~flashrun.harness.flex`, :mod:`~flashrun.harness.kvcache`,
:mod:`~flashrun.harness.graphs`): :class:`Provider` prepares, per shape, an :class:`Attention`;
:func:`variant_args` gives a shape's variants as FlashAttention-2's keyword arguments;
:func:`sequences` and :func:`unpacked` handle packed shapes for providers that take one long batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from flashrun.errors import KernelError
from flashrun.harness.inputs import Inputs, block_table, cu_seqlens, slopes
from flashrun.harness.shapes import Shape

AttnFn = Callable[..., torch.Tensor]  # fn(q, k, v, **per_set): per_set, an fp8 cache's scales (Inputs.per_set)


@dataclass(frozen=True)
class Attention:
    fn: AttnFn
    scope: Callable[[], ContextManager] = contextlib.nullcontext
    note: str = ""  # said in the results (e.g. how causal was expressed)
    path: Callable[[], str | None] | None = None  # which implementation ran (asked after the checked call)
    backward_path: Callable[[], str | None] | None = None  # the same for its backward
    # the launch configs its Triton kernels ran since last asked, and where each came from
    # (flashrun.kernels.Kernel.configs); asked before and after the checked call
    configs: Callable[[], dict[str, dict[str, str]]] | None = None
    # a provider that computes in another format (flash-fp8: e4m3) is judged against the reference
    # of what it computes from: the judge's Reference for an input set (None: the shape's own)
    reference: Callable[[Inputs], Any] | None = None


@dataclass(frozen=True)
class Provider:
    name: str
    prepare: Callable[[Shape, torch.device], Attention] = field(repr=False)
    backward: bool = True  # False: bwd and fwd_bwd cells are n/a
    is_kernel: bool = False  # one of ours (or the user's), as opposed to a PyTorch baseline
    fp8: bool = False  # computes in e4m3 from the shape's inputs: % peak of the e4m3 matmul roof, 1-byte q, k, v


def variant_args(shape: Shape, device: torch.device) -> dict:
    """FlashAttention-2's keyword arguments for ``shape`` (only those it needs), as verify passes them."""
    args: dict = {}
    if shape.window != (-1, -1):
        args["window"] = shape.window
    if shape.softcap:
        args["softcap"] = shape.softcap
    if shape.alibi:
        args["alibi_slopes"] = slopes(shape, device)
    if shape.seqlens is not None:
        args.update(cu_seqlens_q=cu_seqlens(shape.seqlens, device), cu_seqlens_k=cu_seqlens(shape.key_lengths, device),
                    max_seqlen_q=shape.seq_len, max_seqlen_k=shape.seq_len_k)
    if shape.cache_seqlens is not None:
        if shape.new_keys:  # the Attention takes (q, k, v): nothing to append with
            raise KernelError("bench times KV-cache calls without new keys")
        args["cache_seqlens"] = torch.tensor(shape.cache_seqlens, dtype=torch.int32, device=device)
        if shape.page_size:
            args["block_table"] = block_table(shape, device)
    return args


def sequences(shape: Shape) -> list[tuple[int, int, int, int]]:
    """(q start, q length, k start, k length) of each sequence: the packed ones, or the one (1, Nq, Nk)."""
    if shape.seqlens is None:
        return [(0, shape.seq_len, 0, shape.seq_len_k)]
    out, q0, k0 = [], 0, 0
    for n_q, n_k in zip(shape.seqlens, shape.key_lengths):
        out.append((q0, n_q, k0, n_k))
        q0, k0 = q0 + n_q, k0 + n_k
    return out


def unpacked(fn: AttnFn, shape: Shape) -> AttnFn:
    """Packed (total, H, D) inputs as one (1, H, total, D) batch for ``fn``, and back."""
    if shape.seqlens is None:
        return fn

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = fn(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))  # (1, H, total, D)
        return out[0].transpose(0, 1)  # (total, H, D)

    return packed
