"""Random inputs for a :class:`~flashrun.harness.shapes.Shape`: one generator for verify, bench
and the tests, so the same seed gives the same tensors everywhere (a failing bench row is
reproduced by ``flashrun verify`` with that seed).

Draws are N(0, 1) in float32 from a generator seeded with ``seed`` on the target device, then
cast to the shape's dtype, in the order q, k, v, dout (then the next set, if several). Never
zeros: some kernels are faster on zeros.

Packed shapes (``shape.seqlens``) draw q and dout as ``(total_q, H, D)`` and k, v as
``(total_k, H_kv, D)``, in the same order. Each :class:`Inputs` also carries what a kernel and
the judge need besides the tensors: the variant arguments, the ALiBi slopes and the
``cu_seqlens`` offsets (:meth:`Inputs.variant_args`, :meth:`Inputs.reference_args`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from flashrun.harness.shapes import Shape


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

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]

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
        return args

    def reference_args(self) -> dict[str, Any]:
        """The variant as :class:`~flashrun.harness.judge.Reference` takes it."""
        return {"window": self.window, "softcap": self.softcap, "alibi_slopes": self.alibi_slopes,
                "cu_seqlens_q": self.cu_seqlens_q, "cu_seqlens_k": self.cu_seqlens_k}


def cu_seqlens(lengths: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """int32 offsets ``(B + 1,)`` of sequences of these lengths packed back to back."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def slopes(shape: Shape, device: torch.device | str) -> torch.Tensor | None:
    """The standard ALiBi slopes of the shape's heads (float32 (H,)), or None without ALiBi."""
    if not shape.alibi:
        return None
    from flashrun.kernels.flash.args import (
        alibi_slopes,  # callers have selected the device already
    )

    return alibi_slopes(shape.num_heads, device=device)


def make_inputs(shape: Shape, seed: int, device: torch.device | str, sets: int = 1,
                requires_grad: bool = False) -> list[Inputs]:
    """``sets`` input sets for ``shape``; ``requires_grad`` marks q, k, v as autograd leaves."""
    dtype = getattr(torch, shape.dtype)
    if shape.seqlens is not None:
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

    def draw(size: tuple[int, ...], grad: bool) -> torch.Tensor:
        x = torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(grad)

    return [Inputs(draw(q_shape, requires_grad), draw(kv_shape, requires_grad), draw(kv_shape, requires_grad),
                   draw(q_shape, False), shape.window, shape.softcap, alibi, **packing) for _ in range(sets)]
