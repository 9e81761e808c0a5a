"""The ``flashrun`` command line. Only assembly lives here: each command's work is a function in
its own module, callable from Python. Typed errors become one red line plus a hint here, and
nowhere else. torch and triton are imported inside the commands that need them, never at
import time, so ``--help``, ``--version`` and config errors answer at once.

Exit codes: 0 ok, 1 a check or verification failed, 2 usage/config/input error, 130 interrupted.
"""

from __future__ import annotations

import logging
import sys
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from flashrun import __version__
from flashrun.cli_options import (
    ClusterOpt,
    ConfigOpt,
    DeviceOpt,
    JsonOpt,
    ListOpt,
    SetOpt,
    SettingsOpt,
    TuneOpt,
    VerboseOpt,
    WorkersOpt,
    causal_choice,
    ints,
    split,
)
from flashrun.config import Config, load_config
from flashrun.errors import FlashrunError
from flashrun.records.redact import RedactingFilter, redact
from flashrun.records.runlog import find_record, refuse_rerun_conflicts

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

app = typer.Typer(
    name="flashrun",
    help="Run, verify and benchmark FlashAttention-style Triton kernels on your GPU (or the CPU interpreter).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

def _version_callback(value: bool) -> None:
    if value:
        out.print(f"flashrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Run, verify and benchmark FlashAttention-style Triton kernels."""


@contextmanager
def _boundary(verbose: bool) -> Iterator[None]:
    """Turn typed errors into one red line + hint and an exit code (no traceback unless -v)."""
    try:
        yield
    except FlashrunError as exc:
        if verbose:  # the traceback may quote a server's reply, so it is masked like the rest
            err.print(escape(redact(traceback.format_exc())), markup=True)
        # Messages may quote server text or paths with [brackets]: escape them so rich neither
        # swallows them as markup nor raises on a stray closing tag.
        err.print(f"[bold red]error:[/] {escape(redact(exc.message))}", markup=True)
        if exc.hint:
            err.print(f"[dim]hint:[/] {escape(redact(exc.hint))}")
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("[red]interrupted[/] (results written so far are kept)")
        raise typer.Exit(130) from None


def _setup(config: Path | None, settings: Path | None, sets: list[str] | None, verbose: bool,
           flags: dict[str, Any] | None = None) -> Config:
    cfg = load_config(config, settings, flags, sets)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("flashrun")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else cfg.logging.level.upper())
    for warning in cfg.warnings:
        err.print(f"[yellow]warning:[/] {escape(redact(warning))}")
    return cfg


def _show(report: Any, json_out: bool, render: Callable[[], None]) -> None:
    """A command's report: as JSON on stdout with --json, else rendered for people."""
    if json_out:
        out.print_json(data=report.to_json())
    else:
        render()


# -- verify -------------------------------------------------------------------------------------
@app.command()
def verify(
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    kernel: Annotated[
        Optional[list[str]],
        typer.Option("--kernel", "-k", help="flash | flash-atomic | minimal | PATH.py:FUNCTION (repeatable).",
                     show_default=False),
    ] = None,
    cases: Annotated[
        Optional[Path], typer.Option("--cases", help="Cases file written by `flashrun gen-cases`.", show_default=False)
    ] = None,
    grad: Annotated[bool, typer.Option("--grad", help="Also check dq, dk, dv.")] = False,
    diagnose: Annotated[bool, typer.Option("--diagnose", help="Report the logit range of q·kᵀ·scale.")] = False,
    budget: Annotated[Optional[float], typer.Option(
        "--budget", help="Through the CPU interpreter, skip cases expected to take longer than this many seconds "
        "(default verify.budget_s = 120; 0 runs everything).", show_default=False)] = None,
    device: DeviceOpt = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed.", show_default=False)] = None,
    rerun: Annotated[Optional[str], typer.Option(
        "--rerun", help="Repeat a recorded run exactly (see `flashrun runs`); options that would change its plan "
        "are refused.", show_default=False)] = None,
    tune: TuneOpt = False,
    workers: WorkersOpt = None,
    cluster: ClusterOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Check attention kernels against a float64 reference, forward (and backward with --grad).

    Examples:

      flashrun verify                                # the shipped default config

      flashrun verify --config configs/article.toml  # the article's check

      flashrun verify -k experiments/my_attention.py:attention --grad

      flashrun verify --set experiment.seq_len=1025 --set experiment.dtype=bf16

      flashrun verify --workers 4 --set verify.seq_len=[1,17,97,1025]  # on Ray

      flashrun verify --cluster auto --grad          # an existing Ray cluster
    """
    from flashrun.harness import verify as verify_mod

    flags = {"experiment.kernel": split(kernel) or None, "experiment.device": device, "experiment.seed": seed,
             "verify.grad": grad or None, "verify.diagnose": diagnose or None, "verify.budget_s": budget,
             "triton.tune": tune or None, "cluster.workers": workers, "cluster.address": cluster}
    with _boundary(verbose):
        if rerun is not None:
            refuse_rerun_conflicts(rerun, {"--kernel": kernel, "--cases": cases, "--grad": grad or None,
                                            "--diagnose": diagnose or None, "--device": device, "--seed": seed,
                                            "--tune": tune or None}, sets)
        cfg = _setup(config, settings, sets, verbose, flags)
        if rerun is not None:
            if config is not None or settings is not None:  # they only say where the record is
                given = "--config" if config is not None else "--settings"
                err.print(f"[yellow]note:[/] --rerun repeats the recorded config; {given} only located "
                          f"{escape(str(cfg.logging.log_dir))}")
            cfg, plan = verify_mod.plan_from_record(find_record(cfg.logging.log_dir, rerun))
        else:
            plan = verify_mod.make_plan(cfg, cases)
        report = verify_mod.run(cfg, plan, console=None if json_out else err, argv=sys.argv[1:])
        _show(report, json_out, lambda: verify_mod.render(report, out, verbose=verbose))
        raise typer.Exit(report.exit_code)


# -- check-env ----------------------------------------------------------------------------------
@app.command("check-env")
def check_env(
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    online: Annotated[bool, typer.Option("--online", help="Also send one minimal request to the gateway.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Diagnose the Python, PyTorch, CUDA, driver, Triton, ptxas, GPU and API-key setup.

    Every problem comes with a fix hint; a tiny Triton kernel compiled and run
    (through the CPU interpreter when there is no GPU) proves the stack. Exit 1
    when a check fails; a missing API key fails only with --online.

    Examples:

      flashrun check-env

      flashrun check-env --online          # also ask the gateway for its models

      flashrun check-env --json | jq '.checks[] | select(.status != "ok")'
    """
    from flashrun.env import report as envreport

    with _boundary(verbose):
        cfg = _setup(config, settings, sets, verbose)
        # No spinner when stdout is JSON or when -v logs to the same terminal.
        with nullcontext() if json_out or verbose else err.status("checking the environment..."):
            report = envreport.run_checks(cfg, online=online)
        _show(report, json_out, lambda: envreport.render(report, out))
        envreport.record(cfg, report, sys.argv[1:])
        raise typer.Exit(report.exit_code)


# -- gen-cases ----------------------------------------------------------------------------------
@app.command("gen-cases")
def gen_cases(
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    model: Annotated[
        Optional[list[str]],
        typer.Option("--model", "-m", help="Model to ask, as the gateway spells it (repeatable; default "
                     "api.default_model).", show_default=False),
    ] = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="Ask every model in api.models.")] = False,
    count: Annotated[
        Optional[int],
        typer.Option("--count", "-n", help="Cases per model (default cases.count); caps --offline's set.",
                     show_default=False),
    ] = None,
    max_seq_len: Annotated[
        Optional[int], typer.Option("--max-seq-len", help="Largest seq_len to accept (default cases.max_seq_len).",
                                    show_default=False),
    ] = None,
    prompt: Annotated[
        Optional[str], typer.Option("--prompt", help="What to ask for (the JSON format is always requested).",
                                    show_default=False),
    ] = None,
    out_file: Annotated[Path, typer.Option("--out", "-o", help="Cases file to write.")] = Path("cases.json"),
    offline: Annotated[bool, typer.Option("--offline", help="Built-in edge cases; no gateway, no key.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the cases file if it exists.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Ask gateway models for test cases, validate them, save them with provenance.

    An existing cases file is never overwritten without --force.

    Examples:

      flashrun gen-cases                        # api.default_model -> cases.json

      flashrun gen-cases --all-models --count 20  # compare models

      flashrun gen-cases -m gpt-4o -m deepseek-chat --max-seq-len 4096

      flashrun gen-cases --offline && flashrun verify --cases cases.json
    """
    from flashrun.gateway import gencases

    with _boundary(verbose):
        flags = {"cases.count": count, "cases.max_seq_len": max_seq_len, "cases.prompt": prompt}
        cfg = _setup(config, settings, sets, verbose, flags)
        # The status line goes to stderr (never into --json's stdout); not with -v, whose logs share it.
        report = gencases.run(cfg, model, all_models, out=out_file, offline=offline, force=force,
                              console=None if verbose else err)
        _show(report, json_out, lambda: gencases.render(report, out, err))
        if report.error is not None:
            raise report.error
        raise typer.Exit(report.exit_code)


# -- bench --------------------------------------------------------------------------------------
@app.command()
def bench(
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    kernel: Annotated[ListOpt, typer.Option(
        "--kernel", "-k", help="Add a kernel: flash | flash-atomic | minimal | PATH.py:FUNCTION (repeatable).",
        show_default=False)] = None,
    provider: Annotated[ListOpt, typer.Option(
        "--provider", "-p", help="Providers instead of \\[bench].providers (repeatable or comma-separated).",
        show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option(
        "--baseline", help="Speedups are against this provider (default sdpa; always measured).",
        show_default=False)] = None,
    mode: Annotated[ListOpt, typer.Option(
        "--mode", help="fwd | bwd | fwd_bwd (repeatable or comma-separated).", show_default=False)] = None,
    dtype: Annotated[ListOpt, typer.Option(
        "--dtype", help="float16 | bfloat16 | float32, or fp16 | bf16 | fp32 (repeatable or comma-separated).",
        show_default=False)] = None,
    seq_lens: Annotated[ListOpt, typer.Option(
        "--seq-lens", help="Query lengths, e.g. 512,1024 (repeatable).", show_default=False)] = None,
    seq_lens_k: Annotated[ListOpt, typer.Option(
        "--seq-lens-k", help="Key lengths for decode-like shapes, e.g. 4096,16384 (default: = query length).",
        show_default=False)] = None,
    head_dims: Annotated[ListOpt, typer.Option(
        "--head-dims", help="Head dimensions, e.g. 64,128 (repeatable).", show_default=False)] = None,
    causal: Annotated[Optional[str], typer.Option("--causal", help="yes | no | both.", show_default=False)] = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="auto | cuda | cpu (cpu times only torch-naive, sdpa and sdpa-math).",
        show_default=False)] = None,
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="Folder for the CSV and JSON results (default <log_dir>/bench).", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Also draw TFLOP/s against sequence length into this image (e.g. bench.png), and on a "
        "GPU the roofline next to it (bench-roofline.png).",
        show_default=False)] = None,
    compare: Annotated[Optional[list[Path]], typer.Option(
        "--compare", help="Print ratios against an earlier results file (.csv or .json; repeatable).",
        show_default=False)] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="After timing each cell, read why: each Triton kernel's registers, spills, shared "
        "memory, grid, occupancy and waves; GPU against wall time per call; GB/s and the roofline. GPU only.")] = False,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="Also write a Chrome/Perfetto trace of each cell's timed calls and a per-kernel CSV "
        "(and Proton's view, where triton.profiler is present) into this folder; implies --metrics.",
        show_default=False)] = None,
    workers: WorkersOpt = None,
    cluster: ClusterOpt = None,
    per_gpu_type: Annotated[bool, typer.Option(
        "--per-gpu-type", help="On Ray: run the sweep once on each GPU type of the cluster, side by side.")] = False,
    tune: TuneOpt = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Time attention kernels against PyTorch's (SDPA backends, FlexAttention, ...) on a GPU.

    Each provider is checked against the reference first; a wrong one gets no
    time (exit 1). Heads = hidden / D and batch = tokens / N, as in the
    FlashAttention benchmarks. Writes <out>/<gpu>-<time>.csv and .json, and a
    record in runs.jsonl.

    Examples:

      flashrun bench                      # the default sweep: forward, float16

      flashrun bench --config benchmarks/suites/forward.toml   # a named suite

      flashrun bench --mode fwd,bwd --dtype fp16,bf16 --plot bench.png

      flashrun bench -k flash -p sdpa-cudnn --seq-lens 1 --seq-lens-k 4096,16384

      flashrun bench -k flash -p sdpa-cudnn --seq-lens 4096 --metrics

      flashrun bench -k experiments/my_attention.py:attention --compare old.json

      flashrun bench --device cpu -p torch-naive,sdpa --seq-lens 128

      flashrun bench --workers 8                  # a shape per GPU, on Ray
    """
    from flashrun.harness import bench as bench_mod
    from flashrun.harness import bench_table

    with _boundary(verbose):
        flags = {
            "bench.providers": split(provider) or None, "bench.baseline": baseline,
            "bench.mode": split(mode) or None, "bench.dtype": split(dtype) or None,
            "bench.seq_len": ints("--seq-lens", seq_lens), "bench.seq_len_k": ints("--seq-lens-k", seq_lens_k),
            "bench.head_dim": ints("--head-dims", head_dims), "bench.causal": causal_choice(causal),
            "bench.out": str(out_dir) if out_dir is not None else None, "experiment.device": device,
            "bench.compare": [str(path) for path in compare] if compare else None,
            "triton.tune": tune or None, "cluster.workers": workers, "cluster.address": cluster,
        }
        cfg = _setup(config, settings, sets, verbose, flags)
        report = bench_mod.run(cfg, tuple(split(kernel)), plot, tuple(sys.argv[1:]),
                               console=None if json_out else err, per_gpu_type=per_gpu_type,
                               metrics=metrics, profile=profile)
        _show(report, json_out, lambda: bench_table.render(report, out))
        raise typer.Exit(report.exit_code)


# -- init ---------------------------------------------------------------------------------------
@app.command("model")
def model_cmd(
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    arch: Annotated[Optional[str], typer.Option(
        "--arch", help="llama | mistral | qwen2 | gemma2 | gemma3 | phi3 (default model.arch = llama).",
        show_default=False)] = None,
    size: Annotated[Optional[str], typer.Option(
        "--size", help="mini (CPU-sized, 4 layers) | 1b (~1B parameters, for a GPU).", show_default=False)] = None,
    model_path: Annotated[Optional[str], typer.Option(
        "--model", help="A local checkpoint folder (or a hub id already in the local cache) instead of --arch/--size.",
        show_default=False)] = None,
    kernel: Annotated[Optional[str], typer.Option(
        "--kernel", "-k", help="flash | flash-atomic | flash-deterministic | PATH.py:FUNCTION (default flash).",
        show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help="Tokens per sequence.", show_default=False)] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Sequences per batch.", show_default=False)] = None,
    device: DeviceOpt = None,
    no_speed: Annotated[bool, typer.Option("--no-speed", help="Checks only, no timings (on a GPU).")] = False,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Also draw the speed and memory table into this image (e.g. model.png).",
        show_default=False)] = None,
    rerun: Annotated[Optional[str], typer.Option(
        "--rerun", help="Repeat a recorded model run exactly (see `flashrun runs`).", show_default=False)] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Swap a kernel into a transformers model and check it is still the same model.

    Logits, one training step's gradients, a 20-step training run and greedy
    generation, each judged against the model's own attention; on a GPU also
    prefill, training-step and decode speed and peak memory against sdpa, eager
    and flex_attention. Needs flashrun\\[model]. Exit 1 when a check fails, 2 on
    bad input.

    Examples:

      flashrun model                     # a mini Llama (interpreted on a CPU)

      flashrun model --arch gemma2 --json # softcap, alternating windows, D 256

      flashrun model --arch mistral --set model.sliding_window=8

      flashrun model --arch llama --size 1b --plot llama.png    # on a GPU

      flashrun model -k experiments/my_attention.py:attention --arch qwen2

      flashrun model --model ~/checkpoints/my-llama --no-speed
    """
    from flashrun.model import run as model_run

    flags = {"model.arch": arch, "model.size": size, "model.path": model_path, "model.kernel": kernel,
             "model.seq_len": seq_len, "model.batch": batch, "experiment.device": device,
             "model.speed": False if no_speed else None}
    with _boundary(verbose):
        if rerun is not None:
            refuse_rerun_conflicts(rerun, {"--arch": arch, "--size": size, "--model": model_path,
                                            "--kernel": kernel, "--seq-len": seq_len, "--batch": batch,
                                            "--device": device, "--no-speed": no_speed or None}, sets)
        cfg = _setup(config, settings, sets, verbose, flags)
        if plot is not None:
            model_run.check_plot_target(plot)
        if rerun is not None:
            cfg, plan = model_run.plan_from_record(find_record(cfg.logging.log_dir, rerun))
        else:
            plan = model_run.make_plan(cfg)
        report = model_run.run(cfg, plan, console=None if json_out else err, argv=sys.argv[1:])
        if plot is not None and report.speed:
            report.files.append(str(model_run.plot(report, plot)))
        _show(report, json_out, lambda: model_run.render(report, out))
        raise typer.Exit(report.exit_code)


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="Folder to scaffold (created if missing).")] = Path("."),
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Scaffold an experiment folder: config.toml, settings.json, experiments/, logs/."""
    from flashrun.scaffold import scaffold

    with _boundary(verbose):
        written = scaffold(directory, force=force)
        for path in written:
            out.print(f"wrote {path}")
        out.print(f"next: cd {directory} && flashrun check-env && flashrun verify")


# -- runs ---------------------------------------------------------------------------------------
runs_app = typer.Typer(help="List and show recorded runs (<log_dir>/runs.jsonl).", no_args_is_help=False)
app.add_typer(runs_app, name="runs")


@runs_app.callback(invoke_without_command=True)
def runs(
    ctx: typer.Context,
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="How many recent runs.")] = 20,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """List recent runs: id, time, command, kernels, cases, verdict or best TFLOP/s.

    Ids and numbers are never cut, piped or at any width; when the terminal is
    narrow the time column is left out (the id holds the time to the second) and
    kernels and outcome wrap.
    """
    if ctx.invoked_subcommand is not None:
        return
    from flashrun.records import runs as runs_mod

    with _boundary(verbose):
        cfg = _setup(config, settings, sets, verbose)
        records = runs_mod.recent(cfg.logging.log_dir, limit)
        if json_out:
            out.print_json(data=[runs_mod.summary(r) for r in records])
        else:
            runs_mod.render_list(records, cfg.logging.log_dir, out)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="Run id (a unique prefix is enough).")],
    config: ConfigOpt = None,
    settings: SettingsOpt = None,
    sets: SetOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Print one recorded run as JSON."""

    with _boundary(verbose):
        cfg = _setup(config, settings, sets, verbose)
        out.print_json(data=find_record(cfg.logging.log_dir, run_id))


def main() -> None:
    app()
