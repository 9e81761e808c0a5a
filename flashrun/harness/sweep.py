"""``flashrun bench``'s sweep: a shape at a time, every provider and mode on it.

The unit of work is a shape (:class:`ShapeJob`, run by :func:`run_shape`): its inputs and the
reference are made once, then every provider is checked and timed on it
(:func:`~flashrun.harness.measure.measure`), in one process, so two providers never share a GPU
while timed. :class:`Sweep` runs the jobs one after the other here, or as Ray tasks
(:mod:`~flashrun.harness.cluster`), and rewrites the result files as rows come in.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from flashrun.env.fingerprint import fingerprint
from flashrun.errors import is_oom
from flashrun.harness import results
from flashrun.harness.metrics import Ceilings, bytes_moved
from flashrun.harness.shapes import Shape, flops
from flashrun.records.runlog import now_iso

if TYPE_CHECKING:  # torch is imported only once a bench really runs
    import torch

    from flashrun.harness.measure import Cell, Timing
    from flashrun.harness.provider import Provider


@dataclass(frozen=True)
class ShapeJob:
    """Every provider and mode on one shape: what one process (this one, or a Ray worker) runs
    at a time, so two providers are never timed on one GPU at once. Plain, picklable data: the
    providers are named here and resolved where the job runs."""

    index: int  # position in the sweep: rows are reported in this order
    shape: Shape
    providers: tuple[str, ...]  # the baseline first
    modes: tuple[str, ...]
    device: str  # "cuda" or "cpu"
    seed: int
    baseline: str
    timing: Timing
    n_shapes: int  # shapes in the sweep: FlexAttention may compile once per shape
    gpu_type: str | None = None  # --per-gpu-type: the accelerator type this job asked for
    metrics: bool = False  # --metrics: each timed call profiled afterwards (harness.probe)
    profile: str | None = None  # --profile DIR: its traces go there

    @property
    def prefix(self) -> str:
        """The shape's part of its ``--profile`` file names (``probe.file_stem``): the traces and
        Proton's views of one cell share it."""
        return f"{self.index:03d} {self.shape.label}"


@dataclass
class ShapeRows:
    """What a :class:`ShapeJob` gives back."""

    index: int
    rows: list[results.Row]
    ceilings: Ceilings  # of the GPU that ran it (% peak, % roof)
    gpu: str  # its name, or "cpu"
    gpu_type: str | None = None


@dataclass(frozen=True)
class Here:
    """What the rows of a process share: its providers, its GPU's ceilings (% peak, % roof), and
    what every row says about where it was measured (gpu, torch, triton, where)."""

    providers: list[Provider]
    ceilings: Ceilings
    env: dict[str, Any]


_worker_ceilings: dict[tuple[str, Any], Ceilings] = {}  # a Ray worker measures its GPU once


def resolve(names: tuple[str, ...], device_type: str) -> list[Provider]:
    import torch

    from flashrun.harness import providers as providers_mod

    return [providers_mod.resolve(name, torch.device(device_type)) for name in names]


def row_env(env: dict[str, Any], device_type: str) -> dict[str, Any]:
    from flashrun import device as device_mod

    return {"gpu": env.get("gpu", "cpu") if device_type == "cuda" else "cpu", "torch": env.get("torch"),
            "triton": env.get("triton"), "where": device_mod.where(device_type)}


def _in_worker(job: ShapeJob, device: torch.device) -> Here:
    """A Ray worker's :class:`Here` for ``job``: providers resolved here, its GPU's ceilings
    measured once per worker process."""
    from flashrun.harness.measure import ceilings

    key = (device.type, job.timing)
    if key not in _worker_ceilings:
        _worker_ceilings[key] = ceilings(device, job.timing)
    return Here(resolve(job.providers, device.type), _worker_ceilings[key], row_env(fingerprint(), device.type))


def run_shape(job: ShapeJob, measured: Callable[[list[results.Row]], None] | None = None,
              advance: Callable[[str, int], None] | None = None, here: Here | None = None) -> ShapeRows:
    """Every provider on ``job.shape`` - the inputs and the reference made once - in this
    process. ``measured(rows)`` is called after each provider with the shape's rows so far;
    ``advance`` moves a progress bar; ``here`` is what the driver already resolved and measured
    (None in a Ray worker: it resolves and measures for itself)."""
    from flashrun import device as device_mod
    from flashrun.harness.judge import Reference
    from flashrun.harness.measure import Cell, free_memory, make_sets, measure
    from flashrun.harness.flex import compile_settings

    chosen = device_mod.select(job.device)  # a Ray worker: before any kernel module is imported
    import torch

    device = torch.device(chosen.kind if job.device == "cuda" else "cpu")
    here = here or _in_worker(job, device)
    providers, env = here.providers, here.env
    advance = advance or (lambda description, n: None)
    shape, rows = job.shape, []
    probe = None
    if job.metrics:
        from flashrun.harness.probe import Probe

        probe = Probe.on(device, job.profile, prefix=job.prefix)
    # Only FlexAttention compiles; importing dynamo for nothing costs seconds.
    compiles = device.type == "cuda" and any(p.name == "flex" for p in providers)
    with compile_settings(job.n_shapes) if compiles else nullcontext():
        try:
            sets = make_sets(shape, device, job.seed)
            ref = Reference.for_shape(sets[0], shape, grads=any(mode != "fwd" for mode in job.modes), edges=True)
        except Exception as exc:  # noqa: BLE001 - an OOM costs the shape; anything else is a bug
            if not is_oom(exc):
                raise
            sets = ref = None
            free_memory(device)
        baseline_ms: dict[str, float] = {}
        for provider in providers:
            advance(f"{shape.label}  {provider.name}", 0)
            if ref is None:
                cells = [Cell(mode, "OOM", None, note="the inputs and reference alone ran out of memory")
                         for mode in job.modes]
            else:
                cells = measure(provider, shape, sets, ref, list(job.modes), device, job.timing, probe)
            for cell in cells:
                if provider.name == job.baseline and cell.status == "ok" and cell.ms:
                    baseline_ms[cell.mode] = cell.ms[0]
                rows.append(_row(provider.name, shape, cell, baseline_ms.get(cell.mode), here.ceilings, env,
                                 fp8=provider.fp8))
            if any(cell.status == "OOM" for cell in cells):
                free_memory(device)
            if measured is not None:
                measured(rows)
            advance(f"{shape.label}  {provider.name}", len(job.modes))
        del sets, ref
        free_memory(device)
    return ShapeRows(job.index, rows, here.ceilings, env["gpu"], job.gpu_type)


def _row(provider: str, shape: Shape, cell: Cell, baseline_ms: float | None, ceilings: Ceilings,
         env: dict[str, Any], fp8: bool = False) -> results.Row:
    """``fp8``: the provider computes in e4m3 (its roofs and bytes are fp8's)."""
    ms, p20, p80 = cell.ms if cell.ms else (None, None, None)
    work, moved = flops(shape, cell.mode), bytes_moved(shape, cell.mode, fp8)
    if fp8:
        ceilings = ceilings.in_fp8()
    tflops = work / ms / 1e9 if ms else None  # FLOPs per ms -> TFLOP/s
    intensity = work / moved
    roof = ceilings.roof(intensity)
    metrics = cell.metrics
    return results.Row(
        provider=provider, mode=cell.mode, dtype=shape.dtype, causal=shape.causal, batch=shape.batch_size,
        heads=shape.num_heads, kv_heads=shape.num_kv_heads, seq_len=shape.seq_len, head_dim=shape.head_dim,
        ms=ms, ms_p20=p20, ms_p80=p80, tflops=tflops,
        pct_peak=100 * tflops / ceilings.tflops if tflops and ceilings.tflops else None,
        peak_mem_mb=cell.peak_mem_mb,
        speedup=baseline_ms / ms if ms and baseline_ms else None,
        correct=cell.correct, seq_len_k=shape.seq_len_k, status=cell.status, max_err=cell.max_err,
        note=cell.note, setup_s=cell.setup_s, gpu=env["gpu"], torch=env["torch"], triton=env["triton"],
        timestamp=now_iso(), where=env["where"], window=shape.window, softcap=shape.softcap, alibi=shape.alibi,
        seqlens=shape.seqlens, seqlens_k=shape.seqlens_k, path=cell.path, config=cell.config,
        cache_seqlens=shape.cache_seqlens, page_size=shape.page_size, new_keys=shape.new_keys, kv_scale=shape.kv_scale,
        gbps=moved / ms / 1e6 if ms else None, intensity=intensity,  # bytes per ms -> GB/s
        pct_roof=100 * tflops / roof if tflops and roof else None, bound=ceilings.bound(intensity) or "",
        gpu_us=metrics.gpu_us if metrics else None, wall_us=metrics.wall_us if metrics else None,
        kernels=metrics.kernels if metrics else (), gpu_kernels=metrics.gpu_kernels if metrics else (),
    )


def _fault_rows(job: ShapeJob, fault: Any) -> list[results.Row]:
    """A shape whose worker died twice: an ``error`` row per provider and mode, with the reason."""
    from flashrun.harness.measure import Cell

    env = {"gpu": "", "torch": None, "triton": None, "where": ""}  # where it died is not known
    return [_row(name, job.shape, Cell(mode, "error", None, note=fault.reason), None, Ceilings(None, None), env)
            for name in job.providers for mode in job.modes]


@dataclass
class Sweep:
    """The shapes of one bench run, and where their rows go."""

    jobs: list[ShapeJob]
    header: dict[str, Any]
    paths: tuple[Path, Path]  # CSV, JSON
    kernels_path: Path | None = None  # --profile: the per-kernel CSV

    @property
    def cells(self) -> int:
        return sum(len(job.providers) * len(job.modes) for job in self.jobs)

    def run(self, console: Console | None, here: Here) -> list[ShapeRows]:
        """Shape after shape in this process. The files are rewritten after every provider, and
        once more however this ends."""
        parts: list[ShapeRows] = []
        rows: list[results.Row] = []  # every row so far, the current shape's included

        def measured(shape_rows: list[results.Row]) -> None:
            rows[:] = [row for part in parts for row in part.rows] + shape_rows
            self._write(rows, False)

        with self._kept(console, lambda: rows), _progress(console, self.cells) as advance:
            for job in self.jobs:
                parts.append(run_shape(job, measured, advance, here))
        return parts

    def run_on(self, pool: Any, console: Console | None) -> list[ShapeRows]:
        """One Ray task per shape; as each finishes, the files are rewritten with the finished
        shapes in sweep order. A shape whose worker died twice gets ``error`` rows; Ctrl-C
        cancels the shapes still running and keeps the files of those that finished."""
        from flashrun.harness.cluster import Fault

        done: dict[int, ShapeRows] = {}

        def finished() -> list[results.Row]:
            return [row for index in sorted(done) for row in done[index].rows]

        resources = None
        if any(job.gpu_type for job in self.jobs):
            def resources(job: ShapeJob) -> dict[str, float]:
                return {f"accelerator_type:{job.gpu_type}": 0.001}  # Ray's accelerator_type= option

        with self._kept(console, finished), _progress(console, self.cells) as advance:
            # the biggest shapes first: the run then ends on small ones, not on one big one
            jobs = sorted(self.jobs, key=lambda job: -flops(job.shape, "fwd"))
            tasks = pool.map(run_shape, jobs, label=lambda job: f"shape-{job.index}", resources=resources)
            for job, outcome in tasks:
                if isinstance(outcome, Fault):
                    outcome = ShapeRows(job.index, _fault_rows(job, outcome), Ceilings(None, None), "", job.gpu_type)
                done[job.index] = outcome
                where = outcome.rows[0].where if outcome.rows and outcome.rows[0].where else "?"
                advance(f"{job.shape.label}  on {where}", len(job.providers) * len(job.modes))
                self._write(finished(), False)
        return [done[index] for index in sorted(done)]

    @contextmanager
    def _kept(self, console: Console | None, rows: Callable[[], list[results.Row]]) -> Iterator[None]:
        """The files get ``rows()`` once more however the sweep ends; ``complete`` only if it did."""
        complete = False
        try:
            yield
            complete = True
        except BaseException:
            if console is not None:
                console.print(f"rows measured so far: {self.paths[0]}")
            raise
        finally:
            self._write(rows(), complete)

    def _write(self, rows: list[results.Row], complete: bool) -> None:
        results.write(*self.paths, rows, self.header, complete=complete, kernels_path=self.kernels_path)


@contextmanager
def _progress(console: Console | None, total: int) -> Iterator[Callable[[str, int], None]]:
    """A rich progress bar over the sweep's cells (nothing without a console, e.g. --json)."""
    if console is None:
        yield lambda description, advance: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        yield lambda description, advance: progress.update(task, description=description, advance=advance)

