"""A tiny kernel that measures how wrong this Triton's ``tl.dot`` is on bfloat16 operands.

Triton's CPU interpreter (seen with triton 3.9) returns garbage for bf16 dots; verify asks this
probe before trusting a user's kernel with bf16 inputs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_probe(A, B, C, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(A + offs[:, None] * N + offs[None, :])
    b = tl.load(B + offs[:, None] * N + offs[None, :])
    tl.store(C + offs[:, None] * N + offs[None, :], tl.dot(a, b))


def bf16_dot_error(device: str = "cpu") -> float:
    """Max abs error of a 16x16 bf16 tl.dot against float64 (about 1e-6 when right)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(16, 16, device=device)
    _dot_probe[(1,)](a, b, c, N=16)
    return float((c.double().cpu() - a.double().cpu() @ b.double().cpu()).abs().max())
