"""One provider on one case: check it against the reference, then time each mode.

Order of work for a provider and a case (a *cell* is one mode):

1. ``prepare`` (masks, compiled callables) - a failure makes every cell ``n/a`` with the reason;
2. one forward (and, when a backward mode is asked, one backward) on the first input set,
   compared with the reference - the first try is also how an unsupported shape shows up;
   a wrong provider is flagged and not timed;
3. per mode: peak memory from one untimed call, then the timing, once every kernel still
   compiling in the background is ready (a first call compiles its backward while the forward
   runs: :func:`flashrun.kernels.warmup.settle`);
4. with ``--metrics``, after each mode's timing, what its call does on the GPU
   (:meth:`flashrun.harness.probe.Probe.gather`): outside the timed loop, so the timed numbers
   are those of a run without it.

Timing on a GPU is ``triton.testing.do_bench``'s recipe (warm-up, L2 emptied before every call
as ``[bench] l2_flush`` says, CUDA events; median and p20/p80). Backward is timed alone: the
forward runs once outside the timed region and the timed call is ``out.backward(dout,
retain_graph=True)``, with the input gradients reset to ``None`` before each call so nothing
accumulates. The forward is timed as in
training (inputs that require grad), the FlashAttention benchmarks' convention, except for
decode-like shapes (fewer queries than keys, ``--seq-lens-k``): those are inference, timed under
``torch.no_grad()`` as a generation loop calls them (:func:`inference`).

Inputs are fresh N(0, 1) draws (never zeros: some kernels are faster on zeros). When one input
set fits in L2, several sets are rotated so that no call finds its inputs already cached;
the GPU timing empties L2 anyway, and rotation also covers the CPU timer, which clears nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch

from flashrun.errors import GPUFault, KernelError, is_oom
from flashrun.harness.inputs import Inputs, make_inputs
from flashrun.harness.judge import Comparison, Reference
from flashrun.harness.provider import Attention, Provider
from flashrun.harness.providers import failure_reason
from flashrun.harness.shapes import Shape

if TYPE_CHECKING:
    from flashrun.harness.metrics import CallMetrics, Ceilings
    from flashrun.harness.probe import Probe

log = logging.getLogger("flashrun.harness.bench")

ROTATED_SETS = 4  # input sets rotated when one set fits in L2
CPU_CACHE_BYTES = 32 << 20  # nominal last-level cache of a CPU, to decide on rotation
QUANTILES = [0.5, 0.2, 0.8]  # median, p20, p80

# Messages of CUDA errors that poison the context: every later call would fail the same way.
_FATAL = ("illegal memory access", "unspecified launch failure", "device-side assert",
          "misaligned address", "illegal instruction", "uncorrectable ECC")


def make_sets(shape: Shape, device: torch.device, seed: int) -> list[Inputs]:
    """The input sets timed for ``shape`` (leaves that require grad): several, rotated, when one
    set fits in the cache. The first set is what ``flashrun verify`` draws with the same seed."""
    size = getattr(torch, shape.dtype).itemsize * 2 * shape.batch_size * shape.head_dim * (
        shape.num_heads * shape.seq_len + shape.num_kv_heads * shape.seq_len_k)
    n_sets = ROTATED_SETS if size < _cache_bytes(device) else 1
    return make_inputs(shape, seed, device, sets=n_sets, requires_grad=True)


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return CPU_CACHE_BYTES


def reset_grads(sets: list[Inputs]) -> None:
    for inputs in sets:
        for leaf in inputs.leaves():
            leaf.grad = None


# -- verdicts -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    status: str  # ok | wrong | n/a | OOM
    note: str = ""
    max_err: float | None = None


@dataclass(frozen=True)
class Cell:
    """The outcome of one provider on one shape in one mode."""

    mode: str
    status: str  # ok | wrong | n/a | OOM
    correct: bool | None  # None: never checked (it could not run)
    ms: tuple[float, float, float] | None = None  # median, p20, p80
    peak_mem_mb: float | None = None
    max_err: float | None = None
    note: str = ""
    setup_s: float | None = None  # prepare + the checked first call: compiling and autotuning show here
    path: str = ""  # which implementation of the provider ran its forward (flash: gluon-sm90 or triton)
    metrics: CallMetrics | None = None  # --metrics: read after the timing (harness.probe)
    config: str = ""  # the launch config of each of its Triton kernels and where it came from (ours)


def _verdict(checks: list[Comparison]) -> Verdict:
    """The cell's verdict from the judge's comparisons: the first failing tensor says why."""
    worst = max(c.max_abs for c in checks)
    failing = next((c for c in checks if not c.passed), None)
    return Verdict("wrong", failing.reason(), worst) if failing else Verdict("ok", max_err=worst)


def _failure(name: str, shape: Shape, exc: BaseException, caught: list[warnings.WarningMessage]) -> Verdict:
    """What a failed call means for the cell: OOM, n/a with the reason, or a broken GPU."""
    if is_oom(exc):
        return Verdict("OOM", "out of memory")
    _stop_if_fatal(name, shape, exc, caught)
    if isinstance(exc, KernelError):
        return Verdict("n/a", exc.message)
    return Verdict("n/a", failure_reason(name, exc, caught))


def _stop_if_fatal(name: str, shape: Shape, exc: BaseException, caught: list[warnings.WarningMessage]) -> None:
    """A CUDA error that poisons the context ends the run: nothing after it could be trusted."""
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _FATAL):
        raise GPUFault(
            f"{name} on {shape.label} left the GPU unusable: {failure_reason(name, exc, caught)}",
            hint="the rows measured before it are written; run `flashrun verify` on this kernel and shape",
        ) from None


def check(provider: Provider, attn: Attention, shape: Shape, inputs: Inputs, ref: Reference, grads: bool,
          caught: list[warnings.WarningMessage]) -> tuple[Verdict, Verdict | None]:
    """(forward verdict, backward verdict or None when not asked). The backward verdict also
    covers the forward output: gradients of a wrong forward are wrong too."""
    q, k, v = inputs.leaves()
    reset_grads([inputs])
    start = len(caught)
    try:
        out = attn.fn(q, k, v, **inputs.per_set())
    except Exception as exc:  # noqa: BLE001 - any failure of the first try is a verdict
        verdict = _failure(provider.name, shape, exc, caught[start:])
        return verdict, verdict
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.device != q.device:
        got = (f"a tensor of shape {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        verdict = Verdict("wrong", f"returned {got}, expected a tensor of shape {tuple(q.shape)} on {q.device}")
        return verdict, verdict
    forward = _verdict((attn.reference(inputs) if attn.reference is not None else ref).judge(out))
    if not grads:
        return forward, None
    if out.grad_fn is None:
        return forward, Verdict("n/a", "the output carries no gradient: this provider has no backward")
    start = len(caught)
    try:
        out.backward(inputs.dout)
        if any(leaf.grad is None for leaf in (q, k, v)):
            return forward, Verdict("wrong", "the backward left a gradient of q, k or v unset")
        return forward, _verdict(ref.judge(out, (q.grad, k.grad, v.grad)))
    except Exception as exc:  # noqa: BLE001
        return forward, _failure(provider.name, shape, exc, caught[start:])
    finally:
        reset_grads([inputs])


# -- timing ----------------------------------------------------------------------------------------------
FLUSH_BYTES = 256 << 20  # the buffer triton.testing.do_bench zeroes before each call: 5x an H100's L2


@dataclass(frozen=True)
class Timing:
    warmup_ms: int
    rep_ms: int
    l2_flush: Literal["write", "read"] = "write"  # how L2 is emptied before each timed GPU call


def time_call(fn: Callable[[], object], device: torch.device, timing: Timing,
              grad_to_none: list[torch.Tensor] | None = None) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn()``, by ``triton.testing.do_bench``'s recipe: an
    estimate from five calls, warm-up calls for ``warmup_ms``, timed calls for ``rep_ms``; on a
    GPU each timed call after an L2 flush, between CUDA events read once at the end, on a CPU by
    the wall clock."""
    times = sorted(_gpu_times(fn, device, timing, grad_to_none) if device.type == "cuda"
                   else _cpu_times(fn, timing, grad_to_none))

    def quantile(p: float) -> float:  # linear interpolation, as torch.quantile and triton
        pos = p * (len(times) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(times) - 1)
        return times[lo] + (times[hi] - times[lo]) * (pos - lo)

    values = [quantile(p) for p in QUANTILES]
    return values[0], values[1], values[2]


def _counts(estimate_ms: float, timing: Timing) -> tuple[int, int]:
    """do_bench's warm-up and timed calls for a call of about ``estimate_ms``."""
    estimate_ms = max(estimate_ms, 1e-3)
    return max(1, int(timing.warmup_ms / estimate_ms)), max(1, int(timing.rep_ms / estimate_ms))


def _l2_flush(device: torch.device, how: str) -> Callable[[], object]:
    """What empties L2 before a timed call. ``write`` zeroes FLUSH_BYTES (do_bench's way): the
    timed call then finds up to an L2 of dirty lines that it writes back to memory as its own
    reads evict them, a constant in every provider's time that weighs most on short calls.
    ``read`` reads FLUSH_BYTES instead: an L2 that holds no input and nothing to write back."""
    buffer = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return buffer.zero_ if how == "write" else buffer.amax


def _gpu_times(fn: Callable[[], object], device: torch.device, timing: Timing,
               grad_to_none: list[torch.Tensor] | None) -> list[float]:
    flush = _l2_flush(device, timing.l2_flush)
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    warmup, repeat = _counts(start.elapsed_time(end) / 5, timing)
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        for leaf in grad_to_none or ():  # nothing accumulates into the inputs' gradients
            leaf.grad = None
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _cpu_times(fn: Callable[[], object], timing: Timing,
               grad_to_none: list[torch.Tensor] | None) -> list[float]:

    def once() -> float:
        for leaf in grad_to_none or ():
            leaf.grad = None
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    once()
    warmup, repeat = _counts(statistics.median(once() for _ in range(5)), timing)
    for _ in range(warmup):
        once()
    return [once() for _ in range(repeat)]


def inference(shape: Shape, mode: str) -> bool:
    """Whether ``mode`` on ``shape`` is timed without autograd: the forward of a decode-like
    shape (fewer queries than keys). With inputs that require grad, a Python autograd.Function's
    own host time (flash: ~25 us a call against ~12 on a 2-core CPU) would be timed into calls
    whose kernels take ~15-80 us, which a generation loop never pays (NOTES v21)."""
    return mode == "fwd" and shape.seq_len < shape.seq_len_k


def _forward(attn: Attention, s: Inputs, grad: bool) -> object:
    if grad:
        return attn.fn(s.q, s.k, s.v, **s.per_set())
    with torch.no_grad():
        return attn.fn(s.q, s.k, s.v, **s.per_set())


def _timed_call(attn: Attention, sets: list[Inputs], mode: str, grad: bool = True
                ) -> tuple[Callable[[], object], list[torch.Tensor] | None]:
    """The zero-argument callable timed for ``mode``, rotating the input sets, and the
    tensors whose .grad is reset before each call; ``grad=False``: the forward under no_grad
    (:func:`inference`)."""
    if mode == "fwd":
        calls = [lambda s=s: _forward(attn, s, grad) for s in sets]
    elif mode == "bwd":
        outs = [attn.fn(s.q, s.k, s.v, **s.per_set()) for s in sets]  # forward once, outside the timed region
        calls = [lambda o=o, s=s: o.backward(s.dout, retain_graph=True) for o, s in zip(outs, sets)]
    else:  # fwd_bwd
        calls = [lambda s=s: attn.fn(s.q, s.k, s.v, **s.per_set()).backward(s.dout) for s in sets]
    leaves = None if mode == "fwd" else [t for s in sets for t in s.leaves()]
    if len(calls) == 1:
        return calls[0], leaves
    rotation = itertools.cycle(calls)
    return lambda: next(rotation)(), leaves


def _peak_mem_mb(attn: Attention, inputs: Inputs, mode: str, device: torch.device, grad: bool = True
                 ) -> float | None:
    """Memory allocated above the inputs during one call (forward and backward for the
    backward modes: the saved activations are part of the cost). GPU only."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = _forward(attn, inputs, grad)
    if mode != "fwd":
        out.backward(inputs.dout)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    reset_grads([inputs])
    return peak / 2**20


def _time_mode(provider: Provider, attn: Attention, shape: Shape, sets: list[Inputs], mode: str, verdict: Verdict,
               device: torch.device, timing: Timing, caught: list[warnings.WarningMessage],
               probe: Probe | None) -> Cell:
    start = len(caught)
    try:
        grad = not inference(shape, mode)
        peak = _peak_mem_mb(attn, sets[0], mode, device, grad)
        _settle()
        fn, leaves = _timed_call(attn, sets, mode, grad)
        ms = time_call(fn, device, timing, leaves)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM with the rotated sets: the cell says so
        failed = _failure(provider.name, shape, exc, caught[start:])
        return Cell(mode, failed.status, True, max_err=verdict.max_err, note=_join(attn.note, failed.note))
    finally:
        reset_grads(sets)
    metrics, note = None, attn.note
    if probe is not None:  # after the timing: nothing of it is in the timed numbers
        try:
            metrics = probe.gather(fn, leaves, f"{provider.name}-{mode}", ms[0])
            note = _join(note, metrics.note)
        except Exception as exc:  # noqa: BLE001 - the timing stands; the row says what is missing
            _stop_if_fatal(provider.name, shape, exc, caught[start:])
            note = _join(note, f"metrics: {type(exc).__name__}: {exc}")
        finally:
            reset_grads(sets)
    return Cell(mode, "ok", True, ms, peak, verdict.max_err, note, metrics=metrics)


def _settle() -> None:
    """Wait for our kernels still compiling in the background (none unless flashrun's kernels are loaded)."""
    warmup = sys.modules.get("flashrun.kernels.warmup")
    if warmup is not None:
        waited = warmup.settle()
        if waited > 0.01:
            log.debug("waited %.2f s for kernels compiling in the background before timing", waited)


def measure(provider: Provider, shape: Shape, sets: list[Inputs], ref: Reference, modes: list[str],
            device: torch.device, timing: Timing, probe: Probe | None = None) -> list[Cell]:
    """Every mode of ``provider`` on ``shape``: checked first, then timed (see module doc); with a
    ``probe`` (``--metrics``), each timed mode's call is then profiled."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        try:
            attn = provider.prepare(shape, device)
        except Exception as exc:  # noqa: BLE001
            verdict = _failure(provider.name, shape, exc, caught)
            return [Cell(mode, verdict.status, None, note=verdict.note) for mode in modes]
        backward_asked = any(mode != "fwd" for mode in modes)
        if attn.configs is not None:
            attn.configs()  # from here on: what the checked calls choose
        with attn.scope():
            try:
                forward, backward = check(provider, attn, shape, sets[0], ref, backward_asked and provider.backward,
                                          caught)
            except GPUFault:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. judging a strange output: this cell, not the run
                forward = backward = Verdict("n/a", f"could not check this provider: {type(exc).__name__}: {exc}")
            setup_s = time.perf_counter() - started  # the check ends on .item(): the GPU is done
            path = (attn.path() or "") if attn.path else ""
            backward_path = (attn.backward_path() or "") if attn.backward_path and backward_asked else ""
            config = _config_text(attn.configs()) if attn.configs else ""
            if backward_asked and not provider.backward:
                backward = Verdict("n/a", f"{provider.name} has no backward")
            cells = []
            for mode in modes:
                verdict = forward if mode == "fwd" else backward
                if verdict.status != "ok":
                    correct = False if verdict.status == "wrong" else None
                    cell = Cell(mode, verdict.status, correct, max_err=verdict.max_err,
                                note=_join(attn.note, verdict.note))
                else:
                    cell = _time_mode(provider, attn, shape, sets, mode, verdict, device, timing, caught, probe)
                cells.append(dataclasses.replace(cell, setup_s=setup_s, config=config,
                                                 path=path if mode == "fwd" else backward_path or path))
    for message in caught:
        log.debug("%s on %s: %s", provider.name, shape.label, message.message)
    return cells


def _config_text(configs: dict[str, dict[str, str]]) -> str:
    """``fwd 128x64 w4 s3 (table); bwd_dkdv 32x128 w4 s3 (heuristic)``."""
    return "; ".join(f"{kind} {c['config']} ({c['source']})" for kind, c in configs.items())


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def free_memory(device: torch.device) -> None:
    """After an OOM (or between shapes): drop what the failed call left, give the cache back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ceilings(device: torch.device, timing: Timing) -> Ceilings:
    """This GPU's roofs now (None on the CPU): the TFLOP/s of a bf16 8192x8192x8192 matrix product
    (the % of peak bar); the GB/s of a device-to-device copy of 512 MiB, far more than L2 holds
    (the HBM bar of memory-bound shapes: read once, written once); and, where the GPU has fp8
    tensor cores (sm_89 and later), the TFLOP/s of the same product in e4m3 (``torch._scaled_mm``,
    one scale each, fast accumulation as ``tl.dot``'s fp8 default), the bar of fp8 providers."""
    from flashrun.harness.metrics import Ceilings

    if device.type != "cuda":
        return Ceilings(None, None)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    median = time_call(lambda: torch.matmul(a, b), device, timing)[0]
    tflops = 2 * n**3 / median / 1e9  # 2 FLOPs per multiply-add; ms -> TFLOP/s
    fp8_tflops = None
    if torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b8 column-major, as it must be
        one = torch.ones((), device=device, dtype=torch.float32)
        median = time_call(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
                           device, timing)[0]
        fp8_tflops = 2 * n**3 / median / 1e9
        del a8, b8
    del a, b
    size = 512 << 20
    src = torch.empty(size, device=device, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    median = time_call(lambda: dst.copy_(src), device, timing)[0]
    return Ceilings(tflops, 2 * size / median / 1e6, fp8_tflops)  # bytes per ms -> GB/s
