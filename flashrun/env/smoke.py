"""check-env's smoke test: one tiny Triton kernel, compiled for the GPU or run by the interpreter.

Import this module only after :func:`flashrun.device.select`: Triton decides between compiling
and interpreting when ``@triton.jit`` runs, that is, when this module is imported.

The kernel is a masked 20x20 ``tl.dot`` in one 32x32 block, so it exercises what every
attention kernel needs: pointer arithmetic, masked loads and stores, and the MMA path that
goes through ptxas on a GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

N = 20  # not a multiple of BLOCK: the masks must work
BLOCK = 32
TOLERANCE = 1e-2  # fp16/bf16 products are exact in fp32; only the summation order may differ
KERNEL = f"a {N}x{N} tl.dot kernel"  # how check-env names it


@triton.jit
def _dot_kernel(X, Y, Z, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = (offs[:, None] < n) & (offs[None, :] < n)
    idx = offs[:, None] * n + offs[None, :]
    x = tl.load(X + idx, mask=mask, other=0.0)
    y = tl.load(Y + idx, mask=mask, other=0.0)
    tl.store(Z + idx, tl.dot(x, y), mask=mask)


@dataclass(frozen=True)
class SmokeResult:
    max_error: float  # NaN when the kernel left an element unwritten
    seconds: float  # the first launch, so compile time included

    @property
    def ok(self) -> bool:
        return math.isfinite(self.max_error) and self.max_error <= TOLERANCE


def run(device: str, dtype: torch.dtype = torch.float16) -> SmokeResult:
    """Launch the kernel once on ``device`` ("cuda" or "cpu") and compare with torch.

    verify also runs it in bfloat16: Triton's interpreter (seen with triton 3.9) computes bf16
    ``tl.dot`` wrongly, and verify must know before it judges a user's bf16 kernel there.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, N, generator=gen).to(dtype)
    y = torch.randn(N, N, generator=gen).to(dtype)
    z = torch.full((N, N), float("nan"), device=device)  # poisoned: an unwritten element cannot pass
    start = time.perf_counter()
    _dot_kernel[(1,)](x.to(device), y.to(device), z, N, BLOCK=BLOCK)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    expected = x.float() @ y.float()
    return SmokeResult((z.cpu() - expected).abs().max().item(), seconds)
