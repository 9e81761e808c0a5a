"""``flashrun verify``: run attention kernels against a high-precision reference.

:func:`make_plan` turns the config (or a cases file) into a :class:`Plan`: kernels x shapes.
:func:`run` turns the plan into one :class:`~flashrun.harness.check.Job` per (case, kernel),
skips up front what the interpreter cannot finish in the budget, runs the rest
(:func:`~flashrun.harness.check.run_job`) in this process (:func:`_serial`) or, with
``[cluster]``, as Ray tasks (:func:`flashrun.harness.cluster.checks`, the same contract),
reports each result as it finishes - a progress bar on a terminal, one line per case anywhere
else - and writes the run record, also when Ctrl-C ends the run early (the record says
``interrupted``). Results are sorted by job index, so a run on many workers reads, and is
recorded, like a serial one. :func:`render` prints the table.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

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
from flashrun.errors import InputError
from flashrun.harness.check import CaseResult, Job, interpreter_seconds
from flashrun.harness.shapes import FIELDS, PLAIN, VARIANT_FIELDS, Shape, verify_shapes

if TYPE_CHECKING:
    from flashrun.harness.precompile import Compiled

SLOW_CASE_S = 30.0  # say so before an interpreter case expected to take longer than this


@dataclass(frozen=True)
class Plan:
    """Everything a run needs besides the config: enough to repeat it from its record."""

    kernels: list[str]
    cases: list[Shape]
    grad: bool
    diagnose: bool
    device: str
    seed: int
    budget_s: float = 0.0  # interpreter cases expected to take longer are skipped; 0: no limit


def make_plan(cfg: Config, cases_file: Path | None, device: str | None = None) -> Plan:
    if cases_file is not None:
        from flashrun.harness.cases import load_cases

        cases = [Shape.from_fields(c, cfg.experiment, f"{cases_file}: case {i + 1}")
                 for i, c in enumerate(load_cases(cases_file))]
        if not cases:
            raise InputError(f"{cases_file}: holds no cases", hint="run `flashrun gen-cases --offline` to make some")
        cases = list(dict.fromkeys(cases))
    else:
        cases = verify_shapes(cfg)
    return Plan(list(cfg.experiment.kernel), cases, cfg.verify.grad, cfg.verify.diagnose,
                device or cfg.experiment.device, cfg.experiment.seed, cfg.verify.budget_s)


def plan_from_record(record: dict[str, Any]) -> tuple[Config, Plan]:
    """The config and plan stored in a verify run record (``--rerun``)."""
    if record.get("command") != "verify" or "plan" not in record:
        raise InputError(f"run {record.get('id')} is a {record.get('command')} run, not a verify run",
                         hint="`flashrun runs` lists the runs; pick a verify one")
    stored = record["plan"]
    config = Config.model_validate(record["config"])
    plan = Plan(stored["kernels"], [Shape(**c) for c in stored["cases"]], stored["grad"], stored["diagnose"],
                stored["device"], stored["seed"], stored.get("budget_s", 0.0))
    return config, plan


@dataclass
class Report:
    results: list[CaseResult]
    device: str
    notices: list[str]
    run_id: str | None = None
    planned: int = 0  # (case, kernel) checks in the plan
    interrupted: bool = False  # Ctrl-C: ``results`` holds the checks that finished
    interpreter: bool = False
    compiled: Compiled | None = None  # flashrun's kernels compiled ahead (None: nothing to compile)
    run_s: float | None = None  # wall time of the checks, waits for their kernels included

    @property
    def passed(self) -> int:
        return sum(r.status == "pass" for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.status in ("fail", "error", "oom") for r in self.results)

    @property
    def skipped(self) -> int:
        return sum(r.status in ("unsupported", "skipped") for r in self.results)

    @property
    def verdict(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed"
        text += f", {self.skipped} skipped" if self.skipped else ""
        return text + (f" (interrupted: {len(self.results)} of {self.planned} checks ran)" if self.interrupted else "")

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "device": self.device, "notices": self.notices, "verdict": self.verdict,
                "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
                "interrupted": self.interrupted,
                "compile": self.compiled.to_json() if self.compiled is not None else None,
                "run_s": None if self.run_s is None else round(self.run_s, 3),
                "results": [r.to_json() for r in self.results]}


# ---------------------------------------------------------------------------------------------
# Running


def run(cfg: Config, plan: Plan, console: Console | None, argv: list[str] | None = None) -> Report:
    """Run every (case, kernel) check; write a run record. ``console`` None: no progress output.
    With ``[cluster]`` workers > 1 or an address, the checks run as Ray tasks
    (:mod:`~flashrun.harness.cluster`); otherwise here, one after the other, without Ray."""
    from flashrun import device as device_mod
    from flashrun.harness import cluster
    from flashrun.harness.check import load_kernel

    dev = device_mod.select(plan.device)

    from flashrun import kernels

    # [triton] pins flash's launch config; otherwise verify uses each kernel's default config
    # rather than autotuning: every case would compile the tuner's whole space (minutes on a GPU
    # for a sweep), while the GPU suite (tests/test_gpu.py) checks every config it may pick.
    # --tune ([triton] tune) checks what a tuned call runs: the table's config, else tuned now.
    pinned = kernels.LaunchConfig(cfg.triton.block_m, cfg.triton.block_n, cfg.triton.num_warps, cfg.triton.num_stages)
    launch = (pinned if any(v is not None for v in vars(pinned).values())
              else "tune" if cfg.triton.tune else "default")
    for spec in plan.kernels:
        load_kernel(spec, launch, cfg.experiment.deterministic)  # a bad kernel spec is an input error: exit 2, before any case runs

    if not cluster.wanted(cfg.cluster):
        return _run(cfg, plan, console, argv, dev, launch, None)
    with cluster.connect(cfg.cluster, plan.device, cap=cfg.is_set("cluster.workers")) as pool:
        return _run(cfg, plan, console, argv, dev, launch, pool)


def _run(cfg: Config, plan: Plan, console: Console | None, argv: list[str] | None, dev: Any, launch: Any,
         pool: Any) -> Report:
    """The checks of ``plan``, in this process (``pool`` None) or on a Ray pool."""
    from functools import partial

    from flashrun.harness import cluster, precompile
    from flashrun.harness.check import interpreter_bf16_dot_ok, run_job

    # The workers' device decides, not this process's: a CPU driver may steer a GPU cluster.
    kind = dev.kind if pool is None else pool.kind
    interpreter = dev.interpreter if pool is None else not pool.gpus
    notices = [dev.notice] if dev.notice and (pool is None or interpreter) else []
    if pool is not None:
        notices += [f"running on {pool.description}", *pool.notices]

    bf16_ok = True
    if interpreter and dev.interpreter and any(c.dtype == "bfloat16" for c in plan.cases):
        bf16_ok = interpreter_bf16_dot_ok()
        if not bf16_ok:
            notices.append("this Triton's interpreter computes bfloat16 tl.dot wrongly (probe failed): flash and "
                           "minimal upcast those dots to float32 there; your own kernels' bfloat16 cases are skipped")
    if interpreter:
        notices.append("through the interpreter, `first s` is its wall time and `ms` is not measured: "
                       "interpreter timings say nothing about a GPU")

    job_device = plan.device if pool is None else pool.kind  # "cpu" keeps a worker off a GPU it was not given
    jobs = [Job(index, spec, case, plan.seed + index // len(plan.kernels), plan.grad, plan.diagnose, job_device,
                launch, cfg.experiment.deterministic, bf16_ok or not interpreter,
                interpreter_seconds(case, plan.grad and not case.forward_only) if interpreter else None)
            for index, (case, spec) in enumerate((c, s) for c in plan.cases for s in plan.kernels)]
    # every kernel sees the same inputs per case: the seed is seed + case number
    over = [job for job in jobs if job.estimate_s is not None and 0 < plan.budget_s < job.estimate_s]
    if over:
        notices.append(f"{len(over)} check(s) skipped: expected to take longer than the interpreter budget of "
                       f"{plan.budget_s:g} s per case (run them on a GPU, or raise it: --budget SECONDS, 0 for none)")
    results = [_over_budget(job, plan.budget_s) for job in over]
    todo = [job for job in jobs if job not in over]
    if console is not None:
        for notice in notices:
            console.print(f"[yellow]note:[/] {escape(notice)}")

    report = Report([], kind + (" (Triton interpreter)" if interpreter else ""), notices,
                    planned=len(jobs), interpreter=interpreter)
    execute = _serial if pool is None else partial(cluster.checks, pool)
    if pool is not None:  # longest first: the run then ends on short checks, not on one long one
        todo.sort(key=lambda job: -(job.estimate_s or 0.0))  # stable: plan order on a GPU
    with _Reporter(console, len(jobs)) as reporter:
        for result in results:
            reporter.finished(result)
        # flashrun's kernels for every check, compiled at once; each check starts when its own are ready
        ahead = precompile.for_verify(todo, dev.kind, pool, reporter.compiling)
        started = time.perf_counter()
        try:
            for result in execute(todo, reporter, ahead.run(run_job)):
                results.append(result)
                reporter.finished(result)  # shown once kept: a Ctrl-C never drops a check already shown
        except KeyboardInterrupt:
            report.interrupted = True
            ahead.cancel()
        report.run_s = time.perf_counter() - started
        report.compiled = ahead.close()
    report.results = sorted(results, key=lambda r: r.index)
    report.run_id = _record(cfg, plan, report, argv)
    return report


def _serial(jobs: list[Job], reporter: _Reporter, run_job: Any) -> Iterator[CaseResult]:
    """Run the jobs one after the other in this process, yielding each result as it finishes."""
    for job in jobs:
        reporter.started(job)
        yield run_job(job)


def _over_budget(job: Job, budget_s: float) -> CaseResult:
    minutes = f"{job.estimate_s / 60:.1f} min" if job.estimate_s >= 60 else f"{job.estimate_s:.0f} s"
    return CaseResult(job.kernel, job.case, "skipped", index=job.index,
                      message=f"expected to take about {minutes} through the interpreter, over the budget of "
                              f"{budget_s:g} s (--budget 0 runs it anyway)")


_STYLE = {"pass": "green", "fail": "red", "error": "red", "oom": "red", "unsupported": "yellow", "skipped": "yellow"}


class _Reporter:
    """Progress while checks run: on a terminal a bar (and pass/fail lines as cases finish);
    anywhere else (a pipe, a log file, CI) one plain line per finished case, like ``pytest -v``."""

    def __init__(self, console: Console | None, total: int) -> None:
        self.console = console
        self.live = console is not None and console.is_terminal and total > 1
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True, disable=not self.live)
        self.task = self.progress.add_task("verify", total=total)
        self.compile_task: Any = None
        self._lock = threading.Lock()

    def compiling(self, done: int, total: int, workers: int) -> None:
        """The compile step's own bar, "compiling 23 kernels, 16 workers", gone once all are ready
        (called from the compile threads too)."""
        from flashrun.harness.precompile import describe

        with self._lock:
            if self.compile_task is None and done < total:
                self.compile_task = self.progress.add_task(describe(total, workers), total=total)
            if self.compile_task is not None:
                self.progress.update(self.compile_task, completed=done, total=total,
                                     description=describe(total, workers))
                if done >= total:
                    self.progress.remove_task(self.compile_task)
                    self.compile_task = None

    def __enter__(self) -> _Reporter:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def started(self, job: Job) -> None:
        if self.console is not None and job.estimate_s is not None and job.estimate_s > SLOW_CASE_S:
            self.console.print(f"[yellow]note:[/] {escape(job.case.label)} will take about "
                               f"{job.estimate_s / 60:.1f} min through the interpreter")
        self.progress.update(self.task, description=f"{job.kernel} {job.case.label}")

    def finished(self, result: CaseResult) -> None:
        if self.console is not None:
            took = f"  {result.first_call_s:.2f} s" if result.first_call_s is not None else ""
            why = f"  {result.message}" if result.status != "pass" and result.message else ""
            self.console.print(f"[{_STYLE[result.status]}]{result.status.upper():<11}[/] "
                               f"{escape(result.kernel)} {escape(result.case.label)}{took}{escape(why)}",
                               highlight=False)
        self.progress.advance(self.task)


def reproduce_command(kernel: str, shape: Shape, seed: int, grad: bool) -> str:
    """The ``flashrun verify`` command that checks ``kernel`` on ``shape`` with the inputs that
    ``seed`` draws (bench and verify share one input generator)."""
    values = shape.to_json()
    keys = [*FIELDS, *(key for key in VARIANT_FIELDS if values[key] != PLAIN[key])]  # variants when present
    sets = " ".join(f"--set experiment.{key}={_toml(values[key])}" for key in keys)
    return f"flashrun verify -k {kernel} --seed {seed}{' --grad' if grad else ''} {sets}"


def _toml(value: Any) -> str:
    """A value as ``--set`` parses it back (TOML, no spaces)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _record(cfg: Config, plan: Plan, report: Report, argv: list[str] | None) -> str:
    from flashrun.records.runlog import append_record, make_record

    plan_json = {**{f.name: getattr(plan, f.name) for f in fields(plan)}, "cases": [asdict(c) for c in plan.cases]}
    record = make_record(
        "verify", argv or [], cfg.public_dict(),
        {"verdict": report.verdict, "passed": report.passed, "failed": report.failed, "device": report.device,
         "interrupted": report.interrupted, "checks": [r.to_json() for r in report.results],
         "compile": report.compiled.to_json() if report.compiled is not None else None},
        kernels=plan.kernels, n_cases=len(plan.cases), plan=plan_json,
    )
    append_record(cfg.logging.log_dir, record)
    return record["id"]


# ---------------------------------------------------------------------------------------------
# Rendering


def render(report: Report, console: Console, verbose: bool = False) -> None:
    """The results table, then each case's message and notes (and with ``verbose`` the traceback
    of a kernel that raised). Numbers never wrap or get cut: when the console is narrow (80
    columns, a pipe) the case label wraps; the kernel heads a section instead of taking a
    column; the NaN/unwritten counts appear only when some check has any, ``ms`` only when
    measured (GPU)."""
    several = len({r.kernel for r in report.results}) > 1
    flagged = any(c.nonfinite or c.unwritten for r in report.results for c in r.checks)
    # max err: the worst tensor's max |kernel - ref|; ×torch: that error over PyTorch's own in the
    # same dtype (the yardstick); nan: NaN/Inf values; unwr: elements the kernel never wrote
    columns = ["case", "result", "max err", "rel L2", "×torch", *(("nan", "unwr") if flagged else ()), "first s",
               *(("ms",) if any(r.ms is not None for r in report.results) else ())]  # ms: GPU only
    table = Table(title=f"verify on {report.device}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    for name in columns:
        if name == "case":
            table.add_column(name, overflow="fold")
        else:
            table.add_column(name, justify="left" if name == "result" else "right", no_wrap=True)
    kernel = None
    order = {name: i for i, name in enumerate(dict.fromkeys(r.kernel for r in report.results))}
    for r in sorted(report.results, key=lambda r: order[r.kernel]):  # stable: cases keep their order
        if several and r.kernel != kernel:  # the kernel heads its rows
            table.add_row(f"[bold]{escape(r.kernel)}[/]", *[""] * (len(columns) - 1))
            kernel = r.kernel
        worst = max(r.checks, key=lambda c: (not c.passed, c.max_abs / c.bound if c.bound else 0), default=None)
        cells = {"case": escape(r.case.label), "result": f"[{_STYLE[r.status]}]{r.status}[/]",
                 "first s": "" if r.first_call_s is None else f"{r.first_call_s:.2f}",
                 "ms": "" if r.ms is None else f"{r.ms:.3f}"}
        if worst is not None:
            cells.update({
                "max err": f"{worst.max_abs:.2e}" + ("" if len(r.checks) == 1 else f" {worst.name}"),
                "rel L2": f"{worst.rel_l2:.2e}", "×torch": "" if worst.ratio is None else f"{worst.ratio:.2f}x",
                "nan": str(sum(c.nonfinite for c in r.checks)), "unwr": str(sum(c.unwritten for c in r.checks)),
            })
        table.add_row(*(cells.get(name, "") for name in columns))
    console.print(table)
    for r in report.results:
        for line in ([r.message] if r.message else []) + r.notes:
            console.print(f"  [dim]{escape(r.kernel)} {escape(r.case.label)}:[/] {escape(line)}")
        if verbose and r.traceback:
            console.print(escape(r.traceback.rstrip()), style="dim")
    sources = _config_sources(report.results)
    if sources:
        console.print(f"launch configs: {escape(sources)}", highlight=False)  # "[triton]" is not markup
    if report.compiled is not None:
        ran = f"; the checks ran {report.run_s:.1f} s" if report.run_s is not None else ""
        console.print(f"{report.compiled.line()}{ran}", highlight=False)
    style = "green" if report.exit_code == 0 else "red"
    console.print(f"[{style}]{report.verdict}[/]" + (f"  (run {report.run_id})" if report.run_id else ""))


_SOURCE_SAID = {"table": "from the tuned table", "tuned": "tuned here", "heuristic": "heuristic (not in the table; "
                "--tune tunes them)", "default": "each kernel's default", "pinned": "pinned by [triton]",
                "interpreter": "the interpreter's"}


def _config_sources(results: list[CaseResult]) -> str:
    """Where the checks' launch configs came from, counted over kernel launches: "each kernel's
    default (12)"; empty when no check says."""
    counts: dict[str, int] = {}
    for r in results:
        for chosen in r.configs.values():
            counts[chosen["source"]] = counts.get(chosen["source"], 0) + 1
    if set(counts) <= {"interpreter"}:  # nothing to say: the interpreter has one small config
        return ""
    return ", ".join(f"{_SOURCE_SAID.get(source, source)} ({n})" for source, n in counts.items())
