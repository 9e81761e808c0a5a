"""Where a model's time goes, kernel by kernel: flash against SDPA inside a 1b model (issue 20).

For each family and attention implementation: the prefill and the train step of `flashrun model`'s
speed phase (same weights, same 4 x 2048 copy-task batch), timed with CUDA events (median of
--reps), then two more calls of each under torch.profiler: GPU time per kernel, grouped into
attention (forward and backward), matmuls, and the rest, per call. Prints one table per
family and writes the JSON. GPU only.

    python benchmarks/model_profile.py --arch llama,qwen2 --out DIR [--tune] [--split-waves W]

--tune tunes every flash kernel key the shipped table misses (FLASHRUN_TUNE=1) during the
warm-up; --split-waves sets the portable dK/dV kernel's GQA split threshold (0: never split);
--trace DIR also writes each profiled phase's Chrome trace, and splits each gap by when the next
kernel's launch call returned on the host (the trace's runtime and driver calls): the part after the
last kernel ended is the host's lateness, the rest the GPU's own (a launch already queued, not yet
started). Each phase reports the GPU's idle time between its kernels (per call) and the kernels
those gaps followed. The JSON keeps every kernel's GPU time; the table ends with the largest
differences between the first implementation's kernels and the others', after how much longer the
kernels both ran took in the first (the same work: a difference there is the GPU's pace between
the two profiled runs, NOTES v17, not the attention).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ATTENTION = ("_attn", "_fa3", "fmha", "cudnn", "flash", "sdpa", "attention", "_decode", "_combine")
MATMUL = ("gemm", "nvjet", "xmma", "cutlass", "sm90_")


def group(name: str) -> str:
    low = name.lower()
    if any(part in low for part in ATTENTION):
        return "attention"
    if any(part in low for part in MATMUL):
        return "matmul"
    return "other"


def idle(spans: list[tuple[float, float, str]], top: int = 6) -> dict:
    """GPU idle time between kernels: ``spans`` (start, end, name) of one stream's kernels in µs.
    The gaps between the first start and the last end where no kernel ran, in total and grouped by
    the kernel each gap followed (where the host was late to launch the next one)."""
    spans = sorted(spans)
    after: dict[str, list[float]] = {}
    busy_until, last = None, None
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            after.setdefault(last, []).append(start - busy_until)
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    worst = sorted(after.items(), key=lambda item: -sum(item[1]))[:top]
    return {"idle_ms": round(sum(sum(g) for g in after.values()) / 1e3, 3),
            "after": [(name[:60], len(gaps), round(sum(gaps) / 1e3, 3)) for name, gaps in worst]}


def lateness(trace: Path, calls: int, top: int = 6) -> dict:
    """Each gap between a stream's GPU operations in a Chrome trace, split by the launch call of
    the operation after it: the part of the gap before that call returned is the host's (late),
    the rest the GPU's. Per call, in ms; the largest GPU-side parts by (before, after) kernel and
    host-late parts by the operation waited for; and the host's lateness before the first
    attention kernel of each call and after it (a host that falls behind layer after layer, or only
    while it starts the model: NOTES v17)."""
    events = json.loads(trace.read_text())["traceEvents"]
    launched = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e["args"].get("correlation")) for e in events
                 if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)
    host: dict[str, float] = {}
    gpu: dict[str, float] = {}
    per_call = sum(group(name) == "attention" for _, _, name, _ in ops) // calls  # attention kernels a call
    late_first, late_rest = 0.0, 0.0  # the host's lateness before each call's first attention kernel, after it
    busy_until, last, seen = None, None, 0  # seen: attention kernels so far, all calls
    for start, end, name, correlation in ops:
        if busy_until is not None and start > busy_until:
            late = min(max(launched.get(correlation, busy_until) - busy_until, 0.0), start - busy_until)
            host[name[:50]] = host.get(name[:50], 0.0) + late
            if per_call and seen % per_call == 0:
                late_first += late
            else:
                late_rest += late
            pair = f"{last[:40]} -> {name[:40]}"
            gpu[pair] = gpu.get(pair, 0.0) + start - busy_until - late
        seen += group(name) == "attention"
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name

    def worst(parts: dict[str, float]) -> list:
        return [(name, round(us / 1e3 / calls, 3)) for name, us in sorted(parts.items(), key=lambda i: -i[1])[:top]]
    return {"launch_calls_seen": len(launched), "host_late_ms": round(sum(host.values()) / 1e3 / calls, 3),
            "gpu_side_ms": round(sum(gpu.values()) / 1e3 / calls, 3), "host_late_before": worst(host),
            "gpu_side_between": worst(gpu), "host_late_before_first_attention_ms": round(late_first / 1e3 / calls, 3),
            "host_late_after_it_ms": round(late_rest / 1e3 / calls, 3)}


def profiled(fn, calls: int = 2, trace: Path | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    late = None
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        late = lateness(trace, calls)
    gaps = idle([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type is not None and "CUDA" in str(e.device_type) and e.time_range.end > 0])
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type):
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3 / calls
    groups = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for name, ms in kernels.items():
        groups[group(name)] += ms
    top = sorted(kernels.items(), key=lambda item: -item[1])[:14]
    return {"gpu_ms": round(sum(kernels.values()), 3), **{k: round(v, 3) for k, v in groups.items()},
            "idle_ms": round(gaps["idle_ms"] / calls, 3), "idle_after": gaps["after"], "idle_split": late,
            "top": [(name[:90], round(ms, 3)) for name, ms in top],
            "kernels": {name: round(ms, 4) for name, ms in sorted(kernels.items(), key=lambda item: -item[1])}}


def family(arch: str, args: argparse.Namespace) -> dict:
    """Each of ``args.impls`` on ``arch``'s 1b model: timed, profiled, printed."""
    from transformers import DynamicCache

    from flashrun.kernels import tuning
    from flashrun.model import data, families
    from flashrun.model.speed import _event_ms  # flashrun model's own timing

    def timed(fn, reps: int) -> float:
        """The median of ``reps`` CUDA-event timings after two warm-up calls."""
        fn(), fn()
        return statistics.median(_event_ms(fn) for _ in range(reps))

    config = families.build_config(arch, "1b")
    model = families.build(config, torch.bfloat16, "cuda", 0)
    ids = data.copy_task(config.vocab_size, args.batch, args.seq_len, 0).to("cuda").input_ids

    def prefill():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                         past_key_values=DynamicCache(config=model.config))

    def train_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    rows = {}
    for impl in args.impls.split(","):
        model.set_attn_implementation(impl)
        row = {"prefill_ms": round(timed(prefill, args.reps), 3), "train_ms": round(timed(train_step, args.reps), 3)}
        tuning.chosen()
        trace = Path(args.trace) / f"{args.label}{arch}-{impl}" if args.trace else None
        row["prefill_profile"] = profiled(prefill, trace=trace and trace.with_name(trace.name + "-prefill.json"))
        row["train_profile"] = profiled(train_step, trace=trace and trace.with_name(trace.name + "-train.json"))
        row["configs"] = tuning.chosen()
        model.zero_grad(set_to_none=True)
        rows[impl] = row
        pre, train = row["prefill_profile"], row["train_profile"]
        print(f"{args.label}{arch} {impl:10s} prefill {row['prefill_ms']:8.2f} ms (GPU {pre['gpu_ms']:7.2f}: attn "
              f"{pre['attention']:6.2f} mm {pre['matmul']:6.2f} other {pre['other']:6.2f})  train "
              f"{row['train_ms']:8.2f} ms (GPU {train['gpu_ms']:7.2f}: attn {train['attention']:6.2f} mm "
              f"{train['matmul']:6.2f} other {train['other']:6.2f})  GPU idle: prefill {pre['idle_ms']:.2f} "
              f"train {train['idle_ms']:.2f} ms", flush=True)
        for name, count, ms in train["idle_after"][:4]:
            print(f"    train idle {ms:8.3f} ms in {count} gaps after {name}")
        for phase in ("prefill_profile", "train_profile"):
            split = row[phase]["idle_split"]
            if split is not None:
                print(f"    {phase[:7]} idle: host late {split['host_late_ms']:.3f} ms (before the first attention "
                      f"kernel {split['host_late_before_first_attention_ms']:.3f}, after it "
                      f"{split['host_late_after_it_ms']:.3f}), GPU side {split['gpu_side_ms']:.3f} ms "
                      f"({split['launch_calls_seen']} launch calls seen)")
                for name, ms in split["gpu_side_between"][:4]:
                    print(f"      GPU side {ms:7.3f} ms  {name}")
                for name, ms in split["host_late_before"][:4]:
                    print(f"      host late {ms:7.3f} ms  before {name}")
        for phase in ("prefill_profile", "train_profile"):
            for name, ms in row[phase]["top"][:8]:
                print(f"    {phase[:5]} {ms:8.3f} ms  {name}")
        if row["configs"]:
            print("    configs", row["configs"])
    differences(rows)
    return rows


def differences(rows: dict) -> None:
    """Where the first implementation's kernels' GPU time differs from the others', after how much
    longer the kernels both ran took in the first."""
    first, *others = rows
    for phase in ("prefill_profile", "train_profile"):
        ours = rows[first][phase]["kernels"]
        for other in others:
            theirs = rows[other][phase]["kernels"]
            diff = {name: ours.get(name, 0.0) - theirs.get(name, 0.0) for name in {*ours, *theirs}}
            shared = [name for name in ours if name in theirs]
            pace = sum(ours[n] for n in shared) / max(sum(theirs[n] for n in shared), 1e-9) - 1
            print(f"  {phase[:5]} kernels, {first} - {other}, ms per call: the kernels both ran {pace:+.2%} (the "
                  f"GPU's pace in each run: the same work); the largest differences")
            for name in sorted(diff, key=lambda n: -abs(diff[n]))[:12]:
                print(f"    {diff[name]:+8.3f}  {name[:110]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="llama,qwen2")
    parser.add_argument("--impls", default="fr_kernel,sdpa")
    parser.add_argument("--kernel", default="flash")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--split-waves", type=int, default=None)
    parser.add_argument("--label", default="")
    parser.add_argument("--trace", default="", help="also write each profiled phase's Chrome trace here")
    args = parser.parse_args()
    if args.tune:
        os.environ["FLASHRUN_TUNE"] = "1"

    from flashrun import kernels
    from flashrun.kernels.flash import attention
    from flashrun.model import swap

    if args.split_waves is not None:
        attention.SPLIT_WAVES = args.split_waves
    swap.register(kernels.get(args.kernel))
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "families": {}}
    for arch in args.arch.split(","):
        results["families"][arch] = family(arch, args)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"model-profile{args.label}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
