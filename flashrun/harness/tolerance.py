"""One tolerance policy, used by ``flashrun verify``, ``flashrun bench`` and the tests.

A kernel's output is compared with a high-precision reference (float64 on the CPU, float32 on
a GPU). Low-precision arithmetic cannot match it exactly, so the bar is set by PyTorch doing
the same maths in the same dtype (the *yardstick*): the kernel passes when

    max|kernel - ref| <= FACTOR * max|yardstick - ref| + atol * max(1, max|ref|)
    and  ||kernel - ref|| / ||ref|| <= max_rel_l2

and nothing is NaN/Inf where the reference is finite, and every element was written. FACTOR = 2
follows flash-attention's own tests; ``atol`` is about one unit in the last place of the dtype
at magnitude 1, so a kernel is never failed for rounding that the dtype itself forces (e.g.
N = 1, where both errors are ~0). ``max_rel_l2`` guards against a yardstick that is itself
far off (it would otherwise excuse anything).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

FACTOR = 2.0


@dataclass(frozen=True)
class Tolerance:
    atol: float
    max_rel_l2: float


TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=1e-3, max_rel_l2=1e-2),
    torch.bfloat16: Tolerance(atol=8e-3, max_rel_l2=5e-2),
    torch.float32: Tolerance(atol=1e-5, max_rel_l2=1e-4),
}


@dataclass(frozen=True)
class Comparison:
    name: str  # "out", "dq", "dk", "dv"
    max_abs: float
    rel_l2: float
    yardstick: float  # max|yardstick - ref|
    bound: float  # the max_abs allowed
    nonfinite: int  # NaN/Inf where the reference is finite
    unwritten: int  # elements still holding the poison value
    first_bad: list[int] | None  # index of the worst element when failing
    passed: bool

    @property
    def ratio(self) -> float | None:
        """Kernel error over yardstick error (None when the yardstick is exact)."""
        return self.max_abs / self.yardstick if self.yardstick > 0 else None

    def reason(self) -> str:
        if self.passed:
            return ""
        if self.unwritten:
            return f"{self.name}: {self.unwritten} element(s) never written"
        if self.nonfinite:
            return f"{self.name}: {self.nonfinite} NaN/Inf value(s)"
        at = f" at {tuple(self.first_bad)}" if self.first_bad else ""
        return (f"{self.name}: max error {self.max_abs:.3g}{at} > allowed {self.bound:.3g} "
                f"(rel-L2 {self.rel_l2:.3g})")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, yardstick: torch.Tensor,
            poison: float | None = None) -> Comparison:
    """Judge ``out`` against ``ref`` (high precision) with ``yardstick`` (same dtype as ``out``)."""
    tol = TOLERANCE[out.dtype]
    ref64 = ref.detach().double().cpu()
    out64 = out.detach().double().cpu()
    unwritten = int((out64 == poison).sum()) if poison is not None else 0
    finite_ref = torch.isfinite(ref64)
    nonfinite = int((~torch.isfinite(out64) & finite_ref).sum())
    diff = (out64 - ref64).abs()
    diff = torch.where(finite_ref, diff, torch.zeros_like(diff)).nan_to_num(nan=float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_norm = float(ref64[finite_ref].norm())
    err_norm = float(diff[torch.isfinite(diff)].norm()) if torch.isfinite(diff).any() else float("inf")
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else err_norm
    if nonfinite or unwritten:
        rel_l2 = float("inf")
    yard = (yardstick.detach().double().cpu() - ref64).abs()
    yard = torch.where(finite_ref, yard, torch.zeros_like(yard)).nan_to_num(nan=0.0, posinf=0.0)
    yard_max = float(yard.max()) if yard.numel() else 0.0
    ref_max = float(ref64[finite_ref].abs().max()) if finite_ref.any() else 0.0
    bound = FACTOR * yard_max + tol.atol * max(1.0, ref_max)
    passed = not nonfinite and not unwritten and max_abs <= bound and rel_l2 <= tol.max_rel_l2
    first_bad = None
    if not passed and diff.numel():
        first_bad = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
    return Comparison(name, max_abs, rel_l2, yard_max, bound, nonfinite, unwritten, first_bad, passed)
