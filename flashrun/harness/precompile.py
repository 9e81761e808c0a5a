"""Compile every kernel a run will launch before its cases need them, all at once.

verify and bench know their cases before they run them. For each case one of flashrun's own
kernels (flash, flash-atomic, flash-deterministic, minimal) will run, the kernel is called as
the run will call it - the same seeded inputs (so the same shapes, strides and alignment), the
same variant arguments and launch configs, forward and, where gradients are checked or timed,
backward - inside a compile-only :class:`~flashrun.kernels.warmup.Batch`: no kernel runs, every
launch is handed to the compile pool (one process per core), and each distinct specialization
(Triton's own key) compiles once however many cases share it. Then:

* verify in this process starts each check as soon as its own kernels are ready
  (:meth:`Ahead.run`) while the others still compile; the time a check waits for them is not
  part of its ``first s``;
* bench, and verify on Ray, wait for all of them first: timings should not share the CPU with
  compilers, and Ray workers on this host then load each kernel from Triton's cache (the
  driver's ``TRITON_CACHE_DIR`` is passed to them, :mod:`.cluster`) instead of compiling it
  once per worker. Workers on other hosts compile their own, as before.

The step is reported apart from the run (:class:`Compiled`: kernels, workers, seconds, and how
long the run waited). Users' kernels compile on their first call, as before: their launches
cannot be listed. Through Triton's interpreter nothing compiles, and the step is skipped. A case
whose launches cannot be listed (it raises, it does not fit in memory) is left to its run, which
reports it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from flashrun.limits import BUILTIN_KERNELS

if TYPE_CHECKING:
    from rich.console import Console

    from flashrun.harness.check import CaseResult, Job
    from flashrun.kernels.warmup import Batch, Compile

log = logging.getLogger("flashrun.precompile")

# progress(kernels ready, kernels to compile, threads): the caller's progress bar
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Compiled:
    """The compile step of a run, as reports show it."""

    kernels: int  # distinct specializations compiled (or loaded from Triton's disk cache) ahead
    workers: int  # kernels compiling at once
    pool: str  # "processes" (flashrun's kernels) or "threads" (FLASHRUN_COMPILE_PROCESSES=0)
    seconds: float  # from the start of the step until its last kernel was ready
    waited_s: float  # how long the run waited for them (less than seconds when checks ran meanwhile)
    cases: int  # the cases whose launches were listed

    def to_json(self) -> dict[str, Any]:
        return {"kernels": self.kernels, "workers": self.workers, "pool": self.pool, "seconds": round(self.seconds, 3),
                "waited_s": round(self.waited_s, 3), "cases": self.cases}

    def line(self) -> str:
        """One sentence for a table's footer."""
        text = (f"compiled {self.kernels} kernel{'s' if self.kernels != 1 else ''} ahead in {self.seconds:.1f} s "
                f"in {self.workers} {self.pool} (Triton's cache first)")
        if self.waited_s < self.seconds - 0.05:
            text += f"; the run waited {self.waited_s:.1f} s for them, the rest overlapped it"
        return text


class Ahead:
    """A run's compile step: which kernels each unit of work (a verify job, a bench shape) needs,
    and how long the run waited for them."""

    def __init__(self, batch: Batch | None, needs: dict[int, list[Compile]], cases: int) -> None:
        self.batch = batch
        self.needs = needs  # unit index -> its kernels
        self.cases = cases
        self.waited_s = 0.0
        self.all_ready = False  # wait() for every unit has returned

    @property
    def active(self) -> bool:
        return self.batch is not None and bool(self.batch.kernels)

    def wait(self, index: int | None = None) -> None:
        """Until the kernels of unit ``index`` (None: every unit) are ready."""
        if self.batch is None:
            return
        kernels = list(self.batch.kernels.values()) if index is None else self.needs.get(index, [])
        self.waited_s += self.batch.wait(kernels)
        self.all_ready = self.all_ready or index is None

    def run(self, run_job: Callable[[Job], CaseResult]) -> Callable[[Job], CaseResult]:
        """``run_job`` that first waits for the job's own kernels (``run_job`` itself when all are
        ready: a Ray pool ships it to its workers, which have no batch to wait for)."""
        if not self.active or self.all_ready:
            return run_job

        def run(job: Job) -> CaseResult:
            self.wait(job.index)
            return run_job(job)

        return run

    def cancel(self) -> None:
        """Ctrl-C: drop the compiles that have not started (those running finish in the background)."""
        if self.batch is not None:
            for compile_ in self.batch.kernels.values():
                future = getattr(compile_.handle, "future", None)
                if future is not None:
                    future.cancel()

    def close(self) -> Compiled | None:
        """Leave the compile step; what it did (None when there was nothing to compile)."""
        if self.batch is None:
            return None
        from flashrun.kernels import warmup

        self.batch.close()
        if not self.batch.submitted:
            return None
        return Compiled(self.batch.submitted, warmup.workers(), warmup.compiled_in(), self.batch.seconds, self.waited_s,
                        self.cases)


def _start(units: list[tuple[int, Callable[[], None]]], progress: Progress | None) -> Ahead:
    """List every unit's launches into one batch; its kernels compile from the first one on."""
    from flashrun.kernels import warmup

    if not units or not warmup.available():
        return Ahead(None, {}, 0)
    counts, lock = {"ready": 0}, threading.Lock()

    def ready(compile_: Compile) -> None:  # from the compile threads too
        if compile_.submitted:
            with lock:
                counts["ready"] += 1
            if progress is not None:
                progress(counts["ready"], batch.submitted, warmup.workers())

    batch = warmup.Batch(on_ready=ready)
    needs: dict[int, list[Compile]] = {}
    for index, launches in units:
        try:
            needs[index] = batch.collect(launches)
        except Exception as exc:  # noqa: BLE001 - the case's own run reports what is wrong with it
            log.debug("not compiling ahead for unit %d: %s: %s", index, type(exc).__name__, exc)
        if progress is not None:
            progress(counts["ready"], batch.submitted, warmup.workers())
    log.debug("compiling %d kernels ahead for %d units (listed in %.2f s)", batch.submitted, len(units),
              time.perf_counter() - batch.started)
    return Ahead(batch, needs, len(units))


def _free(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# -- verify --------------------------------------------------------------------------------------
def for_verify(jobs: list[Job], device: str, pool: Any, progress: Progress | None) -> Ahead:
    """The compile step of verify's ``jobs`` (``device``: this process's, "cuda" or "cpu"). In
    this process the checks start as their kernels are ready (:meth:`Ahead.run`); on a Ray pool
    whose GPUs share this host, every kernel is ready before this returns."""
    if device != "cuda" or (pool is not None and not (pool.gpus and pool.same_host)):
        return Ahead(None, {}, 0)
    units = [(job.index, _verify_launches(job, device)) for job in jobs if job.kernel in BUILTIN_KERNELS]
    ahead = _start(units, progress)
    _free(device)
    if pool is not None:
        ahead.wait()
    return ahead


def _verify_launches(job: Job, device: str) -> Callable[[], None]:
    """What :func:`flashrun.harness.check.check_case` launches for ``job``."""

    def launches() -> None:
        import torch

        from flashrun.harness.check import load_kernel
        from flashrun.harness.inputs import make_inputs

        kernel = load_kernel(job.kernel, job.launch, job.deterministic)
        inputs = make_inputs(job.case, job.seed, device)[0]
        variant = inputs.variant_args()
        if kernel.missing(variant):
            return
        q, k, v = (t.clone().requires_grad_(job.grads) for t in (inputs.q, inputs.k, inputs.v))
        out = kernel(q, k, v, causal=job.case.causal, sm_scale=1.0 / math.sqrt(job.case.head_dim), **variant)
        if job.grads and out.requires_grad:
            torch.autograd.grad(out, (q, k, v), inputs.dout)

    return launches


# -- bench ---------------------------------------------------------------------------------------
def for_bench(jobs: list[Any], device: Any, pool: Any, console: Console | None, tune: bool = False) -> Compiled | None:
    """Compile every kernel of ours that bench's shape ``jobs`` will time, and wait for all of
    them (a progress bar on ``console``). On a Ray pool only when its GPUs share this host.
    ``tune`` (``--tune``): shapes the tuned table misses are tuned on first use, here and on the
    workers (``FLASHRUN_TUNE=1`` for the rest of this process, :data:`.cluster.FORWARDED`); their
    candidates are compiled here with the rest."""
    if tune:
        os.environ["FLASHRUN_TUNE"] = "1"
    if device.type != "cuda" or (pool is not None and not (pool.gpus and pool.same_host)):
        return None
    units = list(enumerate(_bench_launches(job, name, device) for job in jobs for name in job.providers
                           if name in BUILTIN_KERNELS))
    if not units:
        return None
    with _bar(console) as progress:
        ahead = _start(units, progress)
        _free(device)
        ahead.wait()
    return ahead.close()


def _bench_launches(job: Any, name: str, device: Any) -> Callable[[], None]:
    """What :func:`flashrun.harness.measure.measure` launches for provider ``name`` on ``job``'s shape."""

    def launches() -> None:
        from flashrun.harness.inputs import make_inputs
        from flashrun.harness.providers import resolve

        attn = resolve(name, device).prepare(job.shape, device)
        inputs = make_inputs(job.shape, job.seed, device, requires_grad=True)[0]
        out = attn.fn(inputs.q, inputs.k, inputs.v, **inputs.per_set())
        if any(mode != "fwd" for mode in job.modes):
            out.backward(inputs.dout)

    return launches


@contextmanager
def _bar(console: Console | None) -> Iterator[Progress | None]:
    """A transient progress bar over the compile step ("compiling 23 kernels, 16 workers"), or
    nothing without a console."""
    if console is None:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             console=console, transient=True) as shown:
        task = shown.add_task("compiling", total=None)
        yield lambda done, total, workers: shown.update(task, completed=done, total=total,
                                                        description=describe(total, workers))


def describe(kernels: int, workers: int) -> str:
    """What a progress bar says during the compile step."""
    return f"compiling {kernels} kernel{'s' if kernels != 1 else ''}, {workers} workers"
