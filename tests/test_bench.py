"""`flashrun bench` on the CPU: the FLOP count, the sweep, the files, and the mechanics of
checking and timing through the plain PyTorch providers on tiny shapes. No test asserts a speed.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

import flashrun
from flashrun.cli import app
from flashrun.config import BenchConfig, load_config
from flashrun.errors import GPUFault, InputError, KernelError
from flashrun.harness import flex, measure, provider, providers, results
from flashrun.harness.bench import provider_names
from flashrun.harness.inputs import make_inputs
from flashrun.harness.judge import Reference
from flashrun.harness.reference import causal_mask
from flashrun.harness.shapes import Shape, bench_shapes, flops, visible_pairs

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()
CPU = torch.device("cpu")
# hidden 32 / D 16 = 2 heads; 32 tokens / N 16 = batch 2; timings kept to a few milliseconds.
TINY_NO_N = ["--device", "cpu", "--head-dims", "16", "--set", "bench.hidden=32", "--set", "bench.tokens=32",
             "--set", "bench.warmup_ms=1", "--set", "bench.rep_ms=2"]
TINY = [*TINY_NO_N, "--seq-lens", "16"]
TORCH_PROVIDERS = "torch-naive,sdpa,sdpa-math"


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def result_files(folder: Path) -> tuple[Path, Path]:
    (csv_path,) = sorted((folder / "logs" / "bench").glob("*.csv"))
    return csv_path, csv_path.with_suffix(".json")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


# -- the FLOP count -------------------------------------------------------------------------------------
def case(**overrides) -> Shape:
    fields = dict(dtype="float16", causal=False, batch_size=2, num_heads=8, num_kv_heads=8, seq_len=1024,
                  seq_len_k=1024, head_dim=64)
    return Shape(**{**fields, **overrides})


def test_flops_forward_is_four_b_h_n_n_d() -> None:
    assert flops(case(), "fwd") == 4 * 2 * 8 * 1024 * 1024 * 64


def test_flops_causal_halves_and_backward_scales() -> None:
    full = flops(case(), "fwd")
    assert flops(case(causal=True), "fwd") == full / 2
    assert flops(case(), "bwd") == 2.5 * full
    assert flops(case(), "fwd_bwd") == 3.5 * full
    assert flops(case(causal=True), "bwd") == 2.5 * full / 2


def test_flops_count_query_heads_under_gqa() -> None:
    assert flops(case(num_kv_heads=2), "fwd") == flops(case(), "fwd")


@pytest.mark.parametrize("n_q,n_k", [(1, 4096), (1, 7), (5, 9), (16, 64), (9, 5), (64, 16), (3, 3)])
def test_visible_pairs_count_the_bottom_right_mask(n_q: int, n_k: int) -> None:
    exact = int(causal_mask(n_q, n_k, "cpu").sum())
    expected = n_q * n_k / 2 if n_q == n_k else exact  # the FlashAttention convention for square
    assert visible_pairs(n_q, n_k, causal=True) == expected
    assert visible_pairs(n_q, n_k, causal=False) == n_q * n_k


def test_decode_flops_use_every_key() -> None:
    decode = case(seq_len=1, seq_len_k=4096, causal=True)
    assert flops(decode, "fwd") == 4 * 2 * 8 * 1 * 4096 * 64


# -- the sweep ------------------------------------------------------------------------------------------
def test_default_sweep_follows_the_flashattention_convention() -> None:
    cases = bench_shapes(BenchConfig())
    assert len(cases) == 6 * 2 * 2  # N x D x causal, float16
    for c in cases:
        assert c.num_heads * c.head_dim == 2048
        assert c.batch_size * c.seq_len == 32768
        assert c.num_kv_heads == c.num_heads and c.seq_len_k == c.seq_len and c.dtype == "float16"
    assert {c.seq_len for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}
    # shape-major: one (dtype, D, causal) block after another, N varying fastest
    assert [c.seq_len for c in cases[:6]] == [512, 1024, 2048, 4096, 8192, 16384]


def test_decode_sweep_sizes_the_batch_by_the_keys() -> None:
    bench = BenchConfig(seq_len=[1], seq_len_k=[4096, 16384], head_dim=[128], causal=[True])
    cases = bench_shapes(bench)
    assert [(c.seq_len, c.seq_len_k, c.batch_size, c.num_heads) for c in cases] == [(1, 4096, 8, 16), (1, 16384, 2, 16)]


def test_sweep_rejects_kv_heads_that_do_not_divide() -> None:
    with pytest.raises(InputError, match="num_kv_heads = 3"):
        bench_shapes(BenchConfig(head_dim=[64], num_kv_heads=3))


def test_flags_override_the_config_lists(isolated: Path) -> None:
    result = invoke(*TINY_NO_N, "-p", "sdpa", "--seq-lens", "16,8", "--seq-lens", "4", "--mode", "fwd,bwd",
                    "--causal", "both", "--dtype", "float32", "--seq-lens-k", "32", "--json")
    assert result.exit_code == 0, result.output + result.stderr
    bench = json.loads(result_files(isolated)[1].read_text())["bench"]
    assert bench["seq_len"] == [16, 8, 4] and bench["seq_len_k"] == [32] and bench["head_dim"] == [16]
    assert bench["mode"] == ["fwd", "bwd"] and bench["causal"] == [False, True] and bench["dtype"] == ["float32"]


def test_dtype_flag_takes_the_short_names(isolated: Path) -> None:
    result = invoke(*TINY, "-p", "sdpa", "--causal", "no", "--dtype", "fp32", "--json")
    assert result.exit_code == 0, result.output + result.stderr
    assert {row["dtype"] for row in json.loads(result.stdout)["rows"]} == {"float32"}  # full names in results
    assert json.loads(result_files(isolated)[1].read_text())["bench"]["dtype"] == ["float32"]


def test_baseline_comes_first_and_kernels_are_added_once() -> None:
    cfg = load_config(flags={"bench.providers": ["sdpa-cudnn", "flash", "sdpa"], "bench.baseline": "sdpa"})
    assert provider_names(cfg, ("flash", "my.py:attn")) == ["sdpa", "sdpa-cudnn", "flash", "my.py:attn"]


# -- user errors: one line, exit 2 ---------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["-p", "sdpa-cudn"], "unknown provider 'sdpa-cudn' (did you mean 'sdpa-cudnn'?)"),
    (["--baseline", "cudnn"], "unknown provider 'cudnn'"),
    (["--causal", "maybe"], "--causal 'maybe': expected yes, no or both"),
    (["--seq-lens", "512,lots"], "--seq-lens: expected whole numbers"),
    (["--mode", "sideways"], "bench.mode"),
    (["--compare", "missing.json"], "missing.json: no such file"),
    (["--plot", "bench.bmpx"], "unknown image format .bmpx"),
    (["--set", "bench.seq_len=[]"], "bench.seq_len is an empty list"),
    (["--out", "taken"], "cannot write the results to"),
])
def test_user_errors_exit_2_without_a_traceback(args: list[str], message: str, isolated: Path) -> None:
    (isolated / "taken").write_text("a file where --out wants a folder")
    result = invoke(*TINY, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output + result.stderr


@pytest.mark.skipif(not NO_GPU, reason="the no-GPU refusal needs a machine without a GPU")
def test_no_gpu_explains_itself_and_exits_2() -> None:
    result = invoke("--seq-lens", "16")
    assert result.exit_code == 2
    assert "no GPU" in result.stderr and "interpreter" in result.stderr and "--device cpu" in result.stderr
    assert not (Path("logs") / "bench").exists()  # nothing measured, nothing written


def test_help_and_option_errors_answer_without_torch() -> None:
    """In a fresh process: `--help` and an option error never import torch or triton."""
    probe = ("import sys; from typer.testing import CliRunner; from flashrun.cli import app; "
             "r1 = CliRunner().invoke(app, ['--help']); r2 = CliRunner().invoke(app, ['bench', '--help']); "
             "r3 = CliRunner().invoke(app, ['bench', '--causal', 'maybe']); "
             "print(r1.exit_code, r2.exit_code, r3.exit_code, 'torch' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["0", "0", "2", "False", "False"], out.stderr


@pytest.mark.skipif(not NO_GPU, reason="the no-GPU refusal needs a machine without a GPU")
def test_real_process_without_a_gpu_exits_2() -> None:
    run = subprocess.run([sys.executable, "-m", "flashrun", "bench"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2
    assert "timings mean nothing" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("flush", ["write", "read"])
def test_gpu_timing_flushes_l2_before_every_timed_call(monkeypatch: pytest.MonkeyPatch, flush: str) -> None:
    """The GPU branch, minus the GPU (CUDA events on a fake clock): do_bench's recipe - one call,
    five estimate calls, warm-up calls for warmup_ms and timed calls for rep_ms - with the L2
    flush of ``[bench] l2_flush`` before each estimate and timed call, gradients reset."""
    log = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool) -> None:
            self.at = None

        def record(self) -> None:
            self.at = Event.clock

        def elapsed_time(self, end: "Event") -> float:
            return end.at - self.at

    def call() -> None:
        Event.clock += 0.5  # a call of half a millisecond
        log.append("call")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(measure, "_l2_flush", lambda device, how: lambda: log.append(f"flush {how}"))
    leaves = [torch.zeros(1, requires_grad=True)]
    leaves[0].grad = torch.ones(1)
    timing = measure.Timing(warmup_ms=1, rep_ms=2, l2_flush=flush)
    assert measure.time_call(call, torch.device("cuda"), timing, leaves) == (0.5, 0.5, 0.5)
    assert log == ["call"] + [f"flush {flush}", "call"] * 5 + ["call"] * 2 + [f"flush {flush}", "call"] * 4
    assert leaves[0].grad is None


# -- the CPU run: mechanics -----------------------------------------------------------------------------
def test_cpu_run_checks_times_and_writes_everything(isolated: Path) -> None:
    result = invoke(*TINY, "-p", f"{TORCH_PROVIDERS},sdpa-cudnn,flex", "--mode", "fwd,bwd,fwd_bwd",
                    "--causal", "both", "--plot", "bench.png")
    assert result.exit_code == 0, result.output + result.stderr
    assert "CPU run" in result.stdout and "sdpa-cudnn" in result.stdout and "setup (prepare" in result.stdout

    csv_path, json_path = result_files(isolated)
    assert csv_path.name.startswith("cpu-")
    header = csv_path.read_text().splitlines()[0].split(",")
    assert header == list(results.COLUMNS + results.EXTRA_COLUMNS)
    assert header[:17] == ["provider", "mode", "dtype", "causal", "batch", "heads", "kv_heads", "seq_len",
                           "head_dim", "ms", "ms_p20", "ms_p80", "tflops", "pct_peak", "peak_mem_mb", "speedup",
                           "correct"]
    rows = read_csv(csv_path)
    assert len(rows) == 5 * 3 * 2  # providers x modes x causal
    for row in rows:
        if row["provider"] in TORCH_PROVIDERS.split(","):
            assert row["status"] == "ok" and row["correct"] == "true", row
            ms, p20, p80 = float(row["ms"]), float(row["ms_p20"]), float(row["ms_p80"])
            assert 0 < p20 <= ms <= p80
            shape = Shape(2, 2, 2, 16, 16, 16, "float16", row["causal"] == "true")
            assert float(row["tflops"]) == pytest.approx(flops(shape, row["mode"]) / ms / 1e9, rel=1e-4)
            assert float(row["max_err"]) <= 1e-2
            assert row["pct_peak"] == "" and row["peak_mem_mb"] == ""  # GPU-only measures
            assert float(row["setup_s"]) > 0
        else:
            assert row["status"] == "n/a" and row["correct"] == "" and row["ms"] == ""
            assert "not timed on the CPU" in row["note"]
    assert {r["speedup"] for r in rows if r["provider"] == "sdpa"} == {"1"}

    document = json.loads(json_path.read_text())
    assert document["complete"] is True
    assert document["command"].startswith("flashrun ") and document["device"] == "cpu"
    assert {"torch", "triton", "python", "platform"} <= set(document["env"])
    assert "switches" not in document["env"]  # none set (conftest drops FLASHRUN_*)
    assert len(document["rows"]) == len(rows)
    assert document["rows"][0]["provider"] == rows[0]["provider"]

    png = isolated / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    record = json.loads((isolated / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["command"] == "bench" and record["n_cases"] == 2 and record["kernels"] == []
    assert record["results"]["best_tflops"] > 0 and record["results"]["wrong"] == 0


def test_decode_and_partial_causal_shapes_match_the_bottom_right_reference(isolated: Path) -> None:
    """Nq = 1 against many keys, and 8 queries against 32 keys: SDPA's is_causal is top-left, so
    these pass only if the providers express the bottom-right mask of the reference."""
    for nq, nk in (("1", "64"), ("8", "32")):
        result = invoke(*TINY_NO_N, "-p", TORCH_PROVIDERS, "--seq-lens", nq, "--seq-lens-k", nk, "--causal", "yes",
                        "--mode", "fwd,bwd", "--json")
        assert result.exit_code == 0, result.output + result.stderr
        rows = json.loads(result.stdout)["rows"]
        assert {(r["status"], r["correct"]) for r in rows} == {("ok", True)}, rows
        assert all(r["seq_len"] == int(nq) and r["seq_len_k"] == int(nk) for r in rows)


def test_gqa_shapes_are_checked_with_complete_kv_gradients(isolated: Path) -> None:
    result = invoke(*TINY, "-p", TORCH_PROVIDERS, "--set", "bench.hidden=64", "--set", "bench.num_kv_heads=2",
                    "--mode", "bwd", "--causal", "both", "--json")
    assert result.exit_code == 0, result.output + result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert {(r["heads"], r["kv_heads"]) for r in rows} == {(4, 2)}
    assert {(r["status"], r["correct"]) for r in rows} == {("ok", True)}, rows


def test_compare_prints_ratios_against_an_earlier_file(isolated: Path) -> None:
    assert invoke(*TINY, "-p", "sdpa,torch-naive").exit_code == 0
    csv_path, json_path = result_files(isolated)
    for earlier in (json_path, csv_path):
        result = invoke(*TINY, "-p", "sdpa,sdpa-math", "--compare", str(earlier), "--json")
        assert result.exit_code == 0, result.stderr
        compare = json.loads(result.stdout)["compare"]
        assert compare["file"] == str(earlier)
        assert {r["provider"] for r in compare["ratios"]} == {"sdpa"}  # sdpa-math was not in the earlier run
        before = {(r["provider"], r["causal"] == "true"): float(r["ms"]) for r in read_csv(csv_path)}
        assert len(compare["ratios"]) == 2  # fwd, causal and not
        for ratio in compare["ratios"]:
            assert ratio["before_ms"] == pytest.approx(before[ratio["provider"], ratio["causal"]], rel=1e-5)
            assert ratio["ratio"] == pytest.approx(ratio["before_ms"] / ratio["ms"])
    printed = invoke(*TINY, "-p", "sdpa", "--compare", str(json_path))
    assert "before / now" in printed.stdout


def test_the_compare_table_wraps_a_long_shape_whole() -> None:
    """A KV-cache row's shape names every sequence's length: at 80 columns it wraps, never cut."""
    from rich.console import Console

    from flashrun.harness.bench import BenchReport
    from flashrun.harness.bench_table import _render_compare

    lengths = tuple([8192] * 16)
    row = results.Row(provider="flash", mode="fwd", dtype="bfloat16", causal=False, batch=16, heads=32, kv_heads=8,
                      seq_len=1, head_dim=128, ms=0.138, ms_p20=0.138, ms_p80=0.138, tflops=15.5, pct_peak=2.0,
                      peak_mem_mb=0.0, speedup=1.0, correct=True, seq_len_k=8192, status="ok", max_err=1e-3, note="",
                      setup_s=1.0, gpu="NVIDIA H200", torch="2.11", triton="3.6", timestamp="now",
                      cache_seqlens=lengths, page_size=16)
    report = BenchReport([row], {}, "cuda", 798.0, compare_file="earlier.json",
                         ratios=[results.Ratio(row, 0.141)])
    console = Console(width=80, force_terminal=False, record=True)
    _render_compare(report, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "".join(line.strip(" │") for line in text.splitlines()).count("8192") >= 16, text


def test_a_suite_names_its_compare_file_relative_to_itself(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark suite is a config whose [bench].compare names the committed run, found from the
    suite's own folder wherever the command runs; --compare on the command line wins."""
    assert invoke(*TINY, "-p", "sdpa").exit_code == 0
    _, json_path = result_files(isolated)
    suite = isolated / "suites" / "tiny.toml"
    suite.parent.mkdir()
    (isolated / "committed.json").write_text(json_path.read_text())
    suite.write_text('[bench]\nproviders = ["sdpa"]\ncompare = "../committed.json"\n')
    elsewhere = isolated / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = invoke(*TINY, "--config", str(suite), "--json")
    assert result.exit_code == 0, result.stderr
    assert Path(json.loads(result.stdout)["compare"]["file"]).resolve() == (isolated / "committed.json").resolve()
    result = invoke(*TINY, "--config", str(suite), "--compare", str(json_path), "--json")
    assert json.loads(result.stdout)["compare"]["file"] == str(json_path)


def test_compare_refuses_a_file_that_is_not_results_before_running(isolated: Path) -> None:
    (isolated / "notes.json").write_text('{"hello": 1}')
    result = invoke(*TINY, "--compare", "notes.json")
    assert result.exit_code == 2 and "not a flashrun bench results file" in result.stderr
    assert not (isolated / "logs" / "bench").exists()


def test_results_files_mask_a_key_given_on_the_command_line(tmp_path: Path) -> None:
    from flashrun.records.redact import register_secret

    key = "sk-bench-NEVER-SHOW-0c1d2e3f"
    register_secret(key)
    argv = ["bench", "--set", f"api.api_key={key}"]
    header = {"command": "flashrun " + " ".join(argv), "argv": argv}
    row = results.Row(**{**{f.name: None for f in fields(results.Row)},
                         "provider": "sdpa", "status": "n/a", "note": f"refused: {key}"})
    results.write(tmp_path / "r.csv", tmp_path / "r.json", [row], header, complete=True)
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["argv"] == ["bench", "--set", "api.api_key=***"]
    assert document["command"] == "flashrun bench --set api.api_key=***"
    assert document["rows"][0]["note"] == "refused: ***"
    assert read_csv(tmp_path / "r.csv")[0]["note"] == "refused: ***"


def test_an_oom_cell_says_so_and_the_sweep_goes_on(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_resolve = providers.resolve

    def resolve(name: str, device: torch.device) -> provider.Provider:
        if name != "torch-naive":
            return real_resolve(name, device)

        def fn(q, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

        return provider.Provider(name, lambda c, d: provider.Attention(fn))

    monkeypatch.setattr(providers, "resolve", resolve)
    result = invoke(*TINY_NO_N, "-p", "torch-naive,sdpa", "--seq-lens", "16,32", "--causal", "no", "--json")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["provider"], r["seq_len"], r["status"]) for r in rows] == [
        ("sdpa", 16, "ok"), ("torch-naive", 16, "OOM"), ("sdpa", 32, "ok"), ("torch-naive", 32, "OOM")]


def test_a_shape_whose_inputs_do_not_fit_is_oom_and_the_sweep_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    real_make_sets = measure.make_sets

    def make_sets(shape: Shape, device: torch.device, seed: int):
        if shape.seq_len == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 GiB")
        return real_make_sets(shape, device, seed)

    monkeypatch.setattr(measure, "make_sets", make_sets)
    result = invoke(*TINY_NO_N, "-p", "sdpa,torch-naive", "--seq-lens", "32,16", "--causal", "no", "--json")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["seq_len"], r["status"]) for r in rows] == [(32, "OOM"), (32, "OOM"), (16, "ok"), (16, "ok")]


def test_an_interrupted_run_keeps_the_rows_measured_so_far(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_measure = measure.measure
    calls = []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(measure, "measure", interrupting)
    result = invoke(*TINY, "-p", "sdpa,torch-naive", "--causal", "no")
    assert result.exit_code == 130
    csv_path, json_path = result_files(isolated)
    assert [r["provider"] for r in read_csv(csv_path)] == ["sdpa"]
    assert json.loads(json_path.read_text())["complete"] is False


# -- one provider on one case: verdicts -----------------------------------------------------------------
TINY_CASE = Shape(2, 4, 2, 16, 16, 16, "float32", True)
TIMING = measure.Timing(warmup_ms=1, rep_ms=2)


def run_one(provider: provider.Provider, modes=("fwd", "bwd"), tiny: Shape = TINY_CASE) -> list[measure.Cell]:
    sets = measure.make_sets(tiny, CPU, seed=0)
    ref = Reference.for_shape(sets[0], tiny, grads=any(m != "fwd" for m in modes), edges=True)
    return measure.measure(provider, tiny, sets, ref, list(modes), CPU, TIMING)


def plain(fn: Callable, backward: bool = True) -> provider.Provider:
    return provider.Provider("test", lambda c, d: provider.Attention(fn), backward=backward)


def naive_fn(q, k, v, causal=True, scale_by=1.0):
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-2, -1) * scale_by / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_a_correct_provider_is_timed_in_every_mode() -> None:
    cells = run_one(plain(naive_fn), modes=("fwd", "bwd", "fwd_bwd"))
    assert [(c.mode, c.status, c.correct) for c in cells] == [
        ("fwd", "ok", True), ("bwd", "ok", True), ("fwd_bwd", "ok", True)]
    assert all(c.ms is not None and c.ms[0] > 0 for c in cells)


def test_a_wrong_provider_is_flagged_and_not_timed() -> None:
    cells = run_one(plain(lambda q, k, v: naive_fn(q, k, v, causal=False)))  # forgets the mask
    assert [(c.status, c.correct, c.ms) for c in cells] == [("wrong", False, None)] * 2
    assert "out: max error" in cells[0].note


def test_wrong_gradients_are_flagged_even_when_the_output_is_right() -> None:
    class ZeroGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.shapes = (q.shape, k.shape, v.shape)
            return naive_fn(q, k, v)

        @staticmethod
        def backward(ctx, dout):
            return tuple(torch.zeros(shape, dtype=dout.dtype) for shape in ctx.shapes)

    fwd, bwd = run_one(plain(ZeroGrad.apply))
    assert (fwd.status, bwd.status) == ("ok", "wrong")
    assert bwd.note.startswith("dq: max error")


def test_an_output_of_the_wrong_kind_is_wrong_not_a_crash() -> None:
    tuple_out = run_one(plain(lambda q, k, v: (naive_fn(q, k, v), None)), modes=("fwd",))
    assert tuple_out[0].status == "wrong" and "returned tuple" in tuple_out[0].note
    short = run_one(plain(lambda q, k, v: naive_fn(q, k, v)[:, :, :1]), modes=("fwd",))
    assert short[0].status == "wrong" and "shape (2, 4, 1, 16)" in short[0].note


def test_a_backward_that_skips_an_input_is_wrong() -> None:
    class NoKGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                ctx.out, ctx.leaves = naive_fn(*leaves), leaves
            return ctx.out.detach()

        @staticmethod
        def backward(ctx, dout):
            dq, _, dv = torch.autograd.grad(ctx.out, ctx.leaves, dout)
            return dq, None, dv

    fwd, bwd = run_one(plain(NoKGrad.apply))
    assert fwd.status == "ok" and (bwd.status, bwd.note) == ("wrong", "the backward left a gradient of q, k or v unset")


def test_a_failure_while_checking_costs_the_cell_not_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_judge(self, out, grads=None, poison=None):
        raise IndexError("index 3 is out of bounds")

    monkeypatch.setattr(Reference, "judge", broken_judge)
    cells = run_one(plain(naive_fn))
    note = "could not check this provider: IndexError: index 3 is out of bounds"
    assert {(c.status, c.note) for c in cells} == {("n/a", note)}


def test_the_checked_slice_reaches_the_last_batch_element_and_kv_head() -> None:
    def last_batch_off(q, k, v):
        out = naive_fn(q, k, v)
        return torch.cat([out[:-1], out[-1:] * 1.5])

    def last_kv_head_off(q, k, v):  # the last kv head's keys, seen through its last query head
        return torch.cat([naive_fn(q, k, v)[:, :-1], naive_fn(q[:, -1:], k[:, -1:] * 2, v[:, -1:])], dim=1)

    assert run_one(plain(last_batch_off), modes=("fwd",))[0].status == "wrong"
    assert run_one(plain(last_kv_head_off), modes=("fwd",))[0].status == "wrong"


def test_nan_output_is_wrong() -> None:
    cells = run_one(plain(lambda q, k, v: naive_fn(q, k, v) * float("nan")), modes=("fwd",))
    assert cells[0].status == "wrong" and "NaN/Inf" in cells[0].note


def test_a_refusal_is_na_with_the_reason_and_oom_is_oom() -> None:
    def refuses(q, k, v):
        raise KernelError("minimal takes seq_len <= 64, got 128")

    def ooms(q, k, v):
        raise torch.OutOfMemoryError("CUDA out of memory")

    reason = "minimal takes seq_len <= 64, got 128"
    assert [(c.status, c.note) for c in run_one(plain(refuses))] == [("n/a", reason)] * 2
    assert [c.status for c in run_one(plain(ooms))] == ["OOM", "OOM"]


def test_a_forward_only_provider_has_na_backward_cells() -> None:
    fwd, bwd = run_one(plain(naive_fn, backward=False))
    assert fwd.status == "ok" and (bwd.status, bwd.note) == ("n/a", "test has no backward")
    detached = run_one(plain(lambda q, k, v: naive_fn(q, k, v).detach()))
    assert detached[1].status == "n/a" and "no backward" in detached[1].note


def test_a_broken_gpu_stops_the_run() -> None:
    def crashes(q, k, v):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(GPUFault, match="left the GPU unusable"):
        run_one(plain(crashes))


def test_sdpa_refusal_reason_comes_from_its_warnings() -> None:
    caught = [warnings.WarningMessage(text, UserWarning, "x.py", 1) for text in (
        "Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:1)",
        "Flash attention requires q,k,v to have the same last dimension and to be a multiple of 8. "
        "(Triggered internally at sdp_utils.cpp:2)",
    )]
    reason = providers.failure_reason("sdpa-flash", RuntimeError("No available kernel. Aborting execution."), caught)
    assert reason == ("SDPA flash backend refused this case: Flash attention requires q,k,v to have the same "
                      "last dimension and to be a multiple of 8.")


def test_cpu_providers_refuse_scores_too_large_for_memory() -> None:
    huge = Shape(2, 32, 32, 16384, 16384, 64, "float16", False)
    for name in ("torch-naive", "sdpa-math"):
        with pytest.raises(KernelError, match="too large for a CPU run"):
            providers.resolve(name, CPU).prepare(huge, CPU)


def test_flex_settings_keep_one_compile_per_shape_and_a_rerunnable_backward() -> None:
    # Backward is timed alone and repeatedly on one graph: with donated buffers, compiled
    # FlexAttention refused that on the H200 ("compiled with non-empty donated buffers").
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    before = functorch_config.donated_buffer, dynamo_config.recompile_limit
    with flex.compile_settings(48):
        assert functorch_config.donated_buffer is False
        assert dynamo_config.recompile_limit >= 48
    assert (functorch_config.donated_buffer, dynamo_config.recompile_limit) == before


def test_sdpa_cudnn_on_the_cpu_is_na() -> None:
    cells = run_one(providers.resolve("sdpa-cudnn", CPU))
    assert {(c.status, c.correct) for c in cells} == {("n/a", None)}


def test_input_sets_rotate_only_when_they_fit_in_cache() -> None:
    small = measure.make_sets(TINY_CASE, CPU, seed=0)
    assert len(small) == measure.ROTATED_SETS > 1
    assert not torch.equal(small[0].q, small[1].q)  # fresh draws, not copies
    assert all(int(s.q.count_nonzero()) == s.q.numel() for s in small)  # never zeros
    # q, k, v and dout of 8 MiB each: 32 MiB, the nominal CPU cache -> a single set
    large = Shape(1, 1, 1, 1 << 20, 1 << 20, 4, "float16", False)
    assert len(measure.make_sets(large, CPU, seed=0)) == 1


def test_bench_and_verify_draw_the_same_inputs_for_a_seed() -> None:
    """A failing bench row is reproduced by `flashrun verify --seed S`: its first input set is
    what verify's one generator draws for that shape and seed."""
    first = measure.make_sets(TINY_CASE, CPU, seed=5)[0]
    verify = make_inputs(TINY_CASE, 5, CPU)[0]
    for got, want in zip((first.q, first.k, first.v, first.dout), (verify.q, verify.k, verify.v, verify.dout)):
        assert torch.equal(got.detach(), want)


# -- our kernels and users' PATH.py:FUNCTION ------------------------------------------------------------
USER_KERNELS = textwrap.dedent('''
    import torch

    def _mask(nq, nk, device):
        rows = torch.arange(nq, device=device)[:, None]
        return torch.arange(nk, device=device)[None, :] <= rows + (nk - nq)

    def attention(q, k, v, causal=False, sm_scale=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(-2, -1) * (sm_scale or q.shape[-1] ** -0.5)
        if causal:
            s = s.masked_fill(~_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
        return torch.softmax(s, -1) @ v

    def unscaled(q, k, v, causal=False, sm_scale=None):
        return attention(q, k, v, causal, sm_scale=1.0)
''')


@dataclass(frozen=True)
class _StandInKernel:
    name: str
    fn: Callable
    supports_backward: bool

    def __call__(self, q, k, v, causal=False, sm_scale=None):
        return self.fn(q, k, v, causal=causal, sm_scale=sm_scale)


def _stand_in_get(spec: str) -> _StandInKernel:
    path, _, func = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"user_kernel_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return _StandInKernel(spec, getattr(module, func), supports_backward=True)


@pytest.fixture
def kernels_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real flashrun.kernels when it exists; until then a stand-in with its contract."""
    from flashrun import device

    device.select("cpu")  # kernels are imported only after the device is chosen
    if importlib.util.find_spec("flashrun.kernels") is None:
        stand_in = types.ModuleType("flashrun.kernels")
        stand_in.get = _stand_in_get
        monkeypatch.setitem(sys.modules, "flashrun.kernels", stand_in)
        monkeypatch.setattr(flashrun, "kernels", stand_in, raising=False)


@pytest.mark.usefixtures("kernels_module")
def test_user_kernels_are_checked_and_timed_like_any_provider(isolated: Path) -> None:
    (isolated / "mine.py").write_text(USER_KERNELS)
    good = providers.resolve(f"{isolated / 'mine.py'}:attention", torch.device("cuda"))  # loaded as for a GPU
    bad = providers.resolve(f"{isolated / 'mine.py'}:unscaled", torch.device("cuda"))
    assert good.is_kernel and good.backward
    assert [(c.status, c.correct) for c in run_one(good)] == [("ok", True)] * 2
    assert [(c.status, c.correct) for c in run_one(bad)] == [("wrong", False)] * 2


def test_kernels_are_not_timed_on_the_cpu(isolated: Path) -> None:
    (isolated / "mine.py").write_text(USER_KERNELS)
    result = invoke(*TINY, "-p", "sdpa", "-k", "flash", "-k", "mine.py:attention", "--json")
    assert result.exit_code == 0, result.stderr
    rows = {r["provider"]: r for r in json.loads(result.stdout)["rows"]}
    for name in ("flash", "mine.py:attention"):
        assert rows[name]["status"] == "n/a" and "interpreter" in rows[name]["note"]
    record = json.loads((isolated / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["kernels"] == ["flash", "mine.py:attention"]


def test_the_table_keeps_providers_and_numbers_whole_at_80_columns() -> None:
    """A GPU run's table (with % peak and MB) printed to a pipe: only the shape label may wrap."""
    from rich.console import Console

    from flashrun.harness.bench import BenchReport
    from flashrun.harness.bench_table import render

    def row(provider: str, ms: float, path: str = "") -> results.Row:
        return results.Row(provider=provider, mode="fwd", dtype="bfloat16", causal=True, batch=16, heads=32,
                           kv_heads=8, seq_len=16384, head_dim=128, ms=ms, ms_p20=ms, ms_p80=ms, tflops=512.25,
                           pct_peak=64.2, peak_mem_mb=12345.0, speedup=1.0123, correct=True, seq_len_k=16384,
                           status="ok", max_err=1e-3, note="", setup_s=1.0, gpu="NVIDIA H200", torch="2.11",
                           triton="3.6", timestamp="now", path=path)

    console = Console(width=80, force_terminal=False, record=True)
    render(BenchReport([row("sdpa", 12.345), row("flash-deterministic", 11.111), row("sdpa-cudnn", 10.5)], {},
                       "cuda", 798.0), console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for whole in ("flash-deterministic", "sdpa-cudnn", "12.345", "11.111", "512.2", "12345", "1.01x"):
        assert whole in text, text


def test_bench_says_which_paths_flash_ran(tmp_path) -> None:
    """flash's forward and backward may run Gluon sm_90 kernels or the portable ones: the rows, the
    files and the table say which, the backward's on bwd cells (here the interpreter's: portable)."""
    from rich.console import Console

    from flashrun import device
    from flashrun.harness.bench import BenchReport
    from flashrun.harness.bench_table import render

    device.select("cpu")
    from flashrun import kernels

    flash = kernels.get("flash")
    q = torch.randn(1, 2, 17, 16, requires_grad=True)
    torch.autograd.grad(flash(q, q, q), q, torch.ones_like(q))
    assert flash.path() == "triton" and flash.backward_path() == "triton"
    assert kernels.get("minimal").path is None and kernels.get("minimal").backward_path is None

    row = results.Row(**{**{f.name: None for f in fields(results.Row)}, "provider": "flash", "mode": "fwd",
                         "dtype": "float16", "causal": False, "batch": 1, "heads": 2, "kv_heads": 2, "seq_len": 17,
                         "seq_len_k": 17, "head_dim": 16, "status": "ok", "note": "", "gpu": "g",
                         "timestamp": "now", "window": (-1, -1), "softcap": 0.0, "alibi": False,
                         "where": "", "path": "gluon-sm90"})
    bwd = dataclasses.replace(row, mode="bwd", path="gluon-sm90+dq")
    console = Console(width=80, force_terminal=False, record=True)
    render(BenchReport([row, row, bwd], {}, "cuda", None), console)
    text = console.export_text()
    assert "forward path flash: gluon-sm90 (2 cells)" in text and "backward path flash: gluon-sm90+dq (1 cell)" in text
    results.write(tmp_path / "r.csv", tmp_path / "r.json", [row], {}, complete=True)
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["path"] == "gluon-sm90"


@pytest.mark.parametrize("n_q, n_k, grad", [(32, 32, True), (1, 64, False), (4, 64, False)],
                         ids=["square", "decode", "few-queries"])
def test_a_decode_like_forward_is_timed_as_inference(monkeypatch, n_q, n_k, grad):
    """The forward is timed with inputs that require grad (as in training), except where a
    shape has fewer queries than keys: a generation loop calls those under no_grad, and a
    Python autograd.Function's host time would be timed into short calls."""
    from flashrun.harness import measure
    from flashrun.harness.judge import Reference
    from flashrun.harness.providers import resolve
    from flashrun.harness.shapes import Shape

    seen = []
    real = measure.time_call
    monkeypatch.setattr(measure, "time_call", lambda fn, *a, **kw: seen.append(getattr(fn(), "requires_grad", "backward"))
                        or real(fn, *a, **kw))
    shape = Shape(1, 2, 1, n_q, n_k, 16, "float32", False)
    sets = measure.make_sets(shape, torch.device("cpu"), 0)
    cells = measure.measure(resolve("sdpa", torch.device("cpu")), shape, sets,
                            Reference.for_shape(sets[0], shape, grads=True), ["fwd", "fwd_bwd"],
                            torch.device("cpu"), measure.Timing(1, 2))
    assert [c.status for c in cells] == ["ok", "ok"], [c.note for c in cells]
    assert seen == [grad, "backward"]


def test_flash_fp8_is_judged_by_the_fp8_rule_and_refused_where_it_cannot_run() -> None:
    """The e4m3 provider through the interpreter: right by FlashAttention-3's rule on the inputs
    it quantized (a plain bf16 judge would fail it: its error is e4m3's), n/a for a backward, for a
    shape that is not bf16, and for a variant it does not run; on the CPU bench refuses to time it."""
    fp8 = provider.Provider("flash-fp8", providers._flash_fp8, backward=False, is_kernel=True)
    shape = Shape(2, 4, 2, 33, 33, 64, "bfloat16", True)
    cells = run_one(fp8, modes=("fwd", "bwd"), tiny=shape)
    assert [(c.mode, c.status) for c in cells] == [("fwd", "ok"), ("bwd", "n/a")], cells
    sets = measure.make_sets(shape, CPU, seed=0)
    plain_judge = Reference.for_shape(sets[0], shape, grads=False, edges=True)
    out = providers._flash_fp8(shape, CPU).fn(sets[0].q, sets[0].k, sets[0].v)
    assert not all(c.passed for c in plain_judge.judge(out))  # e4m3's error is beyond bf16's rule
    for bad, reason in ((Shape(1, 2, 2, 8, 8, 64, "float16", False), "writes bf16"),
                        (Shape(1, 2, 2, 8, 8, 64, "bfloat16", False, softcap=5.0), "not cap5")):
        with pytest.raises(KernelError, match=reason):
            providers._flash_fp8(bad, CPU)
    assert "not timed on the CPU" in run_one(providers.resolve("flash-fp8", CPU), ("fwd",), shape)[0].note


def test_cudnn_fp8_says_what_it_cannot_time(monkeypatch) -> None:
    """cuDNN's e4m3 forward (a GPU provider): n/a on the CPU; shapes it does not serve and a
    missing frontend package are refused with the reason before any graph is built."""
    from flashrun.harness import cudnn_fp8

    shape = Shape(1, 2, 2, 16, 16, 64, "bfloat16", True)
    assert "not timed on the CPU" in run_one(providers.resolve("cudnn-fp8", CPU), ("fwd",), shape)[0].note
    for bad, reason in ((Shape(1, 2, 2, 8, 8, 64, "float16", False), "bfloat16 shapes"),
                        (Shape(1, 2, 2, 8, 8, 64, "bfloat16", False, softcap=5.0), "not cap5"),
                        (Shape(1, 2, 2, 8, 16, 64, "bfloat16", True), "Nq != Nk")):
        with pytest.raises(KernelError, match=reason):
            cudnn_fp8._refuse_unserved(bad, CPU)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # as if not installed
    with pytest.raises(KernelError, match="nvidia-cudnn-frontend"):
        cudnn_fp8._cudnn()
