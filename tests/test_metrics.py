"""`bench --metrics`, `--profile` and the roofline, on the CPU: reading a compiled kernel's metadata
(from a checked-in fixture: no kernel can be loaded here), the occupancy and roofline maths, the
trace writer, Proton's child process, the per-kernel CSV, the tables at 80 columns, and the refusal
without a GPU. The GPU suite (tests/test_gpu.py) reads a kernel launched for real and checks it
against ``ptxas -v``.
"""

from __future__ import annotations

import collections
import json
import pickle
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from flashrun.cli import app
from flashrun.harness import (
    measure,
    metrics,
    probe,
    proton_pass,
    provider,
    results,
    sweep,
)
from flashrun.harness.bench import BenchReport
from flashrun.harness.bench_table import render
from flashrun.harness.judge import Reference
from flashrun.harness.metrics import (
    CallMetrics,
    Ceilings,
    KernelLaunch,
    KernelTime,
    SMLimits,
    bytes_moved,
    occupancy,
    parse_ptxas,
    read_kernel,
)
from flashrun.harness.shapes import Shape, flops

FIXTURE = Path(__file__).parent / "data" / "article_fwd_sm90"
H200 = SMLimits(sms=132)  # sm_90: 2048 threads, 32 programs, 64 Ki registers, 228 KiB shared per SM
TINY = ["bench", "--device", "cpu", "--head-dims", "16", "--set", "bench.hidden=32", "--set", "bench.tokens=32",
        "--set", "bench.warmup_ms=1", "--set", "bench.rep_ms=2", "--seq-lens", "16", "-p", "sdpa"]


def fixture_kernel() -> SimpleNamespace:
    """The fixture as a launched ``CompiledKernel`` looks to :func:`read_kernel`: its metadata
    file read the way Triton reads it (a namedtuple of its keys), and the registers and local
    memory the driver would report - here ptxas -v's, which the GPU suite shows are the same."""
    data = json.loads((FIXTURE / "_article_fwd.json").read_text())
    meta = collections.namedtuple("KernelMetadata", sorted(data))(**data)
    (usage,) = parse_ptxas((FIXTURE / "ptxas.log").read_text()).values()
    return SimpleNamespace(metadata=meta, n_regs=usage.regs, n_spills=usage.stack_bytes // 4, hash=data["hash"])


# -- a compiled kernel's metadata -----------------------------------------------------------------------
def test_reads_a_compiled_kernel_from_the_fixture() -> None:
    kernel = read_kernel(fixture_kernel(), (16, 32), H200, launches=1)
    assert (kernel.name, kernel.grid, kernel.num_warps, kernel.num_ctas) == ("_article_fwd", (16, 32, 1), 4, 1)
    assert (kernel.regs, kernel.spill_bytes, kernel.shared) == (152, 0, 24576)
    # 152 registers x 32 threads = 4864 per warp (19 x 256): 3 warps per register quarter of
    # 16384, 12 per SM, so 3 programs of 4 warps; shared would allow 233472 // (24576 + 1024) = 9.
    assert (kernel.programs_per_sm, kernel.limiter) == (3, "registers")
    assert kernel.occupancy_pct == pytest.approx(100 * 12 / 64)
    assert kernel.waves == pytest.approx(16 * 32 / (132 * 3))
    assert kernel.hash == json.loads((FIXTURE / "_article_fwd.json").read_text())["hash"]


def test_the_fixture_is_what_this_triton_compiles(python) -> None:
    result = python(str(Path(__file__).parent / "metrics_fixture.py"), "--check")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("warps,regs,shared,programs,limiter", [
    (8, 255, 0, 1, "registers"),  # 255 -> 8192 per warp: 2 warps a quarter, 8 an SM: one program
    (4, 128, 0, 4, "registers"),  # 4096 per warp: 4 a quarter, 16 an SM
    (4, 32, 160 << 10, 1, "shared"),  # 160 KiB + 1 KiB reserved fits once in 228 KiB
    (4, 40, 48 << 10, 4, "shared"),  # 49 KiB: 4 programs
    (8, 32, 0, 8, "registers"),  # registers and threads both allow 8: registers named first
    (1, 16, 0, 32, "programs"),  # 32 programs of one warp: the cap on resident programs
])
def test_occupancy_follows_the_scarcest_resource(warps, regs, shared, programs, limiter) -> None:
    occ = occupancy(H200, warps, regs, shared)
    assert (occ.programs_per_sm, occ.limiter) == (programs, limiter)
    assert occ.pct == pytest.approx(100 * programs * warps / 64)


def test_waves_count_programs_over_what_all_sms_hold() -> None:
    assert metrics.waves(132 * 2, H200, per_sm=2) == 1.0
    assert metrics.waves(132 * 2 + 1, H200, per_sm=2) == pytest.approx(1 + 1 / 264)  # a nearly empty tail wave
    assert metrics.waves(10, H200, per_sm=0) is None  # nothing fits: the launch fails


def test_sm_limits_come_from_the_device_properties() -> None:
    h200 = SimpleNamespace(major=9, minor=0, multi_processor_count=132, max_threads_per_multi_processor=2048,
                           shared_memory_per_multiprocessor=233472, warp_size=32)
    assert metrics.sm_limits(h200) == H200
    ada = SimpleNamespace(major=8, minor=9, multi_processor_count=128, max_threads_per_multi_processor=1536,
                          shared_memory_per_multiprocessor=102400, warp_size=32, regs_per_multiprocessor=65536)
    limits = metrics.sm_limits(ada)
    assert (limits.max_programs, limits.max_warps, limits.shared_bytes) == (24, 48, 102400)
    older_torch = SimpleNamespace(**{k: v for k, v in vars(h200).items() if k != "shared_memory_per_multiprocessor"})
    assert metrics.sm_limits(older_torch) == H200  # what sm_90 has, from the table


PTXAS_OLD = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_attn_bwd_dkdv' for 'sm_90a'
ptxas info    : Function properties for _attn_bwd_dkdv
    152 bytes stack frame, 148 bytes spill stores, 160 bytes spill loads
ptxas info    : Used 255 registers, 384 bytes cmem[0]
ptxas info    : Compiling entry function '_attn_bwd_dq' for 'sm_90a'
ptxas info    : Function properties for _attn_bwd_dq
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, 384 bytes cmem[0]
"""


def test_ptxas_logs_are_read_per_entry_function() -> None:
    assert parse_ptxas(PTXAS_OLD) == {"_attn_bwd_dkdv": metrics.PtxasUsage(255, 152, 148, 160),
                                      "_attn_bwd_dq": metrics.PtxasUsage(168, 0, 0, 0)}
    assert parse_ptxas((FIXTURE / "ptxas.log").read_text()) == {"_article_fwd": metrics.PtxasUsage(152, 0, 0, 0)}


def test_launches_are_grouped_per_kernel_and_grid() -> None:
    article, other = fixture_kernel(), fixture_kernel()
    seen = [(article, (16, 32)), (other, (4,)), (article, (16, 32)), (article, (8, 32))]
    got = probe.kernel_launches(seen, H200)
    assert [(k.grid, k.launches) for k in got] == [((16, 32, 1), 2), ((4, 1, 1), 1), ((8, 32, 1), 1)]


def test_the_launch_capture_sees_the_grid_and_puts_triton_back() -> None:
    from triton.compiler.compiler import CompiledKernel

    original = CompiledKernel.launch_metadata
    stand_in = SimpleNamespace(name="_k", function=0, src=None, _init_handles=lambda: None)
    with probe.launches() as seen:
        assert CompiledKernel.launch_metadata is not original
        CompiledKernel.launch_metadata(stand_in, (7, 1, 1), 0)  # what every launch calls, with its grid
    assert seen == [(stand_in, (7, 1, 1))]
    assert CompiledKernel.launch_metadata is original


# -- the roofline -------------------------------------------------------------------------------------
def shape(**overrides) -> Shape:
    return Shape(**{**dict(batch_size=2, num_heads=8, num_kv_heads=8, seq_len=1024, seq_len_k=1024, head_dim=64,
                           dtype="float16", causal=False), **overrides})


def test_bytes_moved_read_inputs_and_write_outputs_once() -> None:
    q = 2 * 1024 * 8 * 64 * 2  # B x N x H x D x 2 bytes
    assert bytes_moved(shape(), "fwd") == 4 * q  # q, k, v in; o out
    assert bytes_moved(shape(), "bwd") == 8 * q  # q, k, v, o, do in; dq, dk, dv out
    assert bytes_moved(shape(), "fwd_bwd") == 12 * q
    gqa = bytes_moved(shape(num_kv_heads=2), "fwd")
    assert gqa == 2 * q + 2 * q / 4  # k and v have a quarter of the heads
    decode = shape(seq_len=1, seq_len_k=4096, dtype="bfloat16")
    assert bytes_moved(decode, "fwd") == 2 * 8 * 64 * 2 * (2 * 1 + 2 * 4096)
    packed = shape(seqlens=(100, 0, 28), seqlens_k=(50, 10, 4), batch_size=3, seq_len=100, seq_len_k=50)
    assert bytes_moved(packed, "fwd") == 8 * 64 * 2 * (2 * 128 + 2 * 64)


def test_square_forward_intensity_is_half_the_length_and_decode_is_memory_bound() -> None:
    assert flops(shape(), "fwd") / bytes_moved(shape(), "fwd") == 1024 / 2  # fp16, full: N / 2 FLOP/B
    h200 = Ceilings(tflops=800.0, gbps=4000.0)
    assert h200.ridge == 200.0
    decode = shape(seq_len=1, seq_len_k=16384)
    intensity = flops(decode, "fwd") / bytes_moved(decode, "fwd")
    assert intensity < 1.01 and h200.bound(intensity) == "memory"
    assert h200.roof(intensity) == pytest.approx(intensity * 4.0)  # TFLOP/s = FLOP/B x TB/s
    assert h200.bound(512.0) == "compute" and h200.roof(512.0) == 800.0
    assert Ceilings(None, None).roof(1.0) is None and Ceilings(800.0, None).bound(1.0) is None


def test_a_row_is_judged_against_the_roof_of_its_intensity() -> None:
    decode = shape(seq_len=1, seq_len_k=16384)
    cell = measure.Cell("fwd", "ok", True, ms=(0.05, 0.05, 0.05))
    env = {"gpu": "g", "torch": None, "triton": None, "where": ""}
    row = sweep._row("flash", decode, cell, None, Ceilings(800.0, 4000.0), env)
    moved, work = bytes_moved(decode, "fwd"), flops(decode, "fwd")
    assert row.gbps == pytest.approx(moved / 0.05e-3 / 1e9)
    assert row.intensity == pytest.approx(work / moved) and row.bound == "memory"
    assert row.pct_roof == pytest.approx(100 * row.gbps / 4000.0)  # memory-bound: % of the copy bandwidth
    assert row.pct_peak == pytest.approx(100 * row.tflops / 800.0)
    cpu = sweep._row("sdpa", decode, cell, None, Ceilings(None, None), env)
    assert cpu.gbps == row.gbps and cpu.pct_roof is None and cpu.bound == ""


# -- the profiler's side ----------------------------------------------------------------------------------
def test_kernel_times_are_the_gpu_events_per_call() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device_type, us):
        return SimpleNamespace(name=name, device_type=device_type, device_time_total=us)

    events = [event("_attn_fwd", cuda, 60.0), event("_attn_fwd", cuda, 62.0), event("aten::empty", cpu, 0.0),
              event("_combine", cuda, 5.0), event("_combine", cuda, 5.0), event("_attn_fwd", cuda, 58.0)]
    got = probe.kernel_times(events, calls=2)
    assert got == (KernelTime("_attn_fwd", 1.5, 90.0), KernelTime("_combine", 1.0, 5.0))


def test_the_trace_is_written_whole(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = probe.write_trace(prof, tmp_path / "traces" / "000-B1_H1-sdpa-fwd.trace.json")
    trace = json.loads(path.read_text())
    assert any("mm" in event.get("name", "") for event in trace["traceEvents"])
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left

    class Broken:
        def export_chrome_trace(self, target: str) -> None:
            Path(target).write_text('{"traceEvents": [')  # half a file, then a failure
            raise OSError("disk full")

    with pytest.raises(OSError):
        probe.write_trace(Broken(), tmp_path / "traces" / "broken.trace.json")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_probe_pass_writes_its_trace_and_says_what_it_could_not_see(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe.gather's own mechanics, on the CPU (no GPU to synchronize, no kernel to launch): the
    calls run, the trace is written, and a profile without GPU activity says so."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    calls = []
    leaf = torch.ones(3, requires_grad=True)
    leaf.grad = torch.ones(3)

    def call() -> None:
        assert leaf.grad is None  # reset before every call, as the timing did
        calls.append(1)

    got = probe.Probe(H200, tmp_path, "007 B1 H2 N16 D16 fp16").gather(call, [leaf], "sdpa-bwd", ms=10.0)
    assert len(calls) == 1 + 5 + 3  # one captured; 50 ms of 10 ms calls back to back; 20 ms profiled, 3 at least
    assert got.kernels == () and got.gpu_us is None and got.wall_us > 0
    assert "the profiler recorded no GPU activity" in got.note
    assert json.loads((tmp_path / "007_B1_H2_N16_D16_fp16-sdpa-bwd.trace.json").read_text())["traceEvents"]


def test_file_names_keep_labels_and_provider_paths_readable() -> None:
    assert probe.file_stem("003 B2 H8/2 N1x4096 D64 fp16 causal", "experiments/my.py:attn-fwd") == (
        "003_B2_H8_2_N1x4096_D64_fp16_causal-experiments_my_py_attn-fwd")


# -- Proton's views, in a child process (CUPTI takes one profiler per process) ----------------------------
PROTON_CASE = Shape(1, 2, 2, 16, 16, 16, "float32", True)


def proton_cell(tmp_path: Path, provider: str, mode: str) -> proton_pass.Cell:
    return proton_pass.Cell(PROTON_CASE, provider, mode, 0, str(tmp_path / f"000-{provider}-{mode}"), 3)


def test_the_proton_child_answers_every_cell_on_the_cpu(tmp_path: Path) -> None:
    """The child as bench starts it: each cell runs up to Proton, which has no GPU to profile
    here; every cell gets a note (or, where Proton can profile, its file), and the child lives."""
    cells = [proton_cell(tmp_path, provider, mode) for provider, mode in (("sdpa", "fwd"), ("sdpa", "bwd"),
                                                                          ("torch-naive", "fwd_bwd"))]
    outcomes = proton_pass.spawn(proton_pass.Request("cpu", tuple(cells)), timeout=60)
    assert len(outcomes) == len(cells)
    for outcome in outcomes:
        assert Path(outcome.hatchet).is_file() if outcome.hatchet else outcome.note.startswith("Proton")


def test_a_cell_that_cannot_run_is_a_note_and_the_others_still_run(tmp_path: Path) -> None:
    cells = (proton_cell(tmp_path, "no-such-provider", "fwd"), proton_cell(tmp_path, "sdpa", "fwd"))
    done = subprocess.run([sys.executable, "-m", "flashrun.harness.proton_pass"],
                          input=pickle.dumps(proton_pass.Request("cpu", cells)), capture_output=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    unknown, sdpa = json.loads(done.stdout)  # stdout holds the reply and nothing else
    assert unknown == {"hatchet": None, "note": "could not run it: InputError: unknown provider 'no-such-provider'"}
    assert sdpa["hatchet"] or sdpa["note"].startswith("Proton")  # it got as far as Proton


def test_the_proton_notice_counts_the_views_and_names_a_failure(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    job = sweep.ShapeJob(7, TINY_CASE, ("sdpa", "flash"), ("fwd", "bwd"), "cuda", 3, "sdpa", measure.Timing(1, 2), 9)
    env = {"gpu": "g", "torch": None, "triton": None, "where": ""}

    def row(provider: str, mode: str, status: str = "ok") -> results.Row:
        cell = measure.Cell(mode, status, True, ms=(0.1, 0.1, 0.1) if status == "ok" else None)
        return sweep._row(provider, TINY_CASE, cell, None, Ceilings(None, None), env)

    rows = [row("sdpa", "fwd"), row("sdpa", "bwd", "n/a"), row("flash", "fwd"), row("flash", "bwd")]
    cells = proton_pass.cells_of([job], [sweep.ShapeRows(7, rows, Ceilings(None, None), "g")], tmp_path)
    assert [(c.provider, c.mode, c.seed, c.calls) for c in cells] == [  # the ok cells; 20 ms of 0.1 ms: 50 calls
        ("sdpa", "fwd", 3, 50), ("flash", "fwd", 3, 50), ("flash", "bwd", 3, 50)]
    trace = probe.file_stem(job.prefix, "flash-bwd")  # the view is named like the trace
    assert cells[2].stem == str(tmp_path / trace) and trace == "007_B2_H4_2_N16_D16_fp32_causal-flash-bwd"

    outcomes = [proton_pass.Outcome("a.hatchet"), proton_pass.Outcome(None, "Proton: RuntimeError: error 39"),
                proton_pass.Outcome("b.hatchet")]
    monkeypatch.setattr(proton_pass, "spawn", lambda request, timeout: outcomes)
    assert proton_pass.write_views(cells, "cuda", tmp_path) == (
        f"Proton's per-kernel views: 2 written to {tmp_path} (in a child process: CUPTI takes one profiler per "
        f"process); 1 not, flash fwd on {TINY_CASE.label}: Proton: RuntimeError: error 39")

    def died(request, timeout):
        raise proton_pass.ChildFailed("exit code 1: ImportError: libcupti.so")

    monkeypatch.setattr(proton_pass, "spawn", died)
    assert proton_pass.write_views(cells, "cuda", tmp_path) == ("Proton's per-kernel views: none written: the child "
                                                                "process that writes them failed (exit code 1: "
                                                                "ImportError: libcupti.so)")
    assert proton_pass.write_views([], "cuda", tmp_path) is None
    monkeypatch.setenv("TRITON_PROTON_DISABLE", "1")
    assert not proton_pass.available()  # switched off: no child at all


# -- the flow: measured after the timing, into the rows and files -----------------------------------------
TINY_CASE = Shape(2, 4, 2, 16, 16, 16, "float32", True)
KERNEL = read_kernel(fixture_kernel(), (1, 8), H200)


class FakeProbe:
    """Stands in for :class:`probe.Probe` (which needs a GPU): records when it was asked."""

    def __init__(self, order: list[str], fail: bool = False):
        self.order, self.fail = order, fail

    def gather(self, fn, leaves, name, ms):
        self.order.append(f"gather {name}")
        if self.fail:
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
        fn()  # the very callable that was timed
        return CallMetrics(40.0, 100.0, (KERNEL,), (KernelTime("_article_fwd", 1.0, 40.0),))


def naive(q, k, v):
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    return torch.softmax((q @ k.transpose(-2, -1) / 4).masked_fill(~mask, float("-inf")), -1) @ v


def run_measure(fake: FakeProbe, monkeypatch: pytest.MonkeyPatch, order: list[str]) -> list[measure.Cell]:
    real_time_call = measure.time_call

    def time_call(*args, **kwargs):
        order.append("timed")
        return real_time_call(*args, **kwargs)

    monkeypatch.setattr(measure, "time_call", time_call)
    cpu = torch.device("cpu")
    sets = measure.make_sets(TINY_CASE, cpu, seed=0)
    ref = Reference.for_shape(sets[0], TINY_CASE, grads=True, edges=True)
    test = provider.Provider("test", lambda s, d: provider.Attention(naive))
    return measure.measure(test, TINY_CASE, sets, ref, ["fwd", "bwd"], cpu, measure.Timing(1, 2), fake)


def test_metrics_are_gathered_after_each_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    cells = run_measure(FakeProbe(order), monkeypatch, order)
    assert order == ["timed", "gather test-fwd", "timed", "gather test-bwd"]
    assert all(c.status == "ok" and c.metrics.kernels == (KERNEL,) for c in cells)


def test_a_failed_metrics_pass_keeps_the_timing_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    cells = run_measure(FakeProbe(order, fail=True), monkeypatch, order)
    assert [(c.status, c.metrics) for c in cells] == [("ok", None)] * 2 and all(c.ms for c in cells)
    assert "metrics: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in cells[0].note


def test_rows_carry_the_metrics_into_both_files_and_the_kernel_csv(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe.Probe, "on", classmethod(lambda cls, device, folder, prefix="": FakeProbe([])))
    job = sweep.ShapeJob(0, TINY_CASE, ("sdpa",), ("fwd",), "cpu", 0, "sdpa", measure.Timing(1, 2), 1,
                         metrics=True)
    here = sweep.Here(sweep.resolve(("sdpa",), "cpu"), Ceilings(None, None),
                      {"gpu": "cpu", "torch": None, "triton": None, "where": ""})
    (row,) = sweep.run_shape(job, here=here).rows
    assert (row.gpu_us, row.wall_us, row.kernels) == (40.0, 100.0, (KERNEL,))
    paths = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "prof" / "kernels.csv"
    results.write(*paths[:2], [row], {}, complete=True, kernels_path=paths[2])
    (line,) = _csv(paths[0])
    assert json.loads(line["kernels"])[0]["regs"] == 152 and float(line["gpu_us"]) == 40.0
    assert json.loads(paths[1].read_text())["rows"][0]["kernels"][0]["grid"] == [1, 8, 1]
    (kernel,) = _csv(paths[2])
    assert (kernel["kernel"], kernel["launches"], kernel["gpu_us"], kernel["share_pct"]) == (
        "_article_fwd", "1", "40", "100")
    assert (kernel["grid"], kernel["regs"], kernel["limiter"]) == ("1x8x1", "152", "registers")


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_a_kernel_only_the_profiler_saw_and_one_it_missed_both_get_a_line() -> None:
    row = results.Row(**{**{f.name: None for f in fields(results.Row)}, "provider": "flash", "mode": "fwd",
                         "dtype": "float16", "causal": False, "batch": 1, "heads": 2, "kv_heads": 2, "seq_len": 17,
                         "seq_len_k": 17, "head_dim": 16, "window": (-1, -1), "softcap": 0.0, "alibi": False,
                         "kernels": (KERNEL,), "gpu_kernels": (KernelTime("cudaMemsetAsync", 1.0, 2.0),)})
    lines = results.kernels_csv([row]).splitlines()
    assert lines[0] == ",".join(results.KERNEL_COLUMNS)
    assert lines[1].startswith("B1 H2 N17 D16 fp16,flash,fwd,cudaMemsetAsync,1,2,100,,")
    assert lines[2].startswith("B1 H2 N17 D16 fp16,flash,fwd,_article_fwd,,,,1x8x1,152,0,24576,4,")


# -- the command ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,option", [(["--metrics"], "--metrics"), (["--profile", "prof"], "--profile")])
def test_the_cpu_refuses_metrics_in_one_line(flags: list[str], option: str, isolated: Path) -> None:
    result = CliRunner().invoke(app, [*TINY, *flags])
    assert result.exit_code == 2, result.output
    assert f"{option} reads the compiled Triton kernels and the GPU's profiler: a CPU run has neither" in result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert not (isolated / "logs" / "bench").exists() and not (isolated / "prof").exists()  # nothing ran


def test_a_cpu_plot_says_why_there_is_no_roofline(isolated: Path) -> None:
    result = CliRunner().invoke(app, [*TINY, "--causal", "no", "--plot", "bench.png"])
    assert result.exit_code == 0, result.stderr
    assert "no roofline plot: it needs one GPU's measured ceilings" in result.stdout
    assert (isolated / "bench.png").is_file() and not (isolated / "bench-roofline.png").exists()


def test_the_roofline_plot_draws_every_valid_row(tmp_path: Path) -> None:
    env = {"gpu": "g", "torch": None, "triton": None, "where": ""}
    roofs = Ceilings(800.0, 4000.0)
    rows = [sweep._row(name, s, measure.Cell(mode, "ok", True, ms=(ms, ms, ms)), None, roofs, env)
            for name, s, mode, ms in (("flash", shape(), "fwd", 0.1), ("sdpa", shape(), "bwd", 0.3),
                                      ("flash", shape(seq_len=1, seq_len_k=16384), "fwd", 0.05))]
    path = results.plot_roofline(rows, roofs, results.roofline_path(tmp_path / "bench.png"))
    assert path.name == "bench-roofline.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_rows_get_the_e4m3_roof_beside_the_bf16_one(tmp_path: Path) -> None:
    env = {"gpu": "g", "torch": None, "triton": None, "where": ""}
    roofs = Ceilings(800.0, 4000.0, fp8_tflops=1300.0)
    cell = measure.Cell("fwd", "ok", True, ms=(0.1, 0.1, 0.1))
    plain = [sweep._row("flash", shape(), cell, None, roofs, env)]
    fp8 = plain + [sweep._row("flash-fp8", shape(), cell, None, roofs, env, fp8=True)]
    assert [label for _, label in results._roofs(plain, roofs)] == ["roof: copy 4,000 GB/s, bf16 matmul 800 TFLOP/s"]
    (bf16, _), (e4m3, label) = results._roofs(fp8, roofs)
    assert e4m3.tflops == 1300.0 and e4m3.ridge > bf16.ridge and "e4m3 matmul 1,300" in label
    assert results._roofs(fp8, Ceilings(800.0, 4000.0))[1:] == []  # no e4m3 roof measured: none drawn
    assert results.plot_roofline(fp8, roofs, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_the_metrics_tables_stay_whole_at_80_columns() -> None:
    from rich.console import Console

    long_kernel = KernelLaunch("_attn_fwd_split_kv_decode_with_a_long_name", 2, (16384, 512, 1), 8, 255, 1024,
                               114688, 1, 12.5, "registers", 31.03)

    def row(provider: str, seq_len: int, kernels=()) -> results.Row:
        return results.Row(provider=provider, mode="fwd_bwd", dtype="bfloat16", causal=True, batch=16, heads=32,
                           kv_heads=8, seq_len=seq_len, head_dim=128, ms=12.345, ms_p20=12.0, ms_p80=13.0,
                           tflops=512.25, pct_peak=64.2, peak_mem_mb=12345.0, speedup=1.0123, correct=True,
                           seq_len_k=16384, status="ok", max_err=1e-3, note="", setup_s=1.0, gpu="NVIDIA H200",
                           torch="2.11", triton="3.6", timestamp="now", gbps=12345.6, intensity=0.99,
                           pct_roof=87.4, bound="compute", gpu_us=12345.6, wall_us=184321.5, kernels=kernels)

    report = BenchReport([row("sdpa", 16384), row("flash-deterministic", 16384, (KERNEL, long_kernel)),
                          row("flash", 1, (long_kernel,))], {}, "cuda", 798.0, ceiling_gbps=4790.0, metrics=True)
    console = Console(width=80, force_terminal=False, record=True)
    render(report, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for whole in ("flash-deterministic", "fwd_bwd", "12346", "184321.5", "compute", "16384x512x1", "112.0",
                  "12 regs", "31.03", "19 regs", "check"):
        assert whole in text, whole
    assert "B16 H32/8 N16384 D128 bf16 causal" in " ".join(text.split())  # a heading row may wrap, not lose words


def test_an_fp8_providers_row_is_judged_against_the_e4m3_roof_and_moves_one_byte_per_input() -> None:
    prefill = shape(seq_len=4096, seq_len_k=4096, dtype="bfloat16")
    cell = measure.Cell("fwd", "ok", True, ms=(1.0, 1.0, 1.0))
    env = {"gpu": "g", "torch": None, "triton": None, "where": ""}
    roofs = Ceilings(700.0, 4000.0, fp8_tflops=1300.0)
    bf16 = sweep._row("flash", prefill, cell, None, roofs, env)
    fp8 = sweep._row("flash-fp8", prefill, cell, None, roofs, env, fp8=True)
    assert bf16.tflops == fp8.tflops  # the same attention's FLOPs
    assert fp8.pct_peak == pytest.approx(100 * fp8.tflops / 1300.0) and bf16.pct_peak == pytest.approx(
        100 * bf16.tflops / 700.0)
    q = 2 * 64 * 4096 * prefill.batch_size * prefill.num_heads  # bf16 q (or o), bytes
    kv = 2 * 64 * 4096 * prefill.batch_size * prefill.num_kv_heads
    assert bytes_moved(prefill, "fwd") == 2 * q + 2 * kv
    assert bytes_moved(prefill, "fwd", fp8=True) == q / 2 + q + kv  # e4m3 q, k, v; bf16 o
    assert fp8.gbps == pytest.approx(bf16.gbps * (1.5 * q + kv) / (2 * q + 2 * kv))
    assert Ceilings(700.0, 4000.0).in_fp8().tflops is None  # no fp8 tensor cores: no % peak
