"""``flashrun bench``: our kernels against PyTorch's best, side by side, in one run.

:func:`run` expands the sweep (:func:`~flashrun.harness.shapes.bench_shapes`), checks and times
every provider (:mod:`~flashrun.harness.providers`, :mod:`~flashrun.harness.measure`) on every
shape, and writes the results (:mod:`~flashrun.harness.results`) after each provider.
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

from rich.console import Console
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

    @property
    def exit_code(self) -> int:
        """1 when a provider computed a wrong result (a failed check), else 0."""
        return 1 if any(row.status == "wrong" for row in self.rows) else 0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "device": self.device, "ceiling_tflops": self.ceiling_tflops, "baseline": self.baseline,
            "files": self.files, "notices": self.notices, "rows": [row.to_json() for row in self.rows],
        }
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
        argv: tuple[str, ...] = (), console: Console | None = None) -> BenchReport:
    """Check and time every provider on every shape of the sweep; write CSV, JSON, run record.
    ``kernels`` are added to ``[bench].providers``; ``console`` None: no progress output."""
    from flashrun.harness import providers as providers_mod  # torch from here on

    bench = cfg.bench
    names = provider_names(cfg, kernels)
    providers_mod.check_names(names)
    shapes = bench_shapes(bench)
    earlier = results.load_rows(compare) if compare is not None else None
    if plot is not None:
        results.check_plot_target(plot)
    device = _device(cfg.experiment.device)
    notices = []
    if device.type == "cpu":
        notices.append(f"CPU run: only {', '.join(providers_mod.CPU_PROVIDERS)} are timed, on the CPU; "
                       "these numbers say nothing about any GPU")
    resolved = [providers_mod.resolve(name, device) for name in names]  # loads kernels: a bad path stops here

    from flashrun.harness.judge import FACTOR, TOLERANCE
    from flashrun.harness.measure import Timing, matmul_ceiling

    out_dir = bench.out or cfg.logging.log_dir / "bench"
    env = fingerprint()
    # What the rows were measured on: the GPU's name, or "cpu" (even on a GPU machine).
    env["measured_on"] = env.get("gpu", "cpu") if device.type == "cuda" else "cpu"
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
    ceiling = header["ceiling_tflops"] = matmul_ceiling(device, timing)
    sweep = _Sweep(resolved, list(dict.fromkeys(bench.mode)), device, cfg.experiment.seed, bench.baseline,
                   timing, ceiling, header, paths, env)
    rows = sweep.run(shapes, console)
    files = {"csv": str(paths[0]), "json": str(paths[1])}
    if plot is not None:
        files["plot"] = str(results.plot(rows, plot))
    report = BenchReport(rows, files, device.type, ceiling, notices, baseline=bench.baseline,
                         seed=cfg.experiment.seed)
    if earlier is not None:
        report.compare_file = str(compare)
        report.ratios = results.compare(rows, earlier)
    append_record(cfg.logging.log_dir, make_record(
        "bench", list(argv), cfg.public_dict(), _summary(rows, resolved, report),
        kernels=[p.name for p in resolved if p.is_kernel], n_cases=len(shapes),
    ))
    return report


def _device(requested: str) -> torch.device:
    import torch

    from flashrun import device as device_mod

    chosen = device_mod.select(requested)
    if chosen.kind == "cuda":
        return torch.device("cuda")
    if requested == "cpu":
        return torch.device("cpu")
    raise DeviceError(
        f"no GPU ({device_mod.no_gpu_reason()}): flashrun bench will not time kernels through "
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


@dataclass
class _Sweep:
    """Everything one bench sweep shares across its shapes."""

    providers: list[Provider]
    modes: list[str]
    device: torch.device
    seed: int
    baseline: str
    timing: Timing
    ceiling: float | None
    header: dict[str, Any]
    paths: tuple[Path, Path]  # CSV, JSON
    env: dict[str, Any]

    def run(self, shapes: list[Shape], console: Console | None) -> list[results.Row]:
        """Shape-major: each shape's inputs and reference are made once, then every provider
        runs on them. The files are rewritten after every provider, and once more however
        this ends."""
        from flashrun.harness.providers import compile_settings

        rows: list[results.Row] = []
        complete = False
        # Only FlexAttention compiles; importing dynamo for nothing costs seconds.
        compiles = self.device.type == "cuda" and any(p.name == "flex" for p in self.providers)
        try:
            with _progress(console, len(shapes) * len(self.providers) * len(self.modes)) as advance, \
                    (compile_settings(len(shapes)) if compiles else nullcontext()):
                for shape in shapes:
                    self._shape(shape, rows, advance)
            complete = True
        except BaseException:
            if console is not None:
                console.print(f"rows measured so far: {self.paths[0]}")
            raise
        finally:
            results.write(*self.paths, rows, self.header, complete=complete)
        return rows

    def _shape(self, shape: Shape, rows: list[results.Row], advance: Callable[[str, int], None]) -> None:
        """Every provider on ``shape``; its rows are appended to ``rows`` as they are measured."""
        from flashrun.harness.judge import Reference
        from flashrun.harness.measure import (
            Cell,
            free_memory,
            make_sets,
            measure,
        )

        try:
            sets = make_sets(shape, self.device, self.seed)
            ref = Reference.for_shape(sets[0], shape, grads=any(mode != "fwd" for mode in self.modes), edges=True)
        except Exception as exc:  # noqa: BLE001 - an OOM costs the shape; anything else is a bug
            if not is_oom(exc):
                raise
            sets = ref = None
            free_memory(self.device)
        baseline_ms: dict[str, float] = {}
        for provider in self.providers:
            advance(f"{shape.label}  {provider.name}", 0)
            if ref is None:
                cells = [Cell(mode, "OOM", None, note="the inputs and reference alone ran out of memory")
                         for mode in self.modes]
            else:
                cells = measure(provider, shape, sets, ref, self.modes, self.device, self.timing)
            for cell in cells:
                if provider.name == self.baseline and cell.status == "ok" and cell.ms:
                    baseline_ms[cell.mode] = cell.ms[0]
                rows.append(self._row(provider.name, shape, cell, baseline_ms.get(cell.mode)))
            if any(cell.status == "OOM" for cell in cells):
                free_memory(self.device)
            results.write(*self.paths, rows, self.header, complete=False)
            advance(f"{shape.label}  {provider.name}", len(self.modes))
        del sets, ref
        free_memory(self.device)

    def _row(self, provider: str, shape: Shape, cell: Cell, baseline_ms: float | None) -> results.Row:
        ms, p20, p80 = cell.ms if cell.ms else (None, None, None)
        tflops = flops(shape, cell.mode) / ms / 1e9 if ms else None  # FLOPs per ms -> TFLOP/s
        return results.Row(
            provider=provider, mode=cell.mode, dtype=shape.dtype, causal=shape.causal, batch=shape.batch_size,
            heads=shape.num_heads, kv_heads=shape.num_kv_heads, seq_len=shape.seq_len, head_dim=shape.head_dim,
            ms=ms, ms_p20=p20, ms_p80=p80, tflops=tflops,
            pct_peak=100 * tflops / self.ceiling if tflops and self.ceiling else None,
            peak_mem_mb=cell.peak_mem_mb,
            speedup=baseline_ms / ms if ms and baseline_ms else None,
            correct=cell.correct, seq_len_k=shape.seq_len_k, status=cell.status, max_err=cell.max_err,
            note=cell.note, setup_s=cell.setup_s, gpu=self.env["measured_on"], torch=self.env.get("torch"),
            triton=self.env.get("triton"), timestamp=now_iso(), window=shape.window, softcap=shape.softcap,
            alibi=shape.alibi, seqlens=shape.seqlens, seqlens_k=shape.seqlens_k,
        )


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
    table = Table(title=f"flashrun bench ({rows[0].gpu if rows else report.device})")
    for column in ("shape", "provider", "mode", "ms", "TFLOP/s", "% peak", "MB", f"vs {report.baseline}", "check"):
        if optional.get(column, True):
            table.add_column(column, justify="left" if column in ("shape", "provider", "mode", "check") else "right")
    previous = None
    for r in shown:
        shape = r.shape.label
        if previous is not None and shape != previous:
            table.add_section()
        check = {"ok": "[green]ok[/]", "wrong": "[bold red]WRONG[/]", "OOM": "[yellow]OOM[/]"}[r.status]
        values = {"% peak": _fmt(r.pct_peak, 0), "MB": _fmt(r.peak_mem_mb, 0)}
        table.add_row(shape if shape != previous else "", r.provider, r.mode, _fmt(r.ms, 3), _tflops(r.tflops),
                      *[values[c] for c in ("% peak", "MB") if optional[c]],
                      _fmt(r.speedup, 2) + ("x" if r.speedup is not None else ""), check)
        previous = shape
    if shown:
        console.print(table)
    reasons: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r.note:
            key = (r.provider, "n/a" if r.status == "n/a" else "wrong" if r.status == "wrong" else "note", r.note)
            reasons[key] = reasons.get(key, 0) + 1
    for (provider, kind, note), count in reasons.items():
        style = {"n/a": "dim", "wrong": "bold red", "note": "dim"}[kind]
        cells = f"{count} cell{'s' if count > 1 else ''}"
        console.print(f"[{style}]{kind}[/] {provider} ({cells}): {note}", markup=True, highlight=False)
    setup: dict[str, dict[str, float]] = {}  # provider -> shape -> seconds (once per shape, not per mode)
    for r in rows:
        if r.setup_s is not None:
            setup.setdefault(r.provider, {})[r.shape.label] = r.setup_s
    if setup:
        spent = ", ".join(f"{name} {sum(shapes.values()):.1f} s" for name, shapes in setup.items())
        console.print(f"setup (prepare + first checked call, compiling and autotuning included): {spent}")
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
