"""Where a model's time goes, kernel by kernel: flash against SDPA inside a 1b model (issue 20).

For each family and attention implementation: the prefill and the train step of `flashrun model`'s
speed phase (same weights, same 4 x 2048 copy-task batch), timed with CUDA events (median of
--reps), then two more calls of each under torch.profiler: GPU time per kernel, grouped into
attention (forward and backward), matmuls, and the rest, per call. Prints one table per
family and writes the JSON. GPU only.

    python benchmarks/model_profile.py --arch llama,qwen2 --out DIR [--tune] [--split-waves W]

--tune tunes every flash kernel key the shipped table misses (FLASHRUN_TUNE=1) during the
warm-up; --split-waves sets the dK/dV kernel's GQA split threshold (0: never split).
"""

from __future__ import annotations

import argparse
import json
import os
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


def profiled(fn, calls: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
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
            "top": [(name[:90], round(ms, 3)) for name, ms in top]}


def family(arch: str, args: argparse.Namespace) -> dict:
    """Each of ``args.impls`` on ``arch``'s 1b model: timed, profiled, printed."""
    from transformers import DynamicCache

    from flashrun.kernels import tuning
    from flashrun.model import data, families
    from flashrun.model.speed import _timed as timed  # flashrun model's own timing

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
        row["prefill_profile"], row["train_profile"] = profiled(prefill), profiled(train_step)
        row["configs"] = tuning.chosen()
        model.zero_grad(set_to_none=True)
        rows[impl] = row
        pre, train = row["prefill_profile"], row["train_profile"]
        print(f"{args.label}{arch} {impl:10s} prefill {row['prefill_ms']:8.2f} ms (GPU {pre['gpu_ms']:7.2f}: attn "
              f"{pre['attention']:6.2f} mm {pre['matmul']:6.2f} other {pre['other']:6.2f})  train "
              f"{row['train_ms']:8.2f} ms (GPU {train['gpu_ms']:7.2f}: attn {train['attention']:6.2f} mm "
              f"{train['matmul']:6.2f} other {train['other']:6.2f})", flush=True)
        for phase in ("prefill_profile", "train_profile"):
            for name, ms in row[phase]["top"][:8]:
                print(f"    {phase[:5]} {ms:8.3f} ms  {name}")
        if row["configs"]:
            print("    configs", row["configs"])
    return rows


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
    args = parser.parse_args()
    if args.tune:
        os.environ["FLASHRUN_TUNE"] = "1"

    from flashrun import kernels
    from flashrun.kernels.flash import attention
    from flashrun.model import swap

    if args.split_waves is not None:
        attention.SPLIT_WAVES = args.split_waves
    swap.register(kernels.get(args.kernel))
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "families": {}}
    for arch in args.arch.split(","):
        results["families"][arch] = family(arch, args)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"model-profile{args.label}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
