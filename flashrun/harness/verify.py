"""``flashrun verify``: run attention kernels against a high-precision reference.

For each case and kernel: fresh seeded random inputs; the kernel gets clones (so it cannot
corrupt what the reference sees) and runs with every fresh allocation poisoned, so an element
it never writes shows up; the reference runs in float64 (CPU) or float32 (GPU); PyTorch's own
maths in the kernel's dtype is the yardstick; :class:`flashrun.harness.judge.Reference` judges. ``--grad`` does
the same for dq, dk, dv.
"""

from __future__ import annotations

import inspect
import math
import os
import time
import traceback as tb_module
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

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
from flashrun.errors import InputError, KernelError
from flashrun.harness.shapes import FIELDS, Shape, verify_shapes

POISON = 7168.0  # exact in fp16/bf16/fp32 and far outside any attention output of these inputs
SLOW_CASE_S = 30.0  # warn before an interpreter case expected to take longer than this


@dataclass(frozen=True)
class Plan:
    """Everything a run needs besides the config: enough to repeat it from its record."""

    kernels: list[str]
    cases: list[Shape]
    grad: bool
    diagnose: bool
    device: str
    seed: int


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
                device or cfg.experiment.device, cfg.experiment.seed)


def plan_from_record(record: dict[str, Any]) -> tuple[Config, Plan]:
    """The config and plan stored in a verify run record (``--rerun``)."""
    if record.get("command") != "verify" or "plan" not in record:
        raise InputError(f"run {record.get('id')} is a {record.get('command')} run, not a verify run",
                         hint="`flashrun runs` lists the runs; pick a verify one")
    stored = record["plan"]
    config = Config.model_validate(record["config"])
    plan = Plan(stored["kernels"], [Shape(**c) for c in stored["cases"]], stored["grad"], stored["diagnose"],
                stored["device"], stored["seed"])
    return config, plan


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    kernel: str
    case: Shape
    status: str  # pass | fail | error | oom | unsupported | skipped
    checks: list[Any] = field(default_factory=list)  # tolerance.Comparison
    message: str = ""
    seconds: float = 0.0
    logits: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)
    traceback: str | None = None  # the full traceback when the kernel raised (shown with -v)

    def to_json(self) -> dict[str, Any]:
        data = {
            "kernel": self.kernel, "case": asdict(self.case), "label": self.case.label, "status": self.status,
            "message": self.message, "seconds": round(self.seconds, 4), "notes": self.notes,
            "logit_range": list(self.logits) if self.logits else None,
            "checks": [c.to_json() for c in self.checks],
        }
        if self.traceback is not None:
            data["traceback"] = self.traceback
        return data


@dataclass
class Report:
    results: list[CaseResult]
    device: str
    notices: list[str]
    run_id: str | None = None

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
        return text + (f", {self.skipped} skipped" if self.skipped else "")

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "device": self.device, "notices": self.notices, "verdict": self.verdict,
                "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
                "results": [r.to_json() for r in self.results]}


# ---------------------------------------------------------------------------------------------
# Running


def _poisoned_allocations():
    """A dispatch mode that fills every fresh floating-point allocation with POISON."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class PoisonEmpty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func.overloadpacket.__name__.startswith(("empty", "new_empty"))
                    and isinstance(out, torch.Tensor) and out.is_floating_point()):
                out.fill_(POISON)
            return out

    return PoisonEmpty()


def interpreter_seconds(case: Shape, grad: bool) -> float:
    """Rough time of one case through the interpreter (measured on a 2-core CPU, block 32)."""
    tiles = case.batch_size * case.num_heads * math.ceil(case.seq_len / 32) * math.ceil(case.seq_len_k / 32)
    per_tile = 2e-3 * max(1.0, case.head_dim / 64)
    return tiles * per_tile * (4.0 if grad else 1.0)


def run(cfg: Config, plan: Plan, console: Console | None, argv: list[str] | None = None) -> Report:
    """Run every (case, kernel) check; write a run record. ``console`` None: no progress output."""
    from flashrun import device as device_mod

    dev = device_mod.select(plan.device)
    notices = [dev.notice] if dev.notice else []
    if console is not None:
        for notice in notices:
            console.print(f"[yellow]note:[/] {notice}")

    from flashrun import kernels

    # [triton] pins flash's launch config; otherwise verify uses each kernel's default config
    # rather than autotuning: every case would compile the tuner's whole space (minutes on a GPU
    # for a sweep), while the GPU suite (tests/test_gpu.py) checks every config it may pick.
    pinned = kernels.LaunchConfig(cfg.triton.block_m, cfg.triton.block_n, cfg.triton.num_warps, cfg.triton.num_stages)
    launch = pinned if any(v is not None for v in vars(pinned).values()) else "default"
    loaded: dict[str, Any] = {}
    for spec in plan.kernels:
        loaded[spec] = kernels.get(spec, launch)  # a bad kernel spec is an input error: exit 2

    bf16_ok = True
    if dev.interpreter and any(c.dtype == "bfloat16" for c in plan.cases):
        bf16_ok = _interpreter_bf16_dot_ok()
        if not bf16_ok:
            notices.append("this Triton's interpreter computes bfloat16 tl.dot wrongly (probe failed): flash and "
                           "minimal upcast those dots to float32 there; your own kernels' bfloat16 cases are skipped")

    results: list[CaseResult] = []
    jobs = [(case, spec) for case in plan.cases for spec in plan.kernels]
    progress = _progress(console, len(jobs))
    with progress:
        task = progress.add_task("verify", total=len(jobs))
        for index, (case, spec) in enumerate(jobs):
            if dev.interpreter and console is not None:
                eta = interpreter_seconds(case, plan.grad)
                if eta > SLOW_CASE_S:
                    console.print(f"[yellow]note:[/] {case.label} will take about {eta / 60:.1f} min "
                                  "through the interpreter")
            progress.update(task, description=f"{spec} {case.label}")
            seed = plan.seed + index // len(plan.kernels)  # every kernel sees the same inputs per case
            result = check_case(loaded[spec], case, plan, seed, dev.torch_device, bf16_ok or not dev.interpreter)
            results.append(result)
            progress.advance(task)
    report = Report(results, dev.kind + (" (Triton interpreter)" if dev.interpreter else ""), notices)
    report.run_id = _record(cfg, plan, report, argv)
    return report


def _progress(console: Console | None, total: int) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=console is None or total < 2)


def _interpreter_bf16_dot_ok() -> bool:
    import torch

    from flashrun.env import smoke

    return smoke.run("cpu", torch.bfloat16).ok


def check_case(kernel: Any, case: Shape, plan: Plan, seed: int, device: str, bf16_dots_ok: bool) -> CaseResult:
    """One kernel on one case: forward (and backward) against the reference."""
    import torch

    from flashrun.harness.inputs import make_inputs
    from flashrun.harness.judge import Reference
    from flashrun.harness.reference import logit_range

    result = CaseResult(kernel.name, case, "pass")
    if case.dtype == "bfloat16" and not bf16_dots_ok and kernel.name not in ("flash", "minimal"):
        result.status = "skipped"
        result.message = "bfloat16 on this Triton's interpreter: its tl.dot is wrong for bf16; run on a GPU"
        return result
    inputs = make_inputs(case, seed, device)[0]
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.dout
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    if plan.diagnose:  # the range is always shown: "in range" is an answer too
        result.logits = logit_range(q, k, sm_scale)
        low, high = result.logits
        saturates = max(abs(low), abs(high)) > 10
        result.notes.append(f"logits q·kᵀ·scale span [{low:.2f}, {high:.2f}]"
                            + (", outside about ±10: softmax saturates" if saturates else ", within ±10"))
    if not kernel.takes_causal:
        result.notes.append("called as (q, k, v): judged against causal="
                            f"{case.causal} and scale 1/sqrt({case.head_dim})")
    # the kernel works on clones; the reference on the originals
    kq, kk, kv = (t.clone().requires_grad_(plan.grad) for t in (q, k, v))
    start = time.perf_counter()
    try:
        with _poisoned_allocations():
            out = kernel(kq, kk, kv, causal=case.causal, sm_scale=sm_scale)
            if device == "cuda":
                torch.cuda.synchronize()
        _check_output_shape(out, q)
        grads = None
        if plan.grad:
            if not out.requires_grad:
                result.notes.append("forward only: no gradients to check")
            else:
                with _poisoned_allocations():
                    grads = torch.autograd.grad(out, (kq, kk, kv), do)
                    if device == "cuda":
                        torch.cuda.synchronize()
    except KernelError as exc:
        result.status = "unsupported"
        result.message = exc.message + (f" ({exc.hint})" if exc.hint else "")
        return result
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        result.status = "oom"
        result.message = "CUDA out of memory: reduce batch_size/seq_len, or use the tiled kernel (flash)"
        return result
    except Exception as exc:  # noqa: BLE001 - a kernel that raises fails this case, with its message
        result.status = "error"
        where = _kernel_frame(exc, kernel)
        result.message = (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                          + (f" (at {where})" if where else ""))
        result.traceback = "".join(tb_module.format_exception(exc))
        return result
    result.seconds = time.perf_counter() - start

    if grads is not None:
        for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            if g is None or g.shape != t.shape:
                result.status = "fail"
                result.message = f"{name}: expected shape {tuple(t.shape)}, got {None if g is None else tuple(g.shape)}"
                return result
    reference = Reference.for_shape(inputs, case, grads=grads is not None)
    result.checks = reference.judge(out, grads, POISON)
    failing = [c for c in result.checks if not c.passed]
    if failing:
        result.status = "fail"
        result.message = "; ".join(c.reason() for c in failing)
    return result


def _kernel_frame(exc: BaseException, kernel: Any) -> str | None:
    """``path:line in function`` of the innermost frame in the user's kernel file, looking through
    the exceptions it was raised from (Triton's interpreter re-raises a jitted function's error as
    its own): where the user should look. None for flashrun's own kernels or when no frame is there."""
    if kernel.name in ("flash", "minimal"):
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


def reproduce_command(kernel: str, shape: Shape, seed: int, grad: bool) -> str:
    """The ``flashrun verify`` command that checks ``kernel`` on ``shape`` with the inputs that
    ``seed`` draws (bench and verify share one input generator)."""
    values = shape.to_json()
    sets = " ".join(f"--set experiment.{key}={str(values[key]).lower() if isinstance(values[key], bool) else values[key]}"
                    for key in FIELDS)
    return f"flashrun verify -k {kernel} --seed {seed}{' --grad' if grad else ''} {sets}"


def _check_output_shape(out: Any, q: Any) -> None:
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the kernel returned {type(out).__name__}, expected a tensor")
    if out.shape != q.shape:
        raise ValueError(f"the kernel returned shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if out.dtype != q.dtype:
        raise ValueError(f"the kernel returned {out.dtype}, expected {q.dtype}")


def _record(cfg: Config, plan: Plan, report: Report, argv: list[str] | None) -> str:
    from flashrun.records.runlog import append_record, make_record

    plan_json = {**{f.name: getattr(plan, f.name) for f in fields(plan)}, "cases": [asdict(c) for c in plan.cases]}
    record = make_record(
        "verify", argv or [], cfg.public_dict(),
        {"verdict": report.verdict, "passed": report.passed, "failed": report.failed, "device": report.device,
         "checks": [r.to_json() for r in report.results]},
        kernels=plan.kernels, n_cases=len(plan.cases), plan=plan_json,
    )
    append_record(cfg.logging.log_dir, record)
    return record["id"]


# ---------------------------------------------------------------------------------------------
# Rendering

_STYLE = {"pass": "green", "fail": "red", "error": "red", "oom": "red", "unsupported": "yellow", "skipped": "yellow"}


def render(report: Report, console: Console, verbose: bool = False) -> None:
    """The results table, then each case's message and notes (and with ``verbose`` the traceback
    of a kernel that raised)."""
    table = Table(title=f"verify on {report.device}", title_justify="left")
    # max err: the worst tensor's max |kernel - ref|; ×torch: that error over PyTorch's own in the
    # same dtype (the yardstick); nan: NaN/Inf values; unwr: elements the kernel never wrote
    names = ("kernel", "case", "result", "max err", "rel L2", "×torch", "nan", "unwr", "ms")
    rows: list[tuple[CaseResult, list[str]]] = []
    for r in report.results:
        worst = max(r.checks, key=lambda c: (not c.passed, c.max_abs / c.bound if c.bound else 0), default=None)
        ratio = "" if worst is None or worst.ratio is None else f"{worst.ratio:.2f}x"
        cells = [r.kernel, r.case.label, r.status]
        if worst is None:
            cells += ["", "", "", "", "", ""]
        else:
            cells += [f"{worst.max_abs:.2e}" + ("" if len(r.checks) == 1 else f" ({worst.name})"),
                      f"{worst.rel_l2:.2e}", ratio, str(sum(c.nonfinite for c in r.checks)),
                      str(sum(c.unwritten for c in r.checks)), f"{r.seconds * 1e3:.1f}"]
        rows.append((r, cells))
    # A number cut to "1.4…" is another number: the result and number columns keep their full
    # width; kernel and case wrap instead, and when even that does not fit (a pipe is 80 columns)
    # the table grows past the terminal rather than cut a number.
    wrapping = ("kernel", "case")
    widths = {name: max([len(name)] + [len(cells[i]) for _, cells in rows]) for i, name in enumerate(names)}
    for name in names:
        whole = name not in wrapping
        table.add_column(name, justify="left" if name in ("kernel", "case", "result") else "right", no_wrap=whole,
                         overflow="fold", min_width=widths[name] if whole else None)
    needed = sum(min(widths[n], 12) if n in wrapping else widths[n] for n in names) + 3 * len(names) + 1
    if needed > console.width:
        table.width = needed
    for r, cells in rows:
        cells[0] = escape(cells[0])  # a kernel's path may hold [brackets]
        cells[2] = f"[{_STYLE[r.status]}]{r.status}[/]"
        table.add_row(*cells)
    console.print(table)
    for r in report.results:
        for line in ([r.message] if r.message else []) + r.notes:  # messages may quote [brackets]
            console.print(f"  [dim]{escape(r.kernel)} {r.case.label}:[/] {escape(line)}")
        if verbose and r.traceback:
            console.print(escape(r.traceback.rstrip()), style="dim")
    style = "green" if report.exit_code == 0 else "red"
    console.print(f"[{style}]{report.verdict}[/]" + (f"  (run {report.run_id})" if report.run_id else ""))

