"""verify's output off a wide terminal, its budget on the interpreter, and what survives Ctrl-C
and out-of-memory: each test here fails without the fix it guards."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner
from watched import PATIENCE_S, Watched

from flashrun.cli import app
from flashrun.harness.check import interpreter_seconds
from flashrun.harness.shapes import Shape

ROOT = Path(__file__).resolve().parent.parent

SLOW_KERNEL = '''
import pathlib, time, torch
def attention(q, k, v, causal=False, sm_scale=None):
    if q.shape[2] == 5:  # the second case: says it started, then waits to be interrupted
        pathlib.Path({marker!r}).touch()
        time.sleep(3600)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1); v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = (q.float() @ k.float().transpose(-2, -1)) * (sm_scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(s.shape[-1] - s.shape[-2] + 1), float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
'''

OOM_KERNEL = '''
import torch
def attention(q, k, v, causal=False, sm_scale=None):
    if q.shape[2] == 3:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1); v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = (q.float() @ k.float().transpose(-2, -1)) * (sm_scale or q.shape[-1] ** -0.5)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
'''

CONFIG = ('[experiment]\nbatch_size = 1\nnum_heads = 2\nhead_dim = 16\ndtype = "float32"\n'
          '[verify]\nseq_len = [3, 5, 7]\n')


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", **extra}


def test_table_keeps_every_number_whole_at_80_columns_piped(isolated: Path) -> None:
    (isolated / "config.toml").write_text('[experiment]\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 32\n'
                                          '[verify]\nseq_len = [1, 97]\ncausal = [false, true]\n')
    proc = subprocess.run([sys.executable, "-m", "flashrun", "verify", "-k", "flash,minimal", "--grad"],
                          capture_output=True, text=True, env=_env(COLUMNS="80"), timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if not line.startswith("  ")]  # notes below are indented
    assert max(len(line) for line in table) <= 80, proc.stdout
    assert "…" not in proc.stdout  # nothing cut
    numbers = re.findall(r"\d\.\d\de[-+]\d\d", proc.stdout)
    assert len(numbers) >= 2 * 6, proc.stdout  # max err and rel L2 of every flash and minimal row that ran
    data_lines = [line for line in proc.stdout.splitlines() if " pass " in line]
    assert all(re.search(r"\d\.\d\d\s*$", line) for line in data_lines), proc.stdout  # first s whole, at the end
    # off a terminal: one line per finished check, as they finish (on stderr, the table on stdout)
    finished = [line for line in proc.stderr.splitlines() if re.match(r"(PASS|UNSUPPORTED) ", line)]
    assert len(finished) == 8, proc.stderr


def test_json_reports_the_first_call_apart_from_the_run_time(isolated: Path) -> None:
    result = CliRunner().invoke(app, ["verify", "--json", "--set", "verify.seq_len=[1]", "--set", "verify.causal=[true]"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["results"]
    assert entry["first_call_s"] > 0
    assert entry["ms"] is None  # not measured through the interpreter
    assert "seconds" not in entry


def test_interpreter_estimate_is_calibrated() -> None:
    # measured on a 2-core CPU, triton 3.9: N=512 D=64 forward 1.3 s; N=256 D=64 fwd+bwd 1.1-1.9 s
    assert 0.7 < interpreter_seconds(Shape(1, 1, 1, 512, 512, 64, "float16", False), grad=False) < 2.6
    assert 0.7 < interpreter_seconds(Shape(1, 1, 1, 256, 256, 64, "float16", False), grad=True) < 3.8
    # the case that made the README's path unfinishable: minutes, not seconds
    assert interpreter_seconds(Shape(2, 4, 4, 16384, 16384, 256, "float16", True), grad=False) > 3600


def test_cases_over_the_interpreter_budget_are_skipped_up_front(isolated: Path) -> None:
    runner = CliRunner()
    args = ["verify", "--json", "--set", "verify.seq_len=[1,4096]", "--set", "experiment.head_dim=16"]
    data = json.loads(runner.invoke(app, args).stdout)
    by_n = {r["case"]["seq_len"]: r for r in data["results"]}
    assert by_n[1]["status"] == "pass"
    assert by_n[4096]["status"] == "skipped" and "--budget 0" in by_n[4096]["message"]
    assert by_n[4096]["first_call_s"] is None  # never ran
    assert any("budget" in n for n in data["notices"])
    # the flag moves the bar: a budget above the estimate runs the case (here: checked by the estimate only)
    estimate = interpreter_seconds(Shape(2, 4, 4, 4096, 4096, 16, "float16", False), grad=False)
    assert estimate > 120


def test_ctrl_c_keeps_the_finished_checks_in_the_record(isolated: Path) -> None:
    started = isolated / "second-case-started"
    (isolated / "slow.py").write_text(SLOW_KERNEL.format(marker=str(started)))
    (isolated / "config.toml").write_text(CONFIG)
    with Watched(["verify", "-k", "slow.py:attention"], _env(), isolated / "stdout.txt") as run:
        # the cases run one after the other: the second one started, so the first is done and kept
        run.wait_for("start of the second case", started.exists)
        code, out, err = run.interrupt()
    assert code == 130, err
    assert "Traceback" not in err
    assert "1 passed, 0 failed (interrupted: 1 of 3 checks ran)" in out  # the table of what finished
    record = json.loads((isolated / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["results"]["interrupted"] is True
    assert [c["case"]["seq_len"] for c in record["results"]["checks"]] == [3]


def test_cpu_out_of_memory_is_that_case_and_the_run_goes_on(isolated: Path) -> None:
    (isolated / "oom.py").write_text(OOM_KERNEL)
    (isolated / "config.toml").write_text(CONFIG)
    result = CliRunner().invoke(app, ["verify", "-k", "oom.py:attention", "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert [r["status"] for r in data["results"]] == ["oom", "pass", "pass"]
    assert "out of memory (CPU)" in data["results"][0]["message"]
    assert json.loads((isolated / "logs" / "runs.jsonl").read_text().splitlines()[-1])["results"]["failed"] == 1


def test_the_launch_config_line_names_the_triton_section_whole() -> None:
    """A config pinned by [triton] is said so in those words: rich must not take "[triton]" for markup."""
    from io import StringIO

    from rich.console import Console

    from flashrun.harness.check import CaseResult
    from flashrun.harness.verify import Report, render

    shape = Shape(batch_size=1, num_heads=2, num_kv_heads=2, seq_len=3, seq_len_k=3, head_dim=16, dtype="float16",
                  causal=False)
    result = CaseResult("flash", shape, "pass", configs={"_attn_fwd": {"config": "64x64 w4 s2", "source": "pinned"}})
    buffer = StringIO()
    render(Report([result], "cuda", []), Console(file=buffer, width=100))
    assert "launch configs: pinned by [triton] (1)" in buffer.getvalue()
