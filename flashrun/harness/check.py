"""One kernel on one case: the unit of work of ``flashrun verify``.

A :class:`Job` says everything a check needs (kernel spec, shape, seed, what to check) and
:func:`run_job` performs it in whatever process it lands in - the CLI's own, or a worker of a
scale-out run - so a job and its :class:`CaseResult` are plain, picklable data.

The check: fresh seeded inputs (:mod:`flashrun.harness.inputs`); the kernel gets clones (so it
cannot corrupt what the reference sees) and runs with every fresh floating-point allocation
poisoned, so an element it never writes shows up; :class:`~flashrun.harness.judge.Reference`
judges the output (and, with ``grad``, dq, dk, dv). The first call is timed with compiling
included (``first_call_s``: what was not compiled ahead, :mod:`flashrun.harness.precompile`);
on a GPU the forward is then timed again, compiled (``ms``). The result also says which launch
config each Triton kernel of flashrun's ran and where it came from (``configs``).
"""

from __future__ import annotations

import inspect
import math
import os
import time
import traceback as tb_module
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flashrun.errors import KernelError, is_oom
from flashrun.harness.shapes import Shape
from flashrun.limits import BUILTIN_KERNELS as BUILTIN, DETERMINISTIC_BACKWARD, FP8_DTYPE

POISON = 7168.0  # exact in fp16/bf16/fp32 and far outside any attention output of these inputs
TIMED_MS = 25  # GPU time spent timing each checked kernel (median of the repeats)


@dataclass(frozen=True)
class Job:
    index: int  # position in the run: results are reported in this order
    kernel: str  # flash | minimal | PATH.py:FUNCTION
    case: Shape
    seed: int
    grad: bool
    diagnose: bool
    device: str  # what the plan asked for: auto | cuda | cpu
    launch: Any = "default"  # flash's launch config: "default" or a pinned LaunchConfig
    deterministic: bool | None = DETERMINISTIC_BACKWARD  # which flash backward ([experiment] deterministic)
    bf16_dots_ok: bool = True  # False: this interpreter's bf16 tl.dot is wrong (users' kernels skip)
    estimate_s: float | None = None  # expected interpreter seconds (None on a GPU)

    @property
    def grads(self) -> bool:
        """Whether the gradients are checked: asked for, and the case has a backward."""
        return self.grad and not self.case.forward_only


@dataclass
class CaseResult:
    kernel: str
    case: Shape
    status: str  # pass | fail | error | oom | unsupported | skipped
    checks: list[Any] = field(default_factory=list)  # judge.Comparison
    message: str = ""
    first_call_s: float | None = None  # the checked call(s), compiling included
    ms: float | None = None  # median forward time after it (GPU only)
    logits: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)
    traceback: str | None = None  # the full traceback when the kernel raised (shown with -v)
    index: int = 0
    where: str = ""  # the node and device that ran it (device.where); "" when it never ran
    # launch config of each Triton kernel the call ran, and where it came from (tuning.chosen())
    configs: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = {
            "kernel": self.kernel, "case": asdict(self.case), "label": self.case.label, "status": self.status,
            "message": self.message, "first_call_s": _round(self.first_call_s), "ms": _round(self.ms),
            "notes": self.notes, "logit_range": list(self.logits) if self.logits else None,
            "checks": [c.to_json() for c in self.checks], "where": self.where, "launch_configs": self.configs,
        }
        if self.traceback is not None:
            data["traceback"] = self.traceback
        return data


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def interpreter_seconds(case: Shape, grad: bool) -> float:
    """Expected wall time of ``flash`` on ``case`` through Triton's interpreter.

    Calibrated on a 2-core CPU with triton 3.9 (32x32 tiles): about 5 ms per tile forward
    (a little more past head_dim 128), 5x that with the backward, causal tiles about 0.6x of the
    full count, plus a fixed 0.05 s per call. Other kernels differ, but by tiles just as much."""
    tiles = case.batch_size * case.num_heads * math.ceil(case.seq_len / 32) * math.ceil(case.seq_len_k / 32)
    per_tile = 5e-3 * (1 + max(0, case.head_dim - 128) / 256)
    return 0.05 + tiles * per_tile * (0.6 if case.causal else 1.0) * (5.0 if grad else 1.0)


_kernels: dict[tuple[str, str, bool | None], Any] = {}  # (spec, launch, deterministic) -> Kernel, once per process


def load_kernel(spec: str, launch: Any, deterministic: bool | None = DETERMINISTIC_BACKWARD):
    """``flashrun.kernels.get`` once per process (after the device is selected)."""
    from flashrun import kernels

    key = (spec, repr(launch), deterministic)
    if key not in _kernels:
        _kernels[key] = kernels.get(spec, launch, deterministic)
    return _kernels[key]


def run_job(job: Job) -> CaseResult:
    """Select the device (Triton reads TRITON_INTERPRET when kernels load), load the kernel, check."""
    from flashrun import device as device_mod

    dev = device_mod.select(job.device)
    try:
        kernel = load_kernel(job.kernel, job.launch, job.deterministic)
    except KernelError as exc:
        result = CaseResult(job.kernel, job.case, "error", message=exc.message)
    else:
        result = check_case(kernel, job, dev.torch_device)
    result.index = job.index
    result.where = device_mod.where(dev.kind)
    return result


def check_case(kernel: Any, job: Job, device: str) -> CaseResult:
    """One kernel on one case: forward (and backward) against the reference."""
    import torch

    from flashrun.harness.inputs import from_e4m3, make_inputs
    from flashrun.harness.judge import Reference
    from flashrun.harness.reference import logit_range

    case = job.case
    result = CaseResult(kernel.name, case, "pass")
    fp8, grad = case.dtype == FP8_DTYPE, job.grads
    if case.dtype == "bfloat16" and not job.bf16_dots_ok and kernel.name not in BUILTIN:
        result.status = "skipped"
        result.message = "bfloat16 on this Triton's interpreter: its tl.dot is wrong for bf16; run on a GPU"
        return result
    try:
        inputs = make_inputs(case, job.seed, device)[0]
    except Exception as exc:  # noqa: BLE001 - the case does not fit: say so, go on with the others
        if not is_oom(exc):
            raise
        return _oom(result, device, "the inputs alone")
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.dout
    variant = inputs.variant_args()  # window, softcap, alibi_slopes, cu_seqlens...: what the case needs
    missing = kernel.missing(variant)
    if missing:  # not the kernel's fault that it was not written for this variant: not run, not failed
        result.status = "unsupported" if kernel.name in ("flash", "minimal") else "skipped"
        result.message = (f"{kernel.name} does not take {', '.join(missing)}, which this case needs"
                          + ("" if kernel.name in ("flash", "minimal") else
                             " (add them as keyword arguments with defaults to run such cases)"))
        return result
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    if job.diagnose:  # the range is always shown: "in range" is an answer too
        # packed (total, H, D) -> (1, H, total, D): the range over every pair, across sequences too;
        # a KV cache's over every query and cached slot
        rows = (q.flatten(0, 1), k.flatten(0, 1)) if case.kvcache else (q, k)
        result.logits = logit_range(*((t.transpose(0, 1)[None] for t in rows) if case.varlen or case.kvcache
                                      else rows), sm_scale)
        low, high = result.logits
        saturates = max(abs(low), abs(high)) > 10
        result.notes.append(f"logits q·kᵀ·scale span [{low:.2f}, {high:.2f}]"
                            + (", outside about ±10: softmax saturates" if saturates else ", within ±10"))
    if not kernel.takes_causal:
        result.notes.append("called as (q, k, v): judged against causal="
                            f"{case.causal} and scale 1/sqrt({case.head_dim})")
    if job.grad and case.forward_only:
        result.notes.append("forward only: the fp8 forward has no backward")
    # the kernel works on clones (scales too: an fp8 cache's, which it writes the new keys'); the reference on the originals
    kq, kk, kv = (t.clone().requires_grad_(grad) for t in (q, k, v))
    variant.update({name: value.clone() for name, value in variant.items()
                    if name.endswith(("_scale", "_descale")) and isinstance(value, torch.Tensor)})
    if kernel.configs is not None:
        kernel.configs()  # from here on: what this check's calls choose
    start = time.perf_counter()
    try:
        with _poisoned_allocations():
            out = kernel(kq, kk, kv, causal=case.causal, sm_scale=sm_scale, **variant)
            _sync(device)
        _check_output_shape(out, q, torch.bfloat16 if fp8 else q.dtype)
        grads = None
        if grad:
            if not out.requires_grad:
                result.notes.append("forward only: no gradients to check")
            else:
                with _poisoned_allocations():
                    grads = torch.autograd.grad(out, (kq, kk, kv), do)
                    _sync(device)
    except KernelError as exc:
        result.status = "unsupported"
        result.message = exc.message + (f" ({exc.hint})" if exc.hint else "")
        return result
    except Exception as exc:  # noqa: BLE001 - a kernel that raises fails this case, with its message
        if is_oom(exc):
            return _oom(result, device, "the kernel")
        result.status = "error"
        where = _kernel_frame(exc, kernel)
        result.message = (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                          + (f" (at {where})" if where else ""))
        result.traceback = "".join(tb_module.format_exception(exc))
        return result
    result.first_call_s = time.perf_counter() - start
    if kernel.configs is not None:
        result.configs = kernel.configs()

    if grads is not None:
        for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            if g is None or g.shape != t.shape:
                result.status = "fail"
                result.message = f"{name}: expected shape {tuple(t.shape)}, got {None if g is None else tuple(g.shape)}"
                return result
    try:
        reference = Reference.for_shape(inputs, case, grads=grads is not None)
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        return _oom(result, device, "the reference")
    cache = (kk, kv) if case.kvcache else None
    if cache is not None and inputs.k_scale is not None:  # the slots it appended, as the fp8 cache holds them now
        cache = (from_e4m3(kk, variant["k_scale"], q.dtype), from_e4m3(kv, variant["v_scale"], q.dtype))
    result.checks = reference.judge(out, grads, POISON, cache=cache)
    if inputs.unquantized is not None:  # what fp8 costs, beside the verdict
        result.notes.append(_fp8_cost(kernel, inputs, out, job, device, sm_scale))
    failing = [c for c in result.checks if not c.passed]
    if failing:
        result.status = "fail"
        result.message = "; ".join(c.reason() for c in failing)
    if device == "cuda":
        result.ms = _time_forward(kernel, kq.detach(), kk.detach(), kv.detach(), case.causal, sm_scale, variant)
    return result


OUTLIERS = 1e-3  # the fraction of an e4m3 case's second draw that is ten times larger


def _fp8_cost(kernel: Any, inputs: Any, out: Any, job: Job, device: str, sm_scale: float) -> str:
    """The error against the inputs before they were quantized (not judged: the verdict is on what
    the fp8 tensors hold). An e4m3 case also runs its kernel on a second draw with outliers, where
    one descale per head costs the small values their precision."""
    from flashrun.harness.inputs import make_inputs
    from flashrun.harness.judge import Reference

    def against(drawn: Any, got: Any) -> str:
        exact = replace(drawn, **drawn.unquantized, k_scale=None, v_scale=None, descales=None)
        error = Reference.for_shape(exact, job.case, grads=False).judge(got)[0]
        return f"max error {error.max_abs:.3g}, rel-L2 {error.rel_l2:.3g}"

    if job.case.kvcache:
        return f"e4m3 cache against the unquantized keys (not judged): {against(inputs, out)}"
    spiky = make_inputs(job.case, job.seed, device, outliers=OUTLIERS)[0]
    try:
        with_outliers = against(spiky, kernel(spiky.q, spiky.k, spiky.v, causal=job.case.causal, sm_scale=sm_scale,
                                              **spiky.variant_args()))
    except Exception as exc:  # noqa: BLE001 - a note; the verdict above stands
        with_outliers = f"the kernel raised {type(exc).__name__}"
    return (f"e4m3 inputs against the unquantized ones (not judged): {against(inputs, out)}; with {OUTLIERS:.1%} "
            f"outliers (x10) {with_outliers}")


def _kernel_frame(exc: BaseException, kernel: Any) -> str | None:
    """``path:line in function`` of the innermost frame in the user's kernel file, looking through
    the exceptions it was raised from (Triton's interpreter re-raises a jitted function's error as
    its own): where the user should look. None for flashrun's own kernels or when no frame is there."""
    if kernel.name in BUILTIN:
        return None
    try:
        source = Path(inspect.getsourcefile(kernel.fn) or "").resolve()
    except TypeError:  # a builtin or a callable object without a source file
        return None
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:  # as Python prints them: causes first
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    for error in reversed(chain):
        frames = [f for f in tb_module.extract_tb(error.__traceback__) if Path(f.filename).resolve() == source]
        if frames:
            shown = os.path.relpath(source)
            return f"{source if shown.startswith('..') else shown}:{frames[-1].lineno} in {frames[-1].name}"
    return None


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _oom(result: CaseResult, device: str, what: str) -> CaseResult:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
    result.status = "oom"
    result.message = (f"out of memory ({'GPU' if device == 'cuda' else 'CPU'}) in {what}: reduce batch_size/"
                      "seq_len, or use the tiled kernel (flash)")
    return result


def _time_forward(kernel: Any, q: Any, k: Any, v: Any, causal: bool, sm_scale: float,
                  variant: dict[str, Any]) -> float | None:
    """Median ms of the compiled forward (the first call already compiled it)."""
    from triton.testing import do_bench

    try:
        return float(do_bench(lambda: kernel(q, k, v, causal=causal, sm_scale=sm_scale, **variant), warmup=5,
                              rep=TIMED_MS,
                              return_mode="median"))
    except Exception:  # noqa: BLE001 - timing is extra information; the verdict stands without it
        return None


def _poisoned_allocations():
    """A dispatch mode that fills every fresh floating-point allocation with POISON (an 8-bit
    float's, which cannot hold it, with NaN)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class PoisonEmpty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func.overloadpacket.__name__.startswith(("empty", "new_empty"))
                    and isinstance(out, torch.Tensor) and out.is_floating_point()):
                out.fill_(POISON if out.element_size() > 1 else float("nan"))  # fp8 cannot hold POISON
            return out

    return PoisonEmpty()


def _check_output_shape(out: Any, q: Any, dtype: Any) -> None:
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the kernel returned {type(out).__name__}, expected a tensor")
    if out.shape != q.shape:
        raise ValueError(f"the kernel returned shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"the kernel returned {out.dtype}, expected {dtype}")


def interpreter_bf16_dot_ok() -> bool:
    """Whether this Triton's interpreter computes a bf16 ``tl.dot`` right (3.9's does not)."""
    import torch

    from flashrun.env import smoke

    return smoke.run("cpu", torch.bfloat16).ok
