"""Does the turn order bias `flashrun model`'s timing? (issue 20: flash's prefill sits 0.3-1.4 %
behind SDPA's in every sample, while the profiler finds flash's prefill GPU time lower and its
GPU idle after the first layer level, NOTES v17.)

`speed.measure` times the implementations in turns, always in the same order (the kernel first).
This times qwen2-1b's prefill and train step (4 x 2048 copy-task tokens, bf16, the speed phase's
calls) for flash and SDPA over ROUNDS rounds in the order A B B A, and reports each
implementation's median by its place in the round (first or second), and the ratio per place.
GPU only, from the repo root:

    python benchmarks/turn_order.py --arch qwen2 --out DIR [--label=-1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402

ROUNDS = 16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--out", default=".")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    from flashrun import kernels
    from flashrun.model import data, families, speed, swap

    swap.register(kernels.get("flash"))
    config = families.build_config(args.arch, "1b")
    model = families.build(config, torch.bfloat16, "cuda", 0)
    batch = data.copy_task(config.vocab_size, 4, 2048, 0).to("cuda")
    phases = speed._phases(model, batch)
    impls = (swap.NAME, "sdpa")
    results = {}
    for phase in ("prefill", "train"):
        calls = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            calls[impl] = phases[phase]()
            for _ in range(speed.WARMUP):
                calls[impl]()
        times = {(impl, place): [] for impl in impls for place in (0, 1)}
        for r in range(ROUNDS):
            order = impls if r % 4 in (0, 3) else impls[::-1]  # A B, B A, B A, A B, ...
            for place, impl in enumerate(order):
                model.set_attn_implementation(impl)
                times[impl, place].append(speed._event_ms(calls[impl]))
        medians = {f"{impl} {'first' if place == 0 else 'second'}": round(statistics.median(ms), 3)
                   for (impl, place), ms in times.items()}
        both = {impl: round(statistics.median(times[impl, 0] + times[impl, 1]), 3) for impl in impls}
        results[phase] = {"medians": medians, "all": both, "sdpa / flash": round(both["sdpa"] / both[swap.NAME], 4),
                          "sdpa / flash, flash first": round(medians["sdpa second"] / medians[f"{swap.NAME} first"], 4),
                          "sdpa / flash, sdpa first": round(medians["sdpa first"] / medians[f"{swap.NAME} second"], 4)}
        print(phase, json.dumps(results[phase]), flush=True)
        model.zero_grad(set_to_none=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"turn-order-{args.arch}{args.label}.json").write_text(json.dumps(
        {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rounds": ROUNDS, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
