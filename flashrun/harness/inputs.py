"""Random inputs for a :class:`~flashrun.harness.shapes.Shape`: one generator for verify, bench
and the tests, so the same seed gives the same tensors everywhere (a failing bench row is
reproduced by ``flashrun verify`` with that seed).

Draws are N(0, 1) in float32 from a generator seeded with ``seed`` on the target device, then
cast to the shape's dtype, in the order q, k, v, dout (then the next set, if several). Never
zeros: some kernels are faster on zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrun.harness.shapes import Shape


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # (B, H, Nq, D)
    k: torch.Tensor  # (B, H_kv, Nk, D)
    v: torch.Tensor  # (B, H_kv, Nk, D)
    dout: torch.Tensor  # (B, H, Nq, D), the upstream gradient

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]


def make_inputs(shape: Shape, seed: int, device: torch.device | str, sets: int = 1,
                requires_grad: bool = False) -> list[Inputs]:
    """``sets`` input sets for ``shape``; ``requires_grad`` marks q, k, v as autograd leaves."""
    dtype = getattr(torch, shape.dtype)
    q_shape = (shape.batch_size, shape.num_heads, shape.seq_len, shape.head_dim)
    kv_shape = (shape.batch_size, shape.num_kv_heads, shape.seq_len_k, shape.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(size: tuple[int, ...], grad: bool) -> torch.Tensor:
        x = torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(grad)

    return [Inputs(draw(q_shape, requires_grad), draw(kv_shape, requires_grad), draw(kv_shape, requires_grad),
                   draw(q_shape, False)) for _ in range(sets)]
