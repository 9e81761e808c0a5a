"""``flashrun bench``: our kernels against PyTorch's best, side by side, in one run.

:func:`run` expands the sweep (:func:`~flashrun.harness.shapes.bench_shapes`), checks and times
every provider (:mod:`~flashrun.harness.providers`, :mod:`~flashrun.harness.measure`) on every
shape, and writes the results (:mod:`~flashrun.harness.results`) after each provider. The unit of
work is a shape (:class:`ShapeJob`, run by :func:`run_shape`): every provider and mode on it, in
one process, so two providers never share a GPU while timed. In-process the shapes run one
after the other; with ``[cluster]`` each is a Ray task (:mod:`~flashrun.harness.cluster`), and
the files are rewritten, in sweep order, as each shape finishes.
:func:`render` prints them; a wrong row of one of our kernels comes with the ``flashrun verify``
command that reproduces it (same shape, same seed, hence the same inputs).

Without a GPU it refuses (exit 2): timings through Triton's interpreter mean nothing. Only an
explicit ``--device cpu`` (or ``experiment.device = "cpu"``) times the plain PyTorch providers
on the CPU, and says so.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
import shlex
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from flashrun.config import Config
from flashrun.env.fingerprint import fingerprint
from flashrun.errors import DeviceError, InputError, is_oom
from flashrun.harness import results
from flashrun.harness.shapes import Shape, bench_shapes, flops
from flashrun.records.runlog import append_record, make_record, now_iso

if TYPE_CHECKING:  # torch is imported only once a bench really runs: option errors answer at once
    import torch

    from flashrun.harness.measure import Cell, Timing
    from flashrun.harness.providers import Provider


@dataclass
class BenchReport:
    rows: list[results.Row]
    files: dict[str, str]
    device: str
    ceiling_tflops: float | None
    notices: list[str] = field(default_factory=list)
    compare_file: str | None = None
    ratios: list[results.Ratio] = field(default_factory=list)
    baseline: str = "sdpa"
    seed: int = 0
    gpu_types: list[str] = field(default_factory=list)  # --per-gpu-type: the sweep ran once on each
    row_types: list[str] = field(default_factory=list)  # ... and the type each row's sweep asked for

    @property
    def exit_code(self) -> int:
        """1 when a provider computed a wrong result (a failed check) or a shape's worker died, else 0."""
        return 1 if any(row.status in ("wrong", "error") for row in self.rows) else 0

    def to_json(self) -> dict[str, Any]:
        rows = [row.to_json() for row in self.rows]
        if self.gpu_types:
            rows = [{**row, "gpu_type": gpu_type} for row, gpu_type in zip(rows, self.row_types)]
        data: dict[str, Any] = {
            "device": self.device, "ceiling_tflops": self.ceiling_tflops, "baseline": self.baseline,
            "files": self.files, "notices": self.notices, "rows": rows,
        }
        if self.gpu_types:
            data["gpu_types"] = self.gpu_types
        if self.compare_file is not None:
            data["compare"] = {"file": self.compare_file, "ratios": [
                {**{name: getattr(r.row, name) for name in results.KEY}, "before_ms": r.before_ms,
                 "ms": r.row.ms, "ratio": r.ratio} for r in self.ratios]}
        return data


def provider_names(cfg: Config, kernels: tuple[str, ...]) -> list[str]:
    """[bench].providers (or --provider) plus --kernel, the baseline first (speedups need it
    measured before the others), each once."""
    names = [cfg.bench.baseline, *cfg.bench.providers, *kernels]
    return list(dict.fromkeys(names))


def run(cfg: Config, kernels: tuple[str, ...] = (), plot: Path | None = None, compare: Path | None = None,
        argv: tuple[str, ...] = (), console: Console | None = None, per_gpu_type: bool = False) -> BenchReport:
    """Check and time every provider on every shape of the sweep; write CSV, JSON, run record.
    ``kernels`` are added to ``[bench].providers``; ``console`` None: no progress output.
    With ``[cluster]`` workers > 1 or an address, each shape is a Ray task
    (:mod:`~flashrun.harness.cluster`); ``per_gpu_type`` runs the sweep once on each GPU type
    of the cluster."""
    from flashrun.harness import cluster
    from flashrun.harness import providers as providers_mod  # torch from here on

    names = provider_names(cfg, kernels)
    providers_mod.check_names(names)
    shapes = bench_shapes(cfg.bench)
    earlier = results.load_rows(compare) if compare is not None else None
    if plot is not None:
        results.check_plot_target(plot)
    if per_gpu_type and not cluster.wanted(cfg.cluster):
        raise InputError("--per-gpu-type runs the sweep on each GPU type of a Ray cluster",
                         hint="add --cluster ADDRESS (or --workers N for the GPUs of this machine)")
    inputs = (names, shapes, earlier, plot, compare, argv, console, per_gpu_type)
    if not cluster.wanted(cfg.cluster):
        return _run(cfg, *inputs, pool=None)
    if cfg.cluster.address is None:
        _device(cfg.experiment.device)  # a local cluster has this machine's GPUs: refuse before starting it
    with cluster.connect(cfg.cluster, cfg.experiment.device, cap=cfg.is_set("cluster.workers")) as pool:
        return _run(cfg, *inputs, pool=pool)


def _run(cfg: Config, names: list[str], shapes: list[Shape], earlier: list[dict[str, Any]] | None,
         plot: Path | None, compare: Path | None, argv: tuple[str, ...], console: Console | None,
         per_gpu_type: bool, pool: Any) -> BenchReport:
    from flashrun.harness import providers as providers_mod

    bench = cfg.bench
    device = _device(cfg.experiment.device, pool)
    notices = [] if pool is None else [f"running on {pool.description}", *pool.notices]
    if device.type == "cpu":
        notices.append(f"CPU run: only {', '.join(providers_mod.CPU_PROVIDERS)} are timed, on the CPU; "
                       "these numbers say nothing about any GPU")
    gpu_types: list[str] = []
    if per_gpu_type:
        gpu_types = pool.gpu_types
        if not gpu_types:
            raise InputError("--per-gpu-type: the Ray cluster names no GPU types (no accelerator_type:* resource)",
                             hint="Ray names the NVIDIA GPUs it detects; a node started with "
                                  "--resources='{\"accelerator_type:NAME\": 1}' names its own")
    resolved = _resolve(tuple(names), device.type)  # loads kernels: a bad path stops here

    from flashrun.harness.judge import FACTOR, TOLERANCE
    from flashrun.harness.measure import Timing

    out_dir = bench.out or cfg.logging.log_dir / "bench"
    env = fingerprint()
    # What the rows were measured on: the GPU's name, or "cpu" (even on a GPU machine); on Ray,
    # the cluster's GPU type(s) - each row names the GPU that measured it.
    if pool is None:
        env["measured_on"] = env.get("gpu", "cpu") if device.type == "cuda" else "cpu"
    else:
        env["measured_on"] = ("cpu" if device.type == "cpu" else
                              "-".join(pool.gpu_types) if 0 < len(pool.gpu_types) <= 2 else "gpus")
    paths = _result_paths(out_dir, env["measured_on"])
    header = {"command": "flashrun " + shlex.join(argv), "argv": list(argv), "started": now_iso(),
              "device": device.type, "env": env, "bench": bench.model_dump(mode="json"),
              "seed": cfg.experiment.seed, "ceiling_tflops": None,
              "tolerance": {"factor": FACTOR, **{str(dtype).removeprefix("torch."): dataclasses.asdict(tol)
                                                 for dtype, tol in TOLERANCE.items()}}}
    try:  # the empty files now: an unwritable --out must fail before the GPU works, not after
        results.write(*paths, [], header, complete=False)
    except OSError as exc:
        raise InputError(f"cannot write the results to {out_dir}: {exc.strerror or exc}",
                         hint="pick a writable folder with --out or [bench].out") from None
    timing = Timing(bench.warmup_ms, bench.rep_ms)
    jobs = [ShapeJob(index, shape, tuple(names), tuple(dict.fromkeys(bench.mode)), device.type, cfg.experiment.seed,
                     bench.baseline, timing, len(shapes), gpu_type)
            for index, (gpu_type, shape) in enumerate((t, s) for t in (gpu_types or [None]) for s in shapes)]
    sweep = _Sweep(jobs, header, paths)
    if pool is None:
        from flashrun.harness.measure import matmul_ceiling

        header["ceiling_tflops"] = matmul_ceiling(device, timing)  # measured once, before the sweep
        parts = sweep.run(console, _Here(resolved, header["ceiling_tflops"], _row_env(env, device.type)))
    else:
        parts = sweep.run_on(pool, console)
    rows = [row for part in parts for row in part.rows]
    ceilings = {part.gpu: part.ceiling for part in parts if part.ceiling is not None}
    ceiling = next(iter(ceilings.values())) if len(ceilings) == 1 else header["ceiling_tflops"]
    files = {"csv": str(paths[0]), "json": str(paths[1])}
    if plot is not None:
        files["plot"] = str(results.plot(rows, plot))
    report = BenchReport(rows, files, device.type, ceiling, notices, baseline=bench.baseline,
                         seed=cfg.experiment.seed)
    if gpu_types:
        report.gpu_types = gpu_types
        report.row_types = [part.gpu_type or "" for part in parts for _ in part.rows]
    if earlier is not None:
        report.compare_file = str(compare)
        report.ratios = results.compare(rows, earlier)
    append_record(cfg.logging.log_dir, make_record(
        "bench", list(argv), cfg.public_dict(), _summary(rows, resolved, report),
        kernels=[p.name for p in resolved if p.is_kernel], n_cases=len(shapes),
    ))
    return report


def _device(requested: str, pool: Any = None) -> torch.device:
    """Where the providers run: this machine's GPU, or its CPU when asked; on Ray, the
    workers' GPUs, or their CPUs when asked."""
    import torch

    from flashrun import device as device_mod

    chosen = device_mod.select(requested)  # also in this process: kernels are loaded here to check them
    if (chosen.kind if pool is None else pool.kind) == "cuda":
        return torch.device("cuda")
    if requested == "cpu":
        return torch.device("cpu")
    reason = device_mod.no_gpu_reason() if pool is None else "the Ray cluster has no GPU"
    raise DeviceError(
        f"no GPU ({reason}): flashrun bench will not time kernels through "
        "Triton's CPU interpreter, whose timings mean nothing",
        hint="run it on a machine with a CUDA GPU, or pass --device cpu to time only the plain PyTorch "
             "providers (torch-naive, sdpa, sdpa-math) on the CPU",
    )


def _result_paths(out_dir: Path, gpu: str) -> tuple[Path, Path]:
    """<out>/<gpu>-<timestamp>.csv/.json, never overwriting an earlier run's files."""
    stem = f"{re.sub(r'[^A-Za-z0-9._]+', '-', gpu).strip('-')}-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    candidate, n = stem, 1
    while (out_dir / f"{candidate}.csv").exists() or (out_dir / f"{candidate}.json").exists():
        n += 1
        candidate = f"{stem}-{n}"
    return out_dir / f"{candidate}.csv", out_dir / f"{candidate}.json"


# -- one shape: the unit of work -------------------------------------------------------------------------
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


@dataclass
class ShapeRows:
    """What a :class:`ShapeJob` gives back."""

    index: int
    rows: list[results.Row]
    ceiling: float | None  # the matmul TFLOP/s of the GPU that ran it (% peak)
    gpu: str  # its name, or "cpu"
    gpu_type: str | None = None


@dataclass(frozen=True)
class _Here:
    """What the rows of a process share: its providers, the % peak bar of its GPU, and what
    every row says about where it was measured (gpu, torch, triton, where)."""

    providers: list[Provider]
    ceiling: float | None
    env: dict[str, Any]


_worker_ceilings: dict[tuple[str, Any], float | None] = {}  # a Ray worker measures its GPU once


def _resolve(names: tuple[str, ...], device_type: str) -> list[Provider]:
    import torch

    from flashrun.harness import providers as providers_mod

    return [providers_mod.resolve(name, torch.device(device_type)) for name in names]


def _row_env(env: dict[str, Any], device_type: str) -> dict[str, Any]:
    from flashrun import device as device_mod

    return {"gpu": env.get("gpu", "cpu") if device_type == "cuda" else "cpu", "torch": env.get("torch"),
            "triton": env.get("triton"), "where": device_mod.where(device_type)}


def _in_worker(job: ShapeJob, device: torch.device) -> _Here:
    """A Ray worker's :class:`_Here` for ``job``: providers resolved here, its GPU's bar measured
    once per worker process."""
    from flashrun.harness.measure import matmul_ceiling

    key = (device.type, job.timing)
    if key not in _worker_ceilings:
        _worker_ceilings[key] = matmul_ceiling(device, job.timing)
    return _Here(_resolve(job.providers, device.type), _worker_ceilings[key], _row_env(fingerprint(), device.type))


def run_shape(job: ShapeJob, measured: Callable[[list[results.Row]], None] | None = None,
              advance: Callable[[str, int], None] | None = None, here: _Here | None = None) -> ShapeRows:
    """Every provider on ``job.shape`` - the inputs and the reference made once - in this
    process. ``measured(rows)`` is called after each provider with the shape's rows so far;
    ``advance`` moves a progress bar; ``here`` is what the driver already resolved and measured
    (None in a Ray worker: it resolves and measures for itself)."""
    from flashrun import device as device_mod
    from flashrun.harness.judge import Reference
    from flashrun.harness.measure import Cell, free_memory, make_sets, measure
    from flashrun.harness.providers import compile_settings

    chosen = device_mod.select(job.device)  # a Ray worker: before any kernel module is imported
    import torch

    device = torch.device(chosen.kind if job.device == "cuda" else "cpu")
    here = here or _in_worker(job, device)
    providers, ceiling, env = here.providers, here.ceiling, here.env
    advance = advance or (lambda description, n: None)
    shape, rows = job.shape, []
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
                cells = measure(provider, shape, sets, ref, list(job.modes), device, job.timing)
            for cell in cells:
                if provider.name == job.baseline and cell.status == "ok" and cell.ms:
                    baseline_ms[cell.mode] = cell.ms[0]
                rows.append(_row(provider.name, shape, cell, baseline_ms.get(cell.mode), ceiling, env))
            if any(cell.status == "OOM" for cell in cells):
                free_memory(device)
            if measured is not None:
                measured(rows)
            advance(f"{shape.label}  {provider.name}", len(job.modes))
        del sets, ref
        free_memory(device)
    return ShapeRows(job.index, rows, ceiling, env["gpu"], job.gpu_type)


def _row(provider: str, shape: Shape, cell: Cell, baseline_ms: float | None, ceiling: float | None,
         env: dict[str, Any]) -> results.Row:
    ms, p20, p80 = cell.ms if cell.ms else (None, None, None)
    tflops = flops(shape, cell.mode) / ms / 1e9 if ms else None  # FLOPs per ms -> TFLOP/s
    return results.Row(
        provider=provider, mode=cell.mode, dtype=shape.dtype, causal=shape.causal, batch=shape.batch_size,
        heads=shape.num_heads, kv_heads=shape.num_kv_heads, seq_len=shape.seq_len, head_dim=shape.head_dim,
        ms=ms, ms_p20=p20, ms_p80=p80, tflops=tflops,
        pct_peak=100 * tflops / ceiling if tflops and ceiling else None,
        peak_mem_mb=cell.peak_mem_mb,
        speedup=baseline_ms / ms if ms and baseline_ms else None,
        correct=cell.correct, seq_len_k=shape.seq_len_k, status=cell.status, max_err=cell.max_err,
        note=cell.note, setup_s=cell.setup_s, gpu=env["gpu"], torch=env["torch"], triton=env["triton"],
        timestamp=now_iso(), where=env["where"], window=shape.window, softcap=shape.softcap, alibi=shape.alibi,
        seqlens=shape.seqlens, seqlens_k=shape.seqlens_k, path=cell.path, cache_seqlens=shape.cache_seqlens,
        page_size=shape.page_size, new_keys=shape.new_keys,
    )


def _fault_rows(job: ShapeJob, fault: Any) -> list[results.Row]:
    """A shape whose worker died twice: an ``error`` row per provider and mode, with the reason."""
    from flashrun.harness.measure import Cell

    env = {"gpu": "", "torch": None, "triton": None, "where": ""}  # where it died is not known
    return [_row(name, job.shape, Cell(mode, "error", None, note=fault.reason), None, None, env)
            for name in job.providers for mode in job.modes]


@dataclass
class _Sweep:
    """The shapes of one bench run, and where their rows go."""

    jobs: list[ShapeJob]
    header: dict[str, Any]
    paths: tuple[Path, Path]  # CSV, JSON

    @property
    def cells(self) -> int:
        return sum(len(job.providers) * len(job.modes) for job in self.jobs)

    def run(self, console: Console | None, here: _Here) -> list[ShapeRows]:
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
                    outcome = ShapeRows(job.index, _fault_rows(job, outcome), None, "", job.gpu_type)
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
        results.write(*self.paths, rows, self.header, complete=complete)


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


def _summary(rows: list[results.Row], resolved: list[Provider], report: BenchReport) -> dict[str, Any]:
    """The run record's results. best_tflops: our kernels' best when any was measured (that is
    what `flashrun runs` should show), else the best of all providers."""
    kernels = {p.name for p in resolved if p.is_kernel}
    valid = [r for r in rows if r.valid]
    pool = [r for r in valid if r.provider in kernels] or valid
    best = max(pool, key=lambda r: r.tflops, default=None)
    return {
        "best_tflops": best.tflops if best else None,
        "best_provider": best.provider if best else None,
        "rows": len(rows), "wrong": sum(r.status == "wrong" for r in rows),
        "ceiling_tflops": report.ceiling_tflops, "device": report.device, "files": report.files,
    }


# -- rendering ------------------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _tflops(value: float | None) -> str:
    """One decimal for GPU-sized numbers; three significant digits for the CPU's small ones."""
    return "" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def render(report: BenchReport, console: Console) -> None:
    """One table, a section per shape; why cells are n/a (or notes on how a provider ran) are
    listed once per provider and reason below it, so the table stays narrow."""
    rows = report.rows
    shown = [r for r in rows if r.status != "n/a"]
    optional = {"% peak": any(r.pct_peak is not None for r in rows), "MB": any(r.peak_mem_mb is not None for r in rows)}
    gpus = list(dict.fromkeys(r.gpu for r in rows if r.gpu))  # several on a mixed Ray cluster
    # At 80 columns or in a pipe only the shape label wraps: every other cell keeps its full width
    # (a provider name or a number cut to "sdpa-c…" or "123…" would be another one).
    table = Table(title=f"flashrun bench ({', '.join(gpus) if gpus else report.device})", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    columns = [c for c in ("shape", "provider", "mode", "ms", "TFLOP/s", "% peak", "MB", "speedup", "check")
               if optional.get(c, True)]
    cells = []
    previous = None
    for r in shown:
        shape = r.shape.label
        values = {"shape": shape if shape != previous else "", "provider": r.provider, "mode": r.mode,
                  "ms": _fmt(r.ms, 3), "TFLOP/s": _tflops(r.tflops), "% peak": _fmt(r.pct_peak, 0),
                  "MB": _fmt(r.peak_mem_mb, 0), "speedup": _fmt(r.speedup, 2) + ("x" if r.speedup is not None else ""),
                  "check": r.status.upper() if r.status != "ok" else "ok"}
        cells.append((shape != previous and previous is not None, r.status, [values[c] for c in columns]))
        previous = shape
    for i, column in enumerate(columns):
        if column == "shape":
            table.add_column(column, overflow="fold")
        else:
            width = max([len(column)] + [len(row[i]) for _, _, row in cells])
            table.add_column(column, justify="left" if column in ("provider", "mode", "check") else "right",
                             no_wrap=True, min_width=width)
    style = {"ok": "green", "wrong": "bold red", "OOM": "yellow", "error": "bold red"}
    for section, status, row in cells:
        if section:
            table.add_section()
        row[-1] = f"[{style[status]}]{escape(row[-1])}[/]"
        table.add_row(*[escape(c) for c in row[:-1]], row[-1])
    if report.gpu_types:
        _render_per_type(report, console)
    elif shown:
        console.print(table)
    reasons: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r.note:
            key = (r.provider, r.status if r.status in ("n/a", "wrong", "error") else "note", r.note)
            reasons[key] = reasons.get(key, 0) + 1
    for (provider, kind, note), count in reasons.items():
        style = {"n/a": "dim", "wrong": "bold red", "error": "bold red", "note": "dim"}[kind]
        cells = f"{count} cell{'s' if count > 1 else ''}"
        console.print(f"[{style}]{kind}[/] {provider} ({cells}): {note}", markup=True, highlight=False)
    paths: dict[str, dict[str, int]] = {}  # provider -> implementation -> cells
    for r in rows:
        if r.path:
            paths.setdefault(r.provider, {})[r.path] = paths.get(r.provider, {}).get(r.path, 0) + 1
    for provider, counts in paths.items():
        ran = ", ".join(f"{path} ({n} cell{'s' if n > 1 else ''})" for path, n in counts.items())
        console.print(f"forward path {provider}: {ran}", highlight=False)
    setup: dict[str, dict[str, float]] = {}  # provider -> shape -> seconds (once per shape, not per mode)
    for r in rows:
        if r.setup_s is not None:
            setup.setdefault(r.provider, {})[r.shape.label] = r.setup_s
    if setup:
        spent = ", ".join(f"{name} {sum(shapes.values()):.1f} s" for name, shapes in setup.items())
        console.print(f"setup (prepare + first checked call, compiling and autotuning included): {spent}")
    if shown:
        console.print(f"speedup: against {report.baseline}, same shape and mode")
    if report.ceiling_tflops is not None:
        console.print(f"% peak: of a bf16 8192³ matrix product measured in this run, "
                      f"{report.ceiling_tflops:.0f} TFLOP/s")
    for notice in report.notices:
        console.print(f"[yellow]note:[/] {notice}")
    wrong = sorted({r.provider for r in rows if r.status == "wrong"})
    if wrong:
        console.print(f"[bold red]wrong results from {', '.join(wrong)}[/]: their times are not reported")
        _render_reproduce(report, console)
    if report.compare_file is not None:
        _render_compare(report, console)
    for kind, path in report.files.items():
        console.print(f"wrote {kind}: {path}")


def _render_per_type(report: BenchReport, console: Console) -> None:
    """--per-gpu-type: TFLOP/s of each (shape, provider, mode) on each GPU type, side by side."""
    cells: dict[tuple[str, str, str], dict[str, results.Row]] = {}
    for row, gpu_type in zip(report.rows, report.row_types):
        if row.status != "n/a":
            cells.setdefault((row.shape.label, row.provider, row.mode), {})[gpu_type] = row
    table = Table(title="flashrun bench: TFLOP/s on each GPU type")
    for column in ("shape", "provider", "mode", *report.gpu_types):
        table.add_column(column, justify="left" if column in ("shape", "provider", "mode") else "right")
    previous = None
    for (shape, provider, mode), by_type in cells.items():
        if previous is not None and shape != previous:
            table.add_section()
        values = [("" if t not in by_type else _tflops(by_type[t].tflops) if by_type[t].status == "ok"
                   else by_type[t].status.upper()) for t in report.gpu_types]
        table.add_row(shape if shape != previous else "", provider, mode, *values)
        previous = shape
    console.print(table)


def _render_reproduce(report: BenchReport, console: Console) -> None:
    """For each wrong (kernel, shape): the verify command that draws the same inputs."""
    from flashrun.harness.providers import is_kernel_spec
    from flashrun.harness.verify import reproduce_command

    seen = set()
    for r in report.rows:
        key = (r.provider, r.shape)
        if r.status == "wrong" and is_kernel_spec(r.provider) and key not in seen:
            seen.add(key)
            console.print(f"  reproduce: {reproduce_command(r.provider, r.shape, report.seed, grad=r.mode != 'fwd')}",
                          markup=False, highlight=False)


def _render_compare(report: BenchReport, console: Console) -> None:
    if not report.ratios:
        console.print(f"[yellow]compare:[/] no row of this run matches one in {report.compare_file} "
                      "(same provider, mode, dtype and shape)")
        return
    table = Table(title=f"against {report.compare_file} (ratio = before / now: above 1 is faster now)")
    for column in ("provider", "mode", "dtype", "causal", "shape (B, H, Nq, Nk, D)", "before ms", "now ms", "ratio"):
        table.add_column(column, justify="left" if column in ("provider", "mode", "dtype") else "right")
    for ratio in report.ratios:
        r = ratio.row
        table.add_row(r.provider, r.mode, r.dtype, "yes" if r.causal else "no",
                      f"{r.batch}, {r.heads}, {r.seq_len}, {r.seq_len_k}, {r.head_dim}"
                      + (f" {r.shape.variant_label}" if r.shape.variant_label else ""),
                      _fmt(ratio.before_ms, 3), _fmt(r.ms, 3),
                      f"{ratio.ratio:.2f}x" if ratio.ratio is not None else "n/a")
    console.print(table)
