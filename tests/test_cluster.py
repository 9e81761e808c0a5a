"""verify and bench on Ray workers: a real local Ray cluster on the CPU, no mocks.

The in-process tests share one cluster (conftest's ``ray_cluster``); the Ctrl-C test starts its
own through ``flashrun verify --workers 2``, as a user would. What no test here can show: GPUs
(one per task, ``CUDA_VISIBLE_DEVICES``, a sticky CUDA error ending its worker), real GPU types
(``--per-gpu-type`` is scheduled on made-up ``accelerator_type:*`` resources), several machines.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner
from watched import PATIENCE_S, Watched

from flashrun.cli import app
from flashrun.harness import results

ROOT = Path(__file__).resolve().parent.parent
BAD = Path(__file__).parent / "kernels" / "bad_kernels.py"

# A plain attention that misbehaves on one case, chosen by its length: {action} runs there.
KERNEL = '''
import os, time, torch
def attention(q, k, v, causal=False, sm_scale=None):
    if q.shape[2] == 5:
        {action}
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1); v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = (q.float() @ k.float().transpose(-2, -1)) * (sm_scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(s.shape[-1] - s.shape[-2] + 1), float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
'''
CONFIG = '[experiment]\nbatch_size = 1\nnum_heads = 2\nhead_dim = 16\ndtype = "float32"\n[verify]\nseq_len = {lengths}\n'
TINY_BENCH = ["bench", "--device", "cpu", "--head-dims", "16", "--set", "bench.hidden=32", "--set", "bench.tokens=32",
              "--set", "bench.warmup_ms=1", "--set", "bench.rep_ms=2", "-p", "torch-naive,sdpa", "--json"]


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output + result.stderr, result.output + result.stderr
    return result


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), extra.pop("PYTHONPATH", "")])),
            "TRITON_INTERPRET": "1", **extra}


def _flashrun(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashrun", *args], capture_output=True, text=True, env=_env(**env),
                          timeout=PATIENCE_S, check=False)


def _last_record(folder: Path) -> dict:
    return json.loads((folder / "logs" / "runs.jsonl").read_text().splitlines()[-1])


# -- the same results as a serial run -------------------------------------------------------------------
def test_two_workers_give_the_serial_results_in_the_serial_order(ray_cluster, isolated: Path) -> None:
    args = ["verify", "-k", "flash", "-k", f"{BAD}:no_scale", "--set", "verify.seq_len=[1,40]",
            "--set", "verify.causal=[false,true]", "--set", "experiment.head_dim=16", "--grad", "--json"]
    serial = invoke(*args)
    spread = invoke(*args, "--workers", "2")
    assert serial.exit_code == spread.exit_code == 1  # no_scale fails
    one, two = json.loads(serial.stdout), json.loads(spread.stdout)
    assert two["verdict"] == one["verdict"] and one["passed"] >= 4 and one["failed"] >= 2
    assert any("on the Ray this process already runs: 2 CPUs at once" in n for n in two["notices"])
    key = ("kernel", "label", "status")
    assert [[r[k] for k in key] for r in two["results"]] == [[r[k] for k in key] for r in one["results"]]
    for a, b in zip(one["results"], two["results"]):
        assert [c["name"] for c in a["checks"]] == [c["name"] for c in b["checks"]]
        for x, y in zip(a["checks"], b["checks"]):  # same inputs, same kernels: the same numbers
            assert (x["passed"], x["unwritten"], x["nonfinite"]) == (y["passed"], y["unwritten"], y["nonfinite"])
            assert y["max_abs"] == pytest.approx(x["max_abs"], rel=1e-6, abs=1e-12)
            assert y["rel_l2"] == pytest.approx(x["rel_l2"], rel=1e-6, abs=1e-12)
        assert a["where"].endswith(":cpu") and b["where"].endswith(":cpu")
    records = [json.loads(line) for line in (isolated / "logs" / "runs.jsonl").read_text().splitlines()]
    assert [[c[k] for k in key] for c in records[-1]["results"]["checks"]] == \
        [[c[k] for k in key] for c in records[-2]["results"]["checks"]]


def test_bench_on_workers_keeps_the_shape_order_and_adds_where_last(ray_cluster, isolated: Path) -> None:
    args = [*TINY_BENCH, "--seq-lens", "16,8,32", "--causal", "both", "--mode", "fwd,bwd"]
    serial, spread = invoke(*args), invoke(*args, "--workers", "2")
    assert serial.exit_code == spread.exit_code == 0, spread.stderr
    key = ("provider", "mode", "seq_len", "causal", "status", "correct", "gpu")
    one, two = json.loads(serial.stdout)["rows"], json.loads(spread.stdout)["rows"]
    assert [[r[k] for k in key] for r in two] == [[r[k] for k in key] for r in one]
    assert all(r["where"].endswith(":cpu") for r in one + two)
    assert {r["speedup"] for r in two if r["provider"] == "sdpa"} == {1.0}  # the baseline, per shape and worker
    with open(json.loads(spread.stdout)["files"]["csv"], newline="") as handle:
        header = next(csv.reader(handle))
    assert header == [*results.COLUMNS, *results.EXTRA_COLUMNS]
    where = header.index("where")  # appended after the variants, then path, and never moved
    assert header[where - 1:where + 2] == ["seqlens_k", "where", "path"]
    assert header[-5:] == ["config", "cache_seqlens", "page_size", "new_keys", "kv_scale"]  # the last ones appended


def test_workers_on_this_host_share_the_drivers_caches_and_switches(ray_cluster, isolated: Path, monkeypatch) -> None:
    """A kernel compiles once per host: workers here get the driver's Triton and flashrun caches
    (Ray was started before these were set, as in a notebook), and --tune reaches them."""
    from flashrun.config import ClusterConfig
    from flashrun.harness import cluster

    names = ("TRITON_CACHE_DIR", "FLASHRUN_CACHE_DIR", "FLASHRUN_TUNE")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(isolated / "triton-cache"))
    monkeypatch.setenv("FLASHRUN_CACHE_DIR", str(isolated / "flashrun-cache"))
    with cluster.connect(ClusterConfig(workers=2), "cpu", cap=True) as pool:
        assert pool.same_host
        monkeypatch.setenv("FLASHRUN_TUNE", "1")  # as bench --tune sets it, after connecting

        def seen(_: int) -> dict[str, str | None]:
            return {name: os.environ.get(name) for name in names}

        outcomes = [outcome for _, outcome in pool.map(seen, [0, 1], label=lambda i: f"env-{i}")]
    assert outcomes == [{name: os.environ[name] for name in names}] * 2


def test_per_gpu_type_runs_the_sweep_on_each_type(ray_cluster, isolated: Path) -> None:
    """Scheduling only: the shared cluster names two made-up types on one CPU node."""
    types = ray_cluster.gpu_types
    result = invoke(*TINY_BENCH, "--seq-lens", "16,8", "--causal", "no", "--workers", "2", "--per-gpu-type")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["gpu_types"] == list(types)
    assert [(r["gpu_type"], r["seq_len"], r["provider"]) for r in data["rows"]] == [
        (t, n, p) for t in types for n in (16, 8) for p in ("sdpa", "torch-naive")]
    table = invoke(*TINY_BENCH[:-1], "--seq-lens", "16", "--causal", "no", "--workers", "2", "--per-gpu-type")
    assert "TFLOP/s on each GPU type" in table.stdout and all(t in table.stdout for t in types)


def test_bench_on_local_workers_without_a_gpu_refuses_before_starting_ray(isolated: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from flashrun.harness import cluster

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    connected = []  # no Ray cluster may be started (or joined) for nothing

    def connect(*args: object, **kwargs: object) -> None:
        connected.append(args)
        raise RuntimeError("bench asked for Ray")

    monkeypatch.setattr(cluster, "connect", connect)
    result = invoke("bench", "--workers", "2", "--seq-lens", "16")
    assert connected == []
    assert result.exit_code == 2 and "no GPU" in result.stderr and "--device cpu" in result.stderr


def test_per_gpu_type_needs_a_cluster(isolated: Path) -> None:
    result = invoke(*TINY_BENCH, "--seq-lens", "16", "--per-gpu-type")
    assert result.exit_code == 2 and "--per-gpu-type" in result.stderr and "--cluster" in result.stderr


def test_cluster_address_joins_a_running_cluster_and_ships_flashrun(ray_cluster, isolated: Path) -> None:
    """Another process joins the shared cluster by its address. That cluster's workers were not
    started with this checkout on their PYTHONPATH: they import the flashrun the job ships."""
    run = _flashrun("verify", "--cluster", ray_cluster.address, "--set", "verify.seq_len=[1,17]",
                    "--set", "experiment.head_dim=16", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["verdict"] == "4 passed, 0 failed"
    assert f"running on the Ray cluster at {ray_cluster.address}: 2 CPUs at once" in data["notices"]


# -- faults ---------------------------------------------------------------------------------------------
def test_a_kernel_that_kills_its_worker_is_that_case_error_after_one_retry(ray_cluster, isolated: Path) -> None:
    attempts = isolated / "attempts"
    (isolated / "dies.py").write_text(KERNEL.format(
        action=f"open({str(attempts)!r}, 'a').write('x'); os._exit(1)"))
    (isolated / "config.toml").write_text(CONFIG.format(lengths="[3, 5, 7]"))
    result = invoke("verify", "-k", "dies.py:attention", "--workers", "2", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)  # nothing of Ray's got into it
    assert [(r["label"], r["status"]) for r in data["results"]] == [
        ("B1 H2 N3 D16 fp32", "pass"), ("B1 H2 N5 D16 fp32", "error"), ("B1 H2 N7 D16 fp32", "pass")]
    message = data["results"][1]["message"]
    assert "worker process died" in message and "retried once on a fresh worker" in message
    assert attempts.read_text() == "xx"  # the first try and the one retry
    assert _last_record(isolated)["results"]["failed"] == 1


def test_ctrl_c_on_workers_keeps_the_finished_checks_in_the_record(isolated: Path) -> None:
    """A real process with its own local Ray cluster: SIGINT while one check waits to be interrupted."""
    pytest.importorskip("ray")
    started = isolated / "slow-case-started"
    (isolated / "slow.py").write_text(KERNEL.format(action=f"open({str(started)!r}, 'w').close(); time.sleep(3600)"))
    (isolated / "config.toml").write_text(CONFIG.format(lengths="[3, 5, 7, 9]"))
    with Watched(["verify", "-k", "slow.py:attention", "--workers", "2"], _env(), isolated / "stdout.txt") as run:
        # 3, 7 and 9 finish (a PASS line is printed once the check is kept) while 5 waits
        run.wait_for("start of case 5 and PASS of the three others",
                     lambda: started.exists() and sum(line.startswith("PASS") for line in run.lines) >= 3)
        code, out, err = run.interrupt()
    assert code == 130, err
    assert "Traceback" not in err and "(raylet)" not in out + err
    assert "3 passed, 0 failed (interrupted: 3 of 4 checks ran)" in out
    record = _last_record(isolated)
    assert record["results"]["interrupted"] is True
    assert [c["case"]["seq_len"] for c in record["results"]["checks"]] == [3, 7, 9]


# -- no Ray, no cluster: one line, exit 2 ---------------------------------------------------------------
def test_an_unreachable_cluster_is_one_line_and_exit_2(isolated: Path) -> None:
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Ray alone would retry such an address for minutes. Both messages come from flashrun's own
    # check of the address, which runs before ray.init (whose failure reads "cannot connect to"):
    # proof enough that it was refused at once, without timing a process on a loaded machine.
    for address, message in ((f"127.0.0.1:{port}", f"cannot reach a Ray cluster at 127.0.0.1:{port}"),
                             ("no-port-here", "expected auto, HOST:PORT or ray://HOST:PORT")):
        run = _flashrun("verify", "--cluster", address, "--set", "experiment.seq_len=4")
        assert run.returncode == 2, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr
        assert len([line for line in run.stderr.splitlines() if line.startswith("error:")]) == 1


def test_without_ray_more_workers_say_how_to_install_it(isolated: Path) -> None:
    shim = isolated / "no-ray"
    (shim / "ray").mkdir(parents=True)
    (shim / "ray" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    run = _flashrun("verify", "--workers", "2", "--set", "experiment.seq_len=4", PYTHONPATH=str(shim))
    assert run.returncode == 2, run.stderr
    assert "pip install 'flashrun[ray]'" in run.stderr and "Traceback" not in run.stderr


def test_one_worker_never_imports_ray(isolated: Path) -> None:
    """The default (workers = 1, no address) is the same path as --workers 1: checked once."""
    probe = ("import sys; from typer.testing import CliRunner; from flashrun.cli import app; "
             "r = CliRunner().invoke(app, ['verify', '--workers', '1', '--set', 'experiment.seq_len=4', "
             "'--set', 'experiment.head_dim=16', '--set', 'experiment.num_heads=2']); "
             "print(r.exit_code, 'ray' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(),
                         timeout=PATIENCE_S, check=False)
    assert run.stdout.split() == ["0", "False"], run.stdout + run.stderr
