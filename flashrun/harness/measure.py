"""One provider on one case: check it against the reference, then time each mode.

Order of work for a provider and a case (a *cell* is one mode):

1. ``prepare`` (masks, compiled callables) - a failure makes every cell ``n/a`` with the reason;
2. one forward (and, when a backward mode is asked, one backward) on the first input set,
   compared with the reference - the first try is also how an unsupported shape shows up;
   a wrong provider is flagged and not timed;
3. per mode: peak memory from one untimed call, then the timing.

Timing on a GPU is ``triton.testing.do_bench`` (warm-up, L2 cleared before every call, CUDA
events; median and p20/p80). Backward is timed alone: the forward runs once outside the timed
region and the timed call is ``out.backward(dout, retain_graph=True)``, with the input
gradients reset to ``None`` before each call so nothing accumulates. The forward is timed as in
training (inputs that require grad), the FlashAttention benchmarks' convention.

Inputs are fresh N(0, 1) draws (never zeros: some kernels are faster on zeros). When one input
set fits in L2, several sets are rotated so that no call finds its inputs already cached;
``do_bench`` clears L2 anyway, and rotation also covers the CPU timer, which clears nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from flashrun.errors import GPUFault, KernelError
from flashrun.harness.providers import Attention, Provider, failure_reason
from flashrun.harness.reference import attention_ref
from flashrun.harness.sweep import Case
from flashrun.harness.tolerance import compare

log = logging.getLogger("flashrun.harness.bench")

# Correctness bar, one row per dtype: (atol, rtol) for the output and for the gradients; a
# tensor passes when max|got - ref| <= atol + rtol * max|ref| and it holds no NaN/Inf.
# About 10x the error of PyTorch's own low-precision attention on random inputs (measured
# against float64 for N up to 2048: float16 ~2e-3, bfloat16 ~1.6e-2 on grads near 4): loose
# enough for any correct fused kernel, tight enough that a masking or indexing bug, whose
# errors are of order 0.1 to 1, fails. float32 allows TF32 products (Triton's tl.dot default),
# whose precision is float16's. `flashrun verify` is the thorough check; this is a guard that
# no wrong kernel gets a speed.
ROTATED_SETS = 4  # input sets rotated when one set fits in L2
CPU_CACHE_BYTES = 32 << 20  # nominal last-level cache of a CPU, to decide on rotation
QUANTILES = [0.5, 0.2, 0.8]  # median, p20, p80

# Messages of CUDA errors that poison the context: every later call would fail the same way.
_FATAL = ("illegal memory access", "unspecified launch failure", "device-side assert",
          "misaligned address", "illegal instruction", "uncorrectable ECC")


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # (B, H, Nq, D)
    k: torch.Tensor  # (B, H_kv, Nk, D)
    v: torch.Tensor  # (B, H_kv, Nk, D)
    dout: torch.Tensor  # (B, H, Nq, D), the upstream gradient

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]


def make_inputs(case: Case, device: torch.device, seed: int) -> list[Inputs]:
    """Fresh random input sets for ``case``: several when one set fits in the cache."""
    dtype = getattr(torch, case.dtype)
    q_shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    kv_shape = (case.batch, case.kv_heads, case.seq_len_k, case.head_dim)
    size = dtype.itemsize * 2 * (math.prod(q_shape) + math.prod(kv_shape))
    n_sets = ROTATED_SETS if size < _cache_bytes(device) else 1
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(shape: tuple[int, ...], grad: bool) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    return [Inputs(draw(q_shape, True), draw(kv_shape, True), draw(kv_shape, True), draw(q_shape, False))
            for _ in range(n_sets)]


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return CPU_CACHE_BYTES


def reset_grads(sets: list[Inputs]) -> None:
    for inputs in sets:
        for leaf in inputs.leaves():
            leaf.grad = None


# -- the reference, on a slice ---------------------------------------------------------------------
class Reference:
    """The reference for a slice of the case, computed once per case.

    The slice: batch elements {0, B-1} (a stride bug shows past the first element), kv heads
    {0, H_kv-1} with every query head they serve (so dk/dv are complete sums). It is computed
    one (batch element, query head) at a time, float64 on the CPU and float32 on a GPU (as
    :func:`~flashrun.harness.reference.attention_ref`), so its memory is one Nq x Nk score matrix
    whatever the batch and head count - a few GiB at N = 16384, instead of hundreds.
    ``grads``: also the gradients for ``inputs.dout`` (only when a backward mode is asked).
    """

    def __init__(self, inputs: Inputs, case: Case, grads: bool) -> None:
        self.case = case
        device = inputs.q.device
        self._batches = sorted({0, case.batch - 1})
        self._kv_heads = sorted({0, case.kv_heads - 1})
        heads = [j * case.group + t for j in self._kv_heads for t in range(case.group)]
        self._batch_idx = torch.tensor(self._batches, device=device)
        self._head_idx = torch.tensor(heads, device=device)
        self._kv_idx = torch.tensor(self._kv_heads, device=device)
        self.out, self.grads = self._compute(inputs, grads, upcast=True)
        # PyTorch's same maths in the inputs' dtype: the yardstick of flashrun.harness.tolerance
        self.yard_out, self.yard_grads = self._compute(inputs, grads, upcast=False)

    def slice_q(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, Nq, D) -> the checked (batch, query head) pairs."""
        return t.detach().index_select(0, self._batch_idx).index_select(1, self._head_idx)

    def slice_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().index_select(0, self._batch_idx).index_select(1, self._kv_idx)

    def _compute(self, inputs: Inputs, grads: bool, upcast: bool
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        q, k, v, dout = (t.detach() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
        dtype = q.dtype if not upcast else torch.float64 if q.device.type == "cpu" else torch.float32
        group = self.case.group

        def leaf(t: torch.Tensor) -> torch.Tensor:  # (N, D) -> (1, 1, N, D), a high-precision copy
            return t[None, None].to(dtype, copy=True).requires_grad_(grads)

        outs, dqs, dks, dvs = [], [], [], []  # flat, in slice order: batch element, then head
        for b in self._batches:
            for j in self._kv_heads:
                kj, vj = leaf(k[b, j]), leaf(v[b, j])
                dk_j, dv_j = torch.zeros_like(kj[0, 0]), torch.zeros_like(vj[0, 0])
                for h in range(j * group, (j + 1) * group):
                    qh = leaf(q[b, h])
                    with torch.set_grad_enabled(grads):
                        o = attention_ref(qh, kj, vj, causal=self.case.causal, upcast=upcast)
                    outs.append(o.detach()[0, 0])
                    if grads:
                        gq, gk, gv = torch.autograd.grad(o, (qh, kj, vj), dout[b, h][None, None].to(dtype))
                        dqs.append(gq[0, 0])
                        dk_j += gk[0, 0]  # a kv head's gradient sums over the query heads it serves
                        dv_j += gv[0, 0]
                dks.append(dk_j)
                dvs.append(dv_j)

        def shaped(parts: list[torch.Tensor]) -> torch.Tensor:  # -> (checked batches, checked heads, N, D)
            return torch.stack(parts).unflatten(0, (len(self._batches), -1))

        if not grads:
            return shaped(outs), None
        return shaped(outs), (shaped(dqs), shaped(dks), shaped(dvs))


# -- verdicts -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    status: str  # ok | wrong | n/a | OOM
    note: str = ""
    max_err: float | None = None


@dataclass(frozen=True)
class Cell:
    """The outcome of one provider on one case in one mode."""

    mode: str
    status: str  # ok | wrong | n/a | OOM
    correct: bool | None  # None: never checked (it could not run)
    ms: tuple[float, float, float] | None = None  # median, p20, p80
    peak_mem_mb: float | None = None
    max_err: float | None = None
    note: str = ""
    setup_s: float | None = None  # prepare + the checked first call: compiling and autotuning show here


def _judge(checks: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> Verdict:
    """(name, result slice, reference, yardstick) by flashrun.harness.tolerance, the policy verify uses."""
    worst = 0.0
    for name, got, ref, yard in checks:
        result = compare(name, got, ref, yard)
        worst = max(worst, result.max_abs)
        if not result.passed:
            return Verdict("wrong", result.reason(), worst)
    return Verdict("ok", max_err=worst)


def is_oom(exc: BaseException) -> bool:
    """PyTorch's OOM error, or an OOM reported by a library as a RuntimeError (cuDNN, Triton)."""
    text = str(exc)
    return (isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in text.lower()
            or "can't allocate memory" in text)


def _failure(name: str, case: Case, exc: BaseException, caught: list[warnings.WarningMessage]) -> Verdict:
    """What a failed call means for the cell: OOM, n/a with the reason, or a broken GPU."""
    text = str(exc)
    if is_oom(exc):
        return Verdict("OOM", "out of memory")
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _FATAL):
        raise GPUFault(
            f"{name} on {case.label()} left the GPU unusable: {failure_reason(name, exc, caught)}",
            hint="the rows measured before it are written; run `flashrun verify` on this kernel and shape",
        ) from None
    if isinstance(exc, KernelError):
        return Verdict("n/a", exc.message)
    return Verdict("n/a", failure_reason(name, exc, caught))


def check(provider: Provider, attn: Attention, case: Case, inputs: Inputs, ref: Reference, grads: bool,
          caught: list[warnings.WarningMessage]) -> tuple[Verdict, Verdict | None]:
    """(forward verdict, backward verdict or None when not asked). The backward verdict also
    covers the forward output: gradients of a wrong forward are wrong too."""
    q, k, v = inputs.leaves()
    reset_grads([inputs])
    start = len(caught)
    try:
        out = attn.fn(q, k, v)
    except Exception as exc:  # noqa: BLE001 - any failure of the first try is a verdict
        verdict = _failure(provider.name, case, exc, caught[start:])
        return verdict, verdict
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.device != q.device:
        got = (f"a tensor of shape {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        verdict = Verdict("wrong", f"returned {got}, expected a tensor of shape {tuple(q.shape)} on {q.device}")
        return verdict, verdict
    out_check = ("out", ref.slice_q(out), ref.out, ref.yard_out)
    forward = _judge([out_check])
    if not grads:
        return forward, None
    if out.grad_fn is None:
        return forward, Verdict("n/a", "the output carries no gradient: this provider has no backward")
    start = len(caught)
    try:
        out.backward(inputs.dout)
        if any(leaf.grad is None for leaf in (q, k, v)):
            return forward, Verdict("wrong", "the backward left a gradient of q, k or v unset")
        assert ref.grads is not None, "the bench computes reference gradients when a backward mode is asked"
        assert ref.yard_grads is not None
        return forward, _judge([
            out_check,
            *((name, slice_(leaf.grad), want, yard) for name, slice_, leaf, want, yard in zip(
                ("dq", "dk", "dv"), (ref.slice_q, ref.slice_kv, ref.slice_kv), (q, k, v), ref.grads, ref.yard_grads)),
        ])
    except Exception as exc:  # noqa: BLE001
        return forward, _failure(provider.name, case, exc, caught[start:])
    finally:
        reset_grads([inputs])


# -- timing ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    warmup_ms: int
    rep_ms: int


def time_call(fn: Callable[[], object], device: torch.device, timing: Timing,
              grad_to_none: list[torch.Tensor] | None = None) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn()``."""
    if device.type == "cuda":
        from triton.testing import do_bench

        got = do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, grad_to_none=grad_to_none,
                       quantiles=QUANTILES)
        # triton 3.x returns a list for several quantiles (a bare float for one)
        values = [float(x) for x in got] if isinstance(got, (list, tuple)) else [float(got)] * 3
        return values[0], values[1], values[2]
    return _cpu_bench(fn, timing, grad_to_none)


def _cpu_bench(fn: Callable[[], object], timing: Timing,
               grad_to_none: list[torch.Tensor] | None) -> tuple[float, float, float]:
    """do_bench's recipe with a wall clock: estimate, warm up for warmup_ms, repeat for rep_ms."""

    def once() -> float:
        for leaf in grad_to_none or ():
            leaf.grad = None
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    once()
    estimate = max(statistics.median(once() for _ in range(5)), 1e-3)
    for _ in range(max(1, int(timing.warmup_ms / estimate))):
        once()
    times = sorted(once() for _ in range(max(1, int(timing.rep_ms / estimate))))

    def quantile(p: float) -> float:  # linear interpolation, as torch.quantile and triton
        pos = p * (len(times) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(times) - 1)
        return times[lo] + (times[hi] - times[lo]) * (pos - lo)

    values = [quantile(p) for p in QUANTILES]
    return values[0], values[1], values[2]


def _timed_call(attn: Attention, sets: list[Inputs], mode: str
                ) -> tuple[Callable[[], object], list[torch.Tensor] | None]:
    """The zero-argument callable timed for ``mode``, rotating the input sets, and the
    tensors whose .grad is reset before each call."""
    if mode == "fwd":
        calls = [lambda s=s: attn.fn(s.q, s.k, s.v) for s in sets]
    elif mode == "bwd":
        outs = [attn.fn(s.q, s.k, s.v) for s in sets]  # forward once, outside the timed region
        calls = [lambda o=o, s=s: o.backward(s.dout, retain_graph=True) for o, s in zip(outs, sets)]
    else:  # fwd_bwd
        calls = [lambda s=s: attn.fn(s.q, s.k, s.v).backward(s.dout) for s in sets]
    leaves = None if mode == "fwd" else [t for s in sets for t in s.leaves()]
    if len(calls) == 1:
        return calls[0], leaves
    rotation = itertools.cycle(calls)
    return lambda: next(rotation)(), leaves


def _peak_mem_mb(attn: Attention, inputs: Inputs, mode: str, device: torch.device) -> float | None:
    """Memory allocated above the inputs during one call (forward and backward for the
    backward modes: the saved activations are part of the cost). GPU only."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = attn.fn(inputs.q, inputs.k, inputs.v)
    if mode != "fwd":
        out.backward(inputs.dout)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    reset_grads([inputs])
    return peak / 2**20


def _time_mode(provider: Provider, attn: Attention, case: Case, sets: list[Inputs], mode: str, verdict: Verdict,
               device: torch.device, timing: Timing, caught: list[warnings.WarningMessage]) -> Cell:
    start = len(caught)
    try:
        peak = _peak_mem_mb(attn, sets[0], mode, device)
        fn, leaves = _timed_call(attn, sets, mode)
        ms = time_call(fn, device, timing, leaves)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM with the rotated sets: the cell says so
        failed = _failure(provider.name, case, exc, caught[start:])
        return Cell(mode, failed.status, True, max_err=verdict.max_err, note=_join(attn.note, failed.note))
    finally:
        reset_grads(sets)
    return Cell(mode, "ok", True, ms, peak, verdict.max_err, attn.note)


def measure(provider: Provider, case: Case, sets: list[Inputs], ref: Reference, modes: list[str],
            device: torch.device, timing: Timing) -> list[Cell]:
    """Every mode of ``provider`` on ``case``: checked first, then timed (see module doc)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        try:
            attn = provider.prepare(case, device)
        except Exception as exc:  # noqa: BLE001
            verdict = _failure(provider.name, case, exc, caught)
            return [Cell(mode, verdict.status, None, note=verdict.note) for mode in modes]
        backward_asked = any(mode != "fwd" for mode in modes)
        with attn.scope():
            try:
                forward, backward = check(provider, attn, case, sets[0], ref, backward_asked and provider.backward,
                                          caught)
            except GPUFault:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. judging a strange output: this cell, not the run
                forward = backward = Verdict("n/a", f"could not check this provider: {type(exc).__name__}: {exc}")
            setup_s = time.perf_counter() - started  # the check ends on .item(): the GPU is done
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
                    cell = _time_mode(provider, attn, case, sets, mode, verdict, device, timing, caught)
                cells.append(dataclasses.replace(cell, setup_s=setup_s))
    for message in caught:
        log.debug("%s on %s: %s", provider.name, case.label(), message.message)
    return cells


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def free_memory(device: torch.device) -> None:
    """After an OOM (or between shapes): drop what the failed call left, give the cache back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_ceiling(device: torch.device, timing: Timing) -> float | None:
    """TFLOP/s of a bf16 8192x8192x8192 matrix product on this GPU now: the % of peak bar."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    median = time_call(lambda: torch.matmul(a, b), device, timing)[0]
    return 2 * n**3 / median / 1e9  # 2 FLOPs per multiply-add; ms -> TFLOP/s
