"""``flashrun bench``: our kernels against PyTorch's best, side by side, in one run.

:func:`run` expands the sweep (:func:`~flashrun.harness.shapes.bench_shapes`), resolves the
providers (:mod:`~flashrun.harness.providers`), measures the % peak bar, then runs the sweep
(:mod:`~flashrun.harness.sweep`: a shape at a time, every provider checked and timed on it by
:mod:`~flashrun.harness.measure`), in this process or as Ray tasks (:mod:`~flashrun.harness.cluster`).
The results (:mod:`~flashrun.harness.results`) are rewritten after every provider and once more at
the end; the run is recorded in ``runs.jsonl``. :func:`flashrun.harness.bench_table.render`
prints them; a wrong row of one of our kernels comes with the ``flashrun verify`` command that
reproduces it (same shape, same seed, hence the same inputs).

Without a GPU it refuses (exit 2): timings through Triton's interpreter mean nothing. Only an
explicit ``--device cpu`` (or ``experiment.device = "cpu"``) times the plain PyTorch providers
on the CPU, and says so.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from flashrun.config import Config
from flashrun.env.fingerprint import fingerprint
from flashrun.errors import DeviceError, InputError
from flashrun.harness import proton_pass, results
from flashrun.harness.metrics import Ceilings
from flashrun.harness.shapes import Shape, bench_shapes
from flashrun.harness.sweep import Here, ShapeJob, Sweep, resolve, row_env
from flashrun.records.runlog import append_record, make_record, now_iso

if TYPE_CHECKING:  # torch is imported only once a bench really runs: option errors answer at once
    import torch

    from flashrun.harness import precompile
    from flashrun.harness.provider import Provider


@dataclass
class BenchReport:
    rows: list[results.Row]
    files: dict[str, str]
    device: str
    ceiling_tflops: float | None
    notices: list[str] = field(default_factory=list)
    ceiling_gbps: float | None = None
    ceiling_fp8_tflops: float | None = None  # the e4m3 matmul roof (fp8 providers' % peak)
    metrics: bool = False  # --metrics: the rows carry what harness.probe read, and render shows it
    compare_file: str | None = None
    ratios: list[results.Ratio] = field(default_factory=list)
    baseline: str = "sdpa"
    seed: int = 0
    gpu_types: list[str] = field(default_factory=list)  # --per-gpu-type: the sweep ran once on each
    row_types: list[str] = field(default_factory=list)  # ... and the type each row's sweep asked for
    compiled: precompile.Compiled | None = None  # our kernels compiled before the sweep (None: nothing)

    @property
    def exit_code(self) -> int:
        """1 when a provider computed a wrong result (a failed check) or a shape's worker died, else 0."""
        return 1 if any(row.status in ("wrong", "error") for row in self.rows) else 0

    def to_json(self) -> dict[str, Any]:
        rows = [row.to_json() for row in self.rows]
        if self.gpu_types:
            rows = [{**row, "gpu_type": gpu_type} for row, gpu_type in zip(rows, self.row_types)]
        data: dict[str, Any] = {
            "device": self.device, "ceiling_tflops": self.ceiling_tflops, "ceiling_gbps": self.ceiling_gbps,
            "ceiling_fp8_tflops": self.ceiling_fp8_tflops, "baseline": self.baseline,
            "files": self.files, "notices": self.notices, "rows": rows,
            "compile": self.compiled.to_json() if self.compiled is not None else None,
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


def run(cfg: Config, kernels: tuple[str, ...] = (), plot: Path | None = None, argv: tuple[str, ...] = (), console: Console | None = None, per_gpu_type: bool = False,
        metrics: bool = False, profile: Path | None = None) -> BenchReport:
    """Check and time every provider on every shape of the sweep; write CSV, JSON, run record.
    ``kernels`` are added to ``[bench].providers``; ``console`` None: no progress output.
    With ``[cluster]`` workers > 1 or an address, each shape is a Ray task
    (:mod:`~flashrun.harness.cluster`); ``per_gpu_type`` runs the sweep once on each GPU type
    of the cluster. ``metrics``: each timed call is then profiled (:mod:`~flashrun.harness.probe`);
    ``profile``: so is it with its traces written to that folder (``metrics`` implied), and on this
    machine's GPU Proton's views too, after the sweep (:mod:`~flashrun.harness.proton_pass`)."""
    from flashrun.harness import cluster
    from flashrun.harness import providers as providers_mod  # torch from here on

    names = provider_names(cfg, kernels)
    providers_mod.check_names(names)
    shapes = bench_shapes(cfg.bench)
    compare = cfg.bench.compare
    earlier = [row for path in compare for row in results.load_rows(path)] if compare else None
    if plot is not None:
        results.check_plot_target(plot)
    if per_gpu_type and not cluster.wanted(cfg.cluster):
        raise InputError("--per-gpu-type runs the sweep on each GPU type of a Ray cluster",
                         hint="add --cluster ADDRESS (or --workers N for the GPUs of this machine)")
    inputs = (names, shapes, earlier, plot, compare, argv, console, per_gpu_type, metrics or profile is not None,
              profile)
    if not cluster.wanted(cfg.cluster):
        return _run(cfg, *inputs, pool=None)
    if cfg.cluster.address is None:
        _device(cfg.experiment.device)  # a local cluster has this machine's GPUs: refuse before starting it
    with cluster.connect(cfg.cluster, cfg.experiment.device, cap=cfg.is_set("cluster.workers")) as pool:
        return _run(cfg, *inputs, pool=pool)


def _run(cfg: Config, names: list[str], shapes: list[Shape], earlier: list[dict[str, Any]] | None,
         plot: Path | None, compare: list[Path] | None, argv: tuple[str, ...], console: Console | None,
         per_gpu_type: bool, metrics: bool, profile: Path | None, pool: Any) -> BenchReport:
    from flashrun.harness import precompile
    from flashrun.harness import providers as providers_mod

    bench = cfg.bench
    device = _device(cfg.experiment.device, pool)
    if metrics and device.type == "cpu":
        option = "--metrics" if profile is None else "--profile"
        raise InputError(f"{option} reads the compiled Triton kernels and the GPU's profiler: a CPU run has neither",
                         hint="run it on a machine with a CUDA GPU (--device cpu times only the plain PyTorch "
                              "providers, without it)")
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
    resolved = resolve(tuple(names), device.type)  # loads kernels: a bad path stops here

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
              "seed": cfg.experiment.seed, "ceiling_tflops": None, "ceiling_gbps": None, "ceiling_fp8_tflops": None,
              "tolerance": {"factor": FACTOR, **{str(dtype).removeprefix("torch."): dataclasses.asdict(tol)
                                                 for dtype, tol in TOLERANCE.items()}}}
    kernels_path = None
    if profile is not None:
        kernels_path = profile / f"{paths[0].stem}-kernels.csv"
        try:
            profile.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--profile {profile}: cannot make the folder: {exc.strerror or exc}",
                             hint="pick a folder you can write to") from None
    try:  # the empty files now: an unwritable --out must fail before the GPU works, not after
        results.write(*paths, [], header, complete=False, kernels_path=kernels_path)
    except OSError as exc:
        raise InputError(f"cannot write the results to {out_dir}: {exc.strerror or exc}",
                         hint="pick a writable folder with --out or [bench].out") from None
    timing = Timing(bench.warmup_ms, bench.rep_ms, bench.l2_flush)
    jobs = [ShapeJob(index, shape, tuple(names), tuple(dict.fromkeys(bench.mode)), device.type, cfg.experiment.seed,
                     bench.baseline, timing, len(shapes), gpu_type, metrics, str(profile) if profile else None)
            for index, (gpu_type, shape) in enumerate((t, s) for t in (gpu_types or [None]) for s in shapes)]
    # every kernel of ours the sweep launches, compiled at once before the first timing
    compiled = precompile.for_bench(jobs, device, pool, console, tune=cfg.triton.tune)
    sweep = Sweep(jobs, header, paths, kernels_path)
    here_ceilings = Ceilings(None, None)
    if pool is None:
        from flashrun.harness.measure import ceilings

        here_ceilings = ceilings(device, timing)  # measured once, before the sweep
        header.update(ceiling_tflops=here_ceilings.tflops, ceiling_gbps=here_ceilings.gbps,
                      ceiling_fp8_tflops=here_ceilings.fp8_tflops)
        parts = sweep.run(console, Here(resolved, here_ceilings, row_env(env, device.type)))
        if profile is not None and device.type == "cuda" and proton_pass.available():
            notice = proton_pass.write_views(proton_pass.cells_of(jobs, parts, profile), device.type, profile,
                                             console)
            notices += [notice] if notice else []
    else:
        parts = sweep.run_on(pool, console)
    rows = [row for part in parts for row in part.rows]
    measured = {part.gpu: part.ceilings for part in parts if part.ceilings.tflops is not None}
    roofs = next(iter(measured.values())) if len(measured) == 1 else here_ceilings
    files = {"csv": str(paths[0]), "json": str(paths[1])}
    if kernels_path is not None:
        files["kernels"] = str(kernels_path)
        files["profile"] = str(profile)
    if plot is not None:
        files["plot"] = str(results.plot(rows, plot))
        if roofs.ridge is not None:
            files["roofline"] = str(results.plot_roofline(rows, roofs, results.roofline_path(plot)))
        else:
            notices.append("no roofline plot: it needs one GPU's measured ceilings (a CPU run, or several GPU types)")
    report = BenchReport(rows, files, device.type, roofs.tflops, notices, ceiling_gbps=roofs.gbps,
                         ceiling_fp8_tflops=roofs.fp8_tflops, metrics=metrics, baseline=bench.baseline,
                         seed=cfg.experiment.seed, compiled=compiled)
    if gpu_types:
        report.gpu_types = gpu_types
        report.row_types = [part.gpu_type or "" for part in parts for _ in part.rows]
    if earlier is not None:
        report.compare_file = ", ".join(map(str, compare))
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
        "ceiling_tflops": report.ceiling_tflops, "ceiling_gbps": report.ceiling_gbps,
        "ceiling_fp8_tflops": report.ceiling_fp8_tflops, "device": report.device,
        "files": report.files,
    }

