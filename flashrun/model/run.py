"""``flashrun model``: a kernel inside real transformer models - the same logits, training and
generation as the model's own attention, and the end-to-end speed and memory.

:func:`make_plan` resolves ``[model]`` (a family and size, or a local checkpoint) into a
:class:`Plan`; :func:`run` selects the device, loads the kernel, registers it with transformers
(:mod:`flashrun.model.swap`), builds or loads the model, runs the checks
(:mod:`flashrun.model.checks`) and on a GPU the timings (:mod:`flashrun.model.speed`), and records
the run (``--rerun`` repeats it). Ctrl-C keeps the checks that finished. :func:`render` prints
the tables.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashrun.config import Config
from flashrun.errors import InputError, ModelError
from flashrun.harness.results import check_plot_target
from flashrun.limits import BUILTIN_KERNELS
from flashrun.model.families import FAMILIES

MIN_TRANSFORMERS = (5, 17)  # the oldest version tested (the GPU image's); AttentionInterface as in 5.x
INSTALL_HINT = "pip install 'flashrun[model]'   (or: pip install 'transformers>=5.17,<6')"


@dataclass(frozen=True)
class Plan:
    """Everything a run needs besides the config, resolved: enough to repeat it from its record."""

    arch: str | None  # None with a local checkpoint
    size: str | None
    path: str | None
    kernel: str
    dtype: str  # "auto" until the device is known
    device: str
    batch: int
    seq_len: int
    gen_tokens: int
    sliding_window: int | None
    checks: tuple[str, ...]
    train_steps: int
    lr: float
    speed: bool
    baselines: tuple[str, ...]
    reps: int
    seed: int

    @property
    def label(self) -> str:
        return self.path or f"{self.arch} {self.size}"


def make_plan(cfg: Config) -> Plan:
    m = cfg.model
    size = FAMILIES[m.arch].sizes[m.size]
    return Plan(None if m.path else m.arch, None if m.path else m.size, m.path, m.kernel, m.dtype,
                cfg.experiment.device, m.batch or size.batch, m.seq_len or size.seq_len,
                m.gen_tokens or size.gen_tokens, m.sliding_window, tuple(m.checks), m.train_steps,
                m.lr or size.lr, m.speed, tuple(m.baselines), m.reps, m.seed)


def plan_from_record(record: dict[str, Any]) -> tuple[Config, Plan]:
    if record.get("command") != "model" or "plan" not in record:
        raise InputError(f"run {record.get('id')} is a {record.get('command')} run, not a model run",
                         hint="`flashrun runs` lists the runs; pick a model one")
    stored = record["plan"]
    plan = Plan(**{**stored, "checks": tuple(stored["checks"]), "baselines": tuple(stored["baselines"])})
    return Config.model_validate(record["config"]), plan


@dataclass
class Report:
    plan: Plan
    model: dict[str, Any] = field(default_factory=dict)  # what was built or loaded
    checks: list[Any] = field(default_factory=list)  # checks.Check
    speed: list[Any] = field(default_factory=list)  # speed.SpeedRow
    notices: list[str] = field(default_factory=list)
    run_id: str | None = None
    interrupted: bool = False
    files: list[str] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def failed(self) -> int:
        return sum(not c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed"
        return text + (" (interrupted)" if self.interrupted else "")

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "verdict": self.verdict, "passed": self.passed, "failed": self.failed,
                "interrupted": self.interrupted, "model": self.model, "plan": asdict(self.plan),
                "notices": self.notices, "checks": [c.to_json() for c in self.checks],
                "speed": [r.to_json() for r in self.speed], "files": self.files}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError("flashrun model needs transformers, which is not installed", hint=INSTALL_HINT) from None
    version = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ModelError(f"flashrun model needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, found "
                         f"{transformers.__version__}", hint=INSTALL_HINT)
    return transformers


def run(cfg: Config, plan: Plan, console: Console | None = None, argv: list[str] | None = None) -> Report:
    from flashrun import device as devices

    say: Callable[[str], None] = (lambda text: console.print(text, highlight=False)) if console else (lambda _: None)
    transformers = _transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    dev = devices.select(plan.device)
    import torch

    from flashrun import kernels
    from flashrun.model import checks, data, speed, swap

    plan = replace(plan, device=dev.kind, dtype=_dtype(plan.dtype, dev))
    report = Report(plan)
    if dev.notice:
        report.notices.append(dev.notice)
    kernel = kernels.get(plan.kernel, deterministic=cfg.experiment.deterministic)
    _refuse_interpreter_bf16(plan, kernel, dev)
    registered = swap.register(kernel)
    dtype = getattr(torch, plan.dtype)
    model, report.model, baseline, unfaithful = _load(plan, dtype, dev.kind, transformers)
    report.notices += [f"baseline {baseline}: {why}" for why in unfaithful.values()]
    subject = checks.Subject.of(model, baseline, torch.float64 if dev.kind == "cpu" else torch.float32)
    rows = data.copy_task(model.config.vocab_size, plan.batch, plan.seq_len, plan.seed).to(dev.kind)
    steps: list[tuple[str, Callable[[], Any]]] = []
    if "logits" in plan.checks:
        steps += [("logits", lambda: checks.check_logits(subject, rows)),
                  ("logits-padded", lambda: checks.check_logits(subject, data.padded(rows).to(dev.kind),
                                                                "logits-padded")),
                  ("logits-packed", lambda: checks.check_logits(subject, data.packed(rows).to(dev.kind),
                                                                "logits-packed"))]
    if "train-step" in plan.checks:
        steps.append(("train-step", lambda: checks.check_train_step(subject, rows)))
    if "training" in plan.checks:
        steps.append(("training", lambda: checks.check_training(subject, rows, plan.train_steps, plan.lr)))
    if "generate" in plan.checks:
        steps.append(("generate", lambda: checks.check_generate(subject, rows, plan.gen_tokens)))
    if "generate-fp8" in plan.checks:
        steps.append(("generate-fp8", lambda: checks.check_generate_fp8(subject, rows, plan.gen_tokens)))
    try:
        for name, step in steps:
            start = time.perf_counter()
            result = checks.guarded(name, step)
            result.detail["seconds"] = round(time.perf_counter() - start, 2)
            report.checks.append(result)
            say(f"  {'[green]pass[/]' if result.passed else '[red]FAIL[/]'} {name} "
                f"({result.detail['seconds']:.1f} s)")
        if plan.speed and dev.kind == "cuda":
            del subject  # the reference copy's memory back before timing
            report.speed = speed.run(model, plan.kernel, list(plan.baselines), baseline, unfaithful, rows, plan.reps,
                                     progress=lambda text: say(f"  {text}"), fp8_kv=plan.kernel in BUILTIN_KERNELS)
        elif plan.speed:
            report.notices.append("speed is measured on a GPU only (interpreter timings mean nothing)")
    except KeyboardInterrupt:
        report.interrupted = True
    report.model["kernel_calls"] = dict(registered.calls)  # proof that the kernel ran, and how
    if report.speed:
        report.files = _write_speed(cfg, report)
    report.run_id = _record(cfg, report, argv or [])
    return report


def _dtype(requested: str, dev: Any) -> str:
    if requested != "auto":
        return requested
    return "float32" if dev.interpreter else "bfloat16"


def _refuse_interpreter_bf16(plan: Plan, kernel: Any, dev: Any) -> None:
    if dev.interpreter and plan.dtype == "bfloat16" and kernel.name not in BUILTIN_KERNELS:
        from flashrun.harness.check import interpreter_bf16_dot_ok

        if not interpreter_bf16_dot_ok():
            raise InputError("this Triton's CPU interpreter computes bfloat16 tl.dot wrongly, so a bfloat16 model "
                             f"cannot judge {kernel.name} here", hint="use --set model.dtype=float32 on the CPU")


def _load(plan: Plan, dtype: Any, device: str, transformers: Any) -> tuple[Any, dict, str, dict[str, str]]:
    """(model, what it is, baseline attention, baselines that would not compute the same model)."""
    from flashrun.model import families

    if plan.path is None:
        config = families.build_config(plan.arch, plan.size, sliding_window=plan.sliding_window)
        model = families.build(config, dtype, device, plan.seed)
        source = {"arch": plan.arch, "size": plan.size, "weights": f"random (seed {plan.seed}), q/k sharpened"}
    else:
        model = _pretrained(plan.path, dtype, device, plan.sliding_window, transformers)
        config = model.config
        source = {"path": plan.path, "weights": "checkpoint"}
    softcap = getattr(config, "attn_logit_softcapping", None)
    baseline = "eager" if softcap else "sdpa"
    unfaithful = {"sdpa": "SDPA cannot apply the attention softcap, so eager is the baseline"} if softcap else {}
    info = {**source, "model_type": config.model_type, "parameters": sum(p.numel() for p in model.parameters()),
            "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "sliding_window": getattr(config, "sliding_window", None), "softcap": softcap,
            "transformers": transformers.__version__, "baseline": baseline}
    return model, info, baseline, unfaithful


def _pretrained(path: str, dtype: Any, device: str, sliding_window: int | None, transformers: Any) -> Any:
    """A local checkpoint folder, or a hub id already in the local cache - never a download."""
    from flashrun.model import swap

    where = Path(path).expanduser()
    overrides = {"sliding_window": sliding_window} if sliding_window else {}
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(where) if where.is_dir() else path, local_files_only=True, dtype=dtype, attn_implementation=swap.NAME,
            **overrides).to(device).eval()
    except OSError as exc:
        if where.is_dir():
            raise ModelError(f"{path} holds no loadable model: {str(exc).splitlines()[0]}",
                             hint="a checkpoint folder has config.json and the weights (*.safetensors)") from None
        if not _hub_id(path):  # a path, not an id: fetching cannot help
            raise ModelError(f"{path}: no such folder",
                             hint="--model takes a checkpoint folder (config.json and the weights) or the id of a "
                                  "model in the local Hugging Face cache") from None
        raise ModelError(f"{path} is neither a local folder nor a model in the local Hugging Face cache",
                         hint=f"flashrun downloads nothing: fetch it first (`hf download {path}`), then pass the id "
                              "or the folder") from None


def _hub_id(name: str) -> bool:
    """Whether ``name`` could be a Hugging Face repo id (``name`` or ``namespace/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # (transformers depends on it)

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _write_speed(cfg: Config, report: Report) -> list[str]:
    from flashrun.records.files import atomic_write_json, atomic_write_text
    from flashrun.records.runlog import new_run_id

    out = Path(cfg.model.out or Path(cfg.logging.log_dir) / "model")
    stem = out / f"speed-{report.plan.label.replace('/', '_').replace(' ', '-')}-{new_run_id()}"
    rows = [r.to_json() for r in report.speed]
    columns = list(rows[0])
    lines = [",".join(columns)] + [",".join("" if r[c] is None else str(r[c]).replace(",", ";") for c in columns)
                                   for r in rows]
    atomic_write_text(stem.with_suffix(".csv"), "\n".join(lines) + "\n")
    atomic_write_json(stem.with_suffix(".json"), {"model": report.model, "plan": asdict(report.plan), "rows": rows})
    return [str(stem.with_suffix(".csv")), str(stem.with_suffix(".json"))]


def _record(cfg: Config, report: Report, argv: list[str]) -> str:
    from flashrun.records.runlog import append_record, make_record

    record = make_record("model", argv, cfg.public_dict(), report.to_json(), plan=asdict(report.plan),
                         kernels=[report.plan.kernel], n_cases=len(report.checks))
    append_record(cfg.logging.log_dir, record)
    return record["id"]


# -- output ----------------------------------------------------------------------------------------


def render(report: Report, console: Console) -> None:
    for notice in report.notices:
        console.print(f"[yellow]note:[/] {escape(notice)}")
    m = report.model
    console.print(f"[bold]{escape(report.plan.label)}[/] ({m.get('model_type')}, {m.get('parameters', 0) / 1e6:.1f}M "
                  f"parameters, {m.get('layers')} layers, {m.get('heads')}/{m.get('kv_heads')} heads, head_dim "
                  f"{m.get('head_dim')}) in {report.plan.dtype} on {report.plan.device}, kernel "
                  f"{escape(report.plan.kernel)}, against {m.get('baseline')}")
    if report.checks:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False)
        table.add_column("check", no_wrap=True)
        table.add_column("result", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for c in report.checks:
            table.add_row(c.name, "[green]pass[/]" if c.passed else "[red]FAIL[/]", escape(c.summary))
        console.print(table)
    if report.speed:
        _render_speed(report, console)
    for path in report.files:
        console.print(f"wrote {escape(path)}")
    console.print(f"[bold]{report.verdict}[/]" + (f" (run {report.run_id})" if report.run_id else ""))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _render_speed(report: Report, console: Console) -> None:
    """The speed table, each column as wide as its widest cell (ids and numbers never cut at 80
    columns), and under it why a row did not run."""
    b = report.plan
    columns = (("attention", "left"), ("train ms", "right"), ("x", "right"), ("train GiB", "right"),
               ("prefill ms", "right"), ("x", "right"), ("decode tok/s", "right"))
    rows = [(r.attention, _fmt(r.train_ms), _fmt(r.speedup_train, 2), _fmt(r.train_peak_gib), _fmt(r.prefill_ms),
             _fmt(r.speedup_prefill, 2), _fmt(r.decode_tok_s, 0)) for r in report.speed]
    table = Table(title=f"speed, batch {b.batch} x {b.seq_len} tokens", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)
    for i, (name, justify) in enumerate(columns):
        table.add_column(name, justify=justify, no_wrap=True, min_width=max(len(name), *(len(row[i]) for row in rows)))
    for row in rows:
        table.add_row(*map(escape, row))
    console.print(table)
    for r in report.speed:
        if r.status != "ok":
            console.print(f"  {escape(r.attention)}: {r.status}, {escape(r.note)}", highlight=False)


def plot(report: Report, path: Path) -> Path:
    """Bars per attention implementation: training-step time, prefill time, decode tokens/s and
    the training step's peak memory. Rows that did not run are left out, and so is a phase a row
    does not time (the e4m3 KV cache's row: decode only)."""
    check_plot_target(path)
    from matplotlib.figure import Figure

    rows = [r for r in report.speed if r.status == "ok"]
    panels = (("train_ms", "train step (ms)"), ("prefill_ms", "prefill (ms)"), ("decode_tok_s", "decode (tokens/s)"),
              ("train_peak_gib", "train peak memory (GiB)"))
    figure = Figure(figsize=(4 * len(panels), 3.6), layout="constrained")
    names = [r.attention for r in rows]
    for axes, (attr, title) in zip(figure.subplots(1, len(panels)), panels):
        heights = [math.nan if getattr(r, attr) is None else getattr(r, attr) for r in rows]
        axes.bar(range(len(rows)), heights, color="tab:blue")
        axes.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        axes.set_title(title, fontsize=10)
    figure.suptitle(f"{report.plan.label}, {report.plan.dtype}, batch {report.plan.batch} x {report.plan.seq_len}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
