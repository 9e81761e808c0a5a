"""Compiling ahead (flashrun.harness.precompile, flashrun.kernels.warmup), the heuristic launch
config for shapes the tuned table misses (flashrun.kernels.tuning), and how both are reported.

The compile step itself needs a compiler: tests/precompile_sm90.py runs it for an sm_90 target
on this GPU-less machine (real Triton compiles, Triton's own keys). Everything else runs through
the interpreter or with made-up tables."""

import json
import os
from pathlib import Path

import pytest
import torch
import triton

from flashrun.harness import precompile
from flashrun.harness.check import CaseResult
from flashrun.harness.shapes import Shape
from flashrun.kernels import tuning
from flashrun.kernels.tuning import LaunchConfig


# -- the plan's specializations: listed once, shared between cases, forward and backward -------------
@pytest.mark.slow
def test_a_plans_kernels_compile_ahead_once_each(python):
    result = python(str(Path(__file__).parent / "precompile_sm90.py"))
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    flash_grad = ["_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess", "_attn_fwd"]
    assert got["needs"] == {"0": flash_grad, "1": flash_grad, "2": ["_attn_fwd"], "3": ["_attn_fwd"],
                            "4": ["_minimal_fwd"]}
    # one compile per distinct specialization, by Triton's own count of what it holds
    assert got["kernels"] == got["in Triton's memory caches"] == 7
    # other lengths share every kernel but the preprocess (its block is 64 rows from 64 rows on);
    # the forward-only check needs only the forward; a window is another specialization
    assert got["job 1 shares with job 0"] == ["_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_fwd"]
    assert got["job 2 shares with job 0"] == ["_attn_fwd"]
    assert got["job 3 shares with job 0"] == []
    assert got["last progress"] == [7, 7, got["workers"]]
    # they compiled in processes (one per core), which import Triton and the kernel's module only:
    # at most one of them compiled minimal's kernel, whose module imports torch
    assert got["pool"] == "processes" and got["processes"] == got["workers"]
    assert got["processes without torch"] >= got["processes"] - 1
    assert got["compiled in a thread"] == []  # each worker rebuilt the parent's key for every kernel
    # the Python API's first call lists the backward's kernels with the forward's; here all known
    assert got["api first call, backward kernels"] == ["_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess"]
    assert got["api first call, compiled"] == 0
    assert got["chosen while compiling"] == {}  # compiling is not running: nothing reported as run


def test_through_the_interpreter_nothing_compiles_ahead():
    from flashrun.harness.check import Job

    job = Job(0, "flash", Shape(1, 2, 1, 17, 17, 64, "float16", True), 0, True, False, "cpu")
    ahead = precompile.for_verify([job], "cpu", None, None)
    assert not ahead.active and ahead.close() is None
    run = object()
    assert ahead.run(run) is run  # the checks run as they always did


def test_on_ray_the_driver_compiles_everything_before_dispatch_only_for_workers_on_its_host(monkeypatch):
    from types import SimpleNamespace

    from flashrun.harness.check import Job

    started, waited = [], []

    class Recorded(precompile.Ahead):
        def wait(self, index=None):
            waited.append(index)

    def start(units, progress):
        started.append(len(units))
        return Recorded(None, {}, len(units))

    monkeypatch.setattr(precompile, "_start", start)
    monkeypatch.setattr(precompile, "_free", lambda device: None)
    case = Shape(1, 2, 1, 17, 17, 64, "float16", True)
    jobs = [Job(0, "flash", case, 0, True, False, "cuda"), Job(1, "mine.py:attention", case, 0, True, False, "cuda")]
    here = SimpleNamespace(gpus=True, same_host=True)
    ahead = precompile.for_verify(jobs, "cuda", here, None)
    assert started == [1] and waited == [None]  # flash's launches only (a user's kernel compiles itself); all, first
    ahead.batch, ahead.all_ready = SimpleNamespace(kernels={0: "compiled"}), True  # as after its wait for all
    assert ahead.active  # ... yet the workers get run_job itself (a wrapper would not pickle)
    run_job = object()
    assert ahead.run(run_job) is run_job
    precompile.for_verify(jobs, "cuda", None, None)  # in this process: each check waits for its own
    assert started == [1, 1] and waited == [None]
    for elsewhere in (SimpleNamespace(gpus=True, same_host=False), SimpleNamespace(gpus=False, same_host=True)):
        precompile.for_verify(jobs, "cuda", elsewhere, None)  # their workers compile for themselves
    precompile.for_verify(jobs, "cpu", None, None)  # the interpreter: nothing to compile
    assert started == [1, 1]


# -- launch configs for keys the table misses ---------------------------------------------------------
WINNER = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tma": True, "ws": None}


@pytest.fixture
def gpu_tuning(monkeypatch, tmp_path):
    """choose() as on a GPU: a made-up shipped table, no GPU name, a tuner that must not run."""
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "USE_SHIPPED", False)
    monkeypatch.setattr(tuning, "_cache_path", lambda: tmp_path / "tune.json")
    monkeypatch.setattr(tuning, "_memory", {"fwd|float16|d128|full|g1|nq4096|nk4096": WINNER,
                                            "fwd|float16|d128|causal|g1|nq1024|nk1024": dict(WINNER, num_warps=4, block_n=64)})
    monkeypatch.setattr(tuning, "_origin", dict.fromkeys(tuning._memory, "table"))
    monkeypatch.setattr(tuning, "_guessed", {})
    monkeypatch.setattr(tuning, "_launchable_here", {})
    monkeypatch.setattr(tuning, "CHOSEN", {})
    timed = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: timed.append(fn) or 1.0)
    return timed


def _qk(n=2048, d=128, heads=4, kv_heads=4, dtype=torch.float16):
    return torch.empty(1, heads, n, d, dtype=dtype), torch.empty(1, kv_heads, n, d, dtype=dtype)


def test_a_key_the_table_misses_runs_the_nearest_keys_config_without_tuning(gpu_tuning):
    q, k = _qk(n=2048, d=111, heads=4, kv_heads=1)  # GQA 4/1, D=111: nowhere in the table
    ran = []
    cfg = tuning.choose("fwd", q, k, False, None, ran.append)
    assert cfg == LaunchConfig(**WINNER)  # the full-attention d128 winner: same kernel, dtype, class, mask
    # nothing timed; launched once, to see that it fits this GPU (the caller's own launch follows)
    assert gpu_tuning == [] and ran == [cfg]
    assert tuning.chosen() == {"fwd": {"config": "128x128 w8 s3 tma", "source": "heuristic"}}
    assert tuning.choose("fwd", q, k, False, None, ran.append) == cfg and ran == [cfg]  # known now: no launch
    causal = tuning.choose("fwd", q, k, True, None, ran.append)
    assert causal == LaunchConfig(**dict(WINNER, num_warps=4, block_n=64))  # the causal one


def test_without_a_near_key_the_heuristic_is_the_candidate_lists_head(gpu_tuning):
    q, k = _qk(d=256)  # the "huge" head-dim class: not in the table
    assert tuning.choose("bwd_dq", q, k, False, None, lambda cfg: None) == tuning.candidates("bwd_dq", 256, q.dtype)[0]
    assert tuning.chosen()["bwd_dq"]["source"] == "heuristic"


def test_a_table_hit_says_so(gpu_tuning):
    q, k = _qk(n=4096)
    assert tuning.choose("fwd", q, k, False, None, lambda cfg: None) == LaunchConfig(**WINNER)
    assert tuning.chosen() == {"fwd": {"config": "128x128 w8 s3 tma", "source": "table"}}
    assert tuning.chosen() == {}  # read once: the next caller sees only its own launches


def test_tuning_happens_on_request_only(gpu_tuning, monkeypatch):
    q, k = _qk(d=96)
    tuning.choose("fwd", q, k, False, None, lambda cfg: None)
    assert gpu_tuning == []
    tuning.choose("fwd", q, k, False, "tune", lambda cfg: None)  # launch="tune" (verify --tune)
    assert len(gpu_tuning) == len(tuning.candidates("fwd", 96, q.dtype))
    assert tuning.chosen()["fwd"]["source"] == "tuned"
    q, k = _qk(d=80)
    monkeypatch.setenv("FLASHRUN_TUNE", "1")  # bench --tune, or the Python API
    tuning.choose("fwd", q, k, False, None, lambda cfg: None)
    assert len(gpu_tuning) == 2 * len(tuning.candidates("fwd", 96, q.dtype))


def test_compiling_ahead_a_key_to_tune_compiles_its_candidates_and_times_nothing(gpu_tuning):
    q, k = _qk(d=96)
    handed = []
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel)):
        cfg = tuning.choose("fwd", q, k, False, "tune", lambda c: tuning.launch(c, (1,)))
    assert handed == tuning.candidates("fwd", 96, q.dtype)  # every candidate, handed to the compiler
    assert gpu_tuning == [] and cfg == tuning.heuristic("fwd", "fwd|float16|d96|full|g1|nq2048|nk2048", 96, q.dtype)
    assert tuning.CHOSEN == {}


# -- reporting ------------------------------------------------------------------------------------
def test_compile_time_is_reported_apart():
    from flashrun.harness import verify

    compiled = precompile.Compiled(kernels=23, workers=16, pool="processes", seconds=12.34, waited_s=4.5, cases=35)
    line = compiled.line()
    assert "23 kernels" in line and "12.3 s" in line and "16 processes" in line and "waited 4.5 s" in line
    assert compiled.to_json() == {"kernels": 23, "workers": 16, "pool": "processes", "seconds": 12.34,
                                  "waited_s": 4.5, "cases": 35}
    assert precompile.describe(23, 16) == "compiling 23 kernels, 16 workers"

    case = Shape(1, 2, 1, 17, 17, 64, "float16", True)
    result = CaseResult("flash", case, "pass", first_call_s=0.5,
                        configs={"fwd": {"config": "64x64 w4 s3", "source": "heuristic"}})
    report = verify.Report([result], "cuda", [], planned=1, compiled=compiled, run_s=20.0)
    data = report.to_json()
    assert data["compile"]["kernels"] == 23 and data["run_s"] == 20.0
    assert data["results"][0]["launch_configs"] == {"fwd": {"config": "64x64 w4 s3", "source": "heuristic"}}
    from rich.console import Console

    console = Console(width=80, record=True, force_terminal=False)
    verify.render(report, console)
    text = console.export_text()
    assert "compiled 23 kernels ahead in 12.3 s" in text and "the checks ran 20.0 s" in text
    assert "launch configs: heuristic (not in the table; --tune tunes them) (1)" in text


def test_verify_tune_flag_checks_the_tuned_configs(cli, monkeypatch):
    from flashrun.harness import verify

    launches = []

    def run(cfg, plan, console, argv, dev, launch, pool):
        launches.append(launch)
        return verify.Report([], "cpu", [], planned=0)

    monkeypatch.setattr(verify, "_run", run)
    assert cli("verify", "--json").exit_code == 0
    assert cli("verify", "--tune", "--json").exit_code == 0
    assert launches == ["default", "tune"]


def test_importing_the_kernels_starts_what_a_first_launch_would_wait_for(python):
    # Triton's specializer imports Gluon on a process's first launch, whatever the kernel (0.27 s
    # of the API's first call on the H200, whose Triton keeps no bytecode): a primer imports it
    # while the caller sets up, beside the installation's hash and the CUDA helpers
    code = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import flashrun.kernels
from flashrun.kernels import warmup
print(" ".join(thread.name for thread in warmup._primers))
warmup._primed()
print("triton.experimental.gluon.nvidia.hopper" in sys.modules)
"""
    result = python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    names, imported = result.stdout.splitlines()
    assert "flashrun-gluon" in names.split() and imported == "True"


def test_a_compile_workers_source_hash_ignores_what_the_process_compiled_before(python):
    # Triton appends to every function's key the constexpr globals its callees were seen to use,
    # which grows as a process compiles (on the H200, 41 of 109 kernels keyed differently in a
    # fresh worker than in the parent). The worker checks the kernel by its sources alone: a
    # callee's key changing leaves that unchanged, where Triton's own dependency hash moves.
    code = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
from flashrun import compile_worker
compile_worker.start("key")
import importlib, inspect
from triton.runtime.jit import DependenciesFinder
bwd = importlib.import_module("flashrun.kernels.flash.bwd")
jit = importlib.import_module("flashrun.kernels.flash.jit")
kernel = bwd._attn_bwd_dkdv
def triton_ret():
    finder = DependenciesFinder(name=kernel._fn_name, globals=kernel.__globals__,
                                nonlocals=inspect.getclosurevars(kernel.fn).nonlocals, src=kernel.src)
    finder.visit(kernel.parse())
    return finder.ret
before = (compile_worker.source_hash(kernel), triton_ret())
callees = [f for f in vars(jit).values() if hasattr(f, "cache_key") and f.cache_key]
for callee in callees:
    callee.hash = callee.cache_key + "-seen-more-globals"
after = (compile_worker.source_hash(kernel), triton_ret())
print(len(callees), before[0] == after[0], before[1] != after[1])
"""
    result = python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    count, same, moved = result.stdout.split()
    assert int(count) > 3 and same == "True" and moved == "True"


def test_a_kernel_compiled_after_the_compile_threads_stopped_is_dropped_quietly(monkeypatch):
    """At interpreter exit the pool shuts down while kernels compiled ahead for later cells may
    still finish: their done-callbacks must not raise (the H200 printed three tracebacks)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from flashrun.kernels import warmup

    stopped = ThreadPoolExecutor(1)
    stopped.shutdown()
    monkeypatch.setattr(warmup, "_pool", stopped)
    done: Future = Future()
    done.set_result(None)
    batch = warmup.Batch.__new__(warmup.Batch)  # only _load_later is exercised: no processes started
    compile_ = warmup.Compile("_attn_fwd", handle=None)
    batch._load_later(compile_, done)
    assert not compile_.ready.is_set()


def test_settle_waits_for_every_batchs_kernels_still_compiling(monkeypatch):
    """A first call compiles its backward in the background; settle() returns only once every
    kernel any batch handed over is ready (here: set by a thread 0.2 s later)."""
    import threading

    from flashrun.kernels import warmup

    monkeypatch.setattr(warmup, "_batches", type(warmup._batches)())
    batch = warmup.Batch.__new__(warmup.Batch)  # no processes: only its kernels and wait() are used
    batch.kernels = {i: warmup.Compile(f"k{i}", handle=None) for i in range(3)}
    warmup._batches.add(batch)
    timer = threading.Timer(0.2, lambda: [c.ready.set() for c in batch.kernels.values()])
    timer.start()
    waited = warmup.settle()
    assert all(c.ready.is_set() for c in batch.kernels.values()) and waited >= 0.15
    assert warmup.settle() < 0.05  # nothing left to wait for


def test_bench_times_a_provider_only_after_background_compiles_settle(monkeypatch):
    from flashrun.harness import measure
    from flashrun.harness.inputs import make_inputs
    from flashrun.harness.judge import Reference
    from flashrun.harness.providers import resolve
    from flashrun.kernels import warmup

    events = []
    monkeypatch.setattr(warmup, "settle", lambda: events.append("settle") or 0.0)
    real = measure.time_call
    monkeypatch.setattr(measure, "time_call", lambda *a, **kw: events.append("time") or real(*a, **kw))
    shape = Shape(1, 2, 2, 32, 32, 16, "float32", False)
    sets = make_inputs(shape, 0, "cpu", requires_grad=True)
    cells = measure.measure(resolve("sdpa", torch.device("cpu")), shape, sets, Reference.for_shape(sets[0], shape, grads=True),
                            ["fwd", "fwd_bwd"], torch.device("cpu"), measure.Timing(1, 2))
    assert [c.status for c in cells] == ["ok", "ok"]
    assert events == ["settle", "time", "settle", "time"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_neither_uses_nor_stops_its_parents_compile_processes():
    """The compile processes answer the process that started them: a forked child starts with
    none (its first batch would start its own), and its copy closing at exit leaves the parent's
    workers running."""
    from flashrun.kernels import warmup

    parent = warmup.processes()
    assert parent is not None
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status, skip pytest's teardown
        ok = warmup._processes is None and warmup._pool is None
        parent.close()  # what its atexit would do
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(worker.poll() is None for worker in parent._all)  # still running, still ours
    assert warmup._processes is parent
