"""The host's side of a 1b model's step: how long each attention call holds the host (issue 20).

NOTES v15's profile (`model_profile.py`) found qwen2-1b's GPU idle between kernels 2.9 ms longer
per train step with flash than with SDPA (11.5 against 8.6 ms) and 3.3 ms longer per prefill,
while flash's GPU time was level (train) or lower (prefill): the host was late. This times, inside
`flashrun model`'s prefill and train step (4 x 2048 copy-task tokens, bf16), every call of the
attention function transformers makes (flash's swap, or transformers' own SDPA function) and
every backward of flash's autograd function, on the host (``time.perf_counter`` around the call;
SDPA's backward runs inside autograd's engine and is not seen), and how long the host takes to
enqueue the whole phase (before its synchronize) against the phase's wall time (CUDA events).
GPU only; from the repo root whose flashrun is to be timed:

    python benchmarks/model_host.py --arch qwen2,llama --out DIR [--cprofile N]

``--cprofile N`` then runs N more calls of each of flash's phases under cProfile and prints the 25
functions with the most own time, then flashrun's and Triton's 30 by cumulative time (where the
host's time per attention call goes, Triton's launcher and torch's calls included).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402


def _timing(fn, into: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return timed


def _us(values: list[float]) -> dict:
    return {"calls": len(values), "median_us": round(statistics.median(values) * 1e6, 1) if values else None,
            "total_ms": round(sum(values) * 1e3, 2)}


FWD_HOST: list[float] = []  # seconds per attention-function call (flash's swap or SDPA's)
BWD_HOST: list[float] = []  # seconds per backward of flash's autograd function


def instrument() -> None:
    """flash registered (``flashrun model``'s swap) and both attention functions and flash's
    backward timed on the host, once per process."""
    from transformers import AttentionInterface

    from flashrun import kernels
    from flashrun.kernels.flash import attention
    from flashrun.model import swap

    swap.register(kernels.get("flash"))
    for name in (swap.NAME, "sdpa"):
        AttentionInterface.register(name, _timing(AttentionInterface._global_mapping[name], FWD_HOST))
    attention.FlashAttention.backward = staticmethod(_timing(attention.FlashAttention.backward, BWD_HOST))


def family(arch: str, args: argparse.Namespace) -> dict:
    from transformers import DynamicCache

    from flashrun.model import data, families, swap

    config = families.build_config(arch, "1b")
    model = families.build(config, torch.bfloat16, "cuda", 0)
    ids = data.copy_task(config.vocab_size, args.batch, args.seq_len, 0).to("cuda").input_ids
    fwd_host, bwd_host = FWD_HOST, BWD_HOST

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, past_key_values=DynamicCache(config=model.config))

    def train_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    rows = {}
    for impl in (swap.NAME, "sdpa"):
        model.set_attn_implementation(impl)
        row = {}
        for phase, fn in (("prefill", prefill), ("train", train_step)):
            fn(), fn()
            torch.cuda.synchronize()
            fwd_host.clear(), bwd_host.clear()
            walls, enqueues = [], []
            for _ in range(args.reps):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start = time.perf_counter()
                begin.record()
                fn()
                end.record()
                enqueues.append(time.perf_counter() - start)
                end.synchronize()
                walls.append(begin.elapsed_time(end))
            row[phase] = {"wall_ms": round(statistics.median(walls), 2),
                          "enqueue_ms": round(statistics.median(enqueues) * 1e3, 2),
                          "attention_forward_host": _us(fwd_host), "flash_backward_host": _us(bwd_host)}
            print(f"{arch} {impl:9s} {phase:7s} wall {row[phase]['wall_ms']:7.2f} ms, host enqueue "
                  f"{row[phase]['enqueue_ms']:7.2f} ms; attention forward on the host "
                  f"{row[phase]['attention_forward_host']['median_us']} us median x {len(fwd_host) // args.reps}"
                  f" per {phase}, flash backward {row[phase]['flash_backward_host']['median_us']} us", flush=True)
            if args.cprofile and impl == swap.NAME:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.cprofile):
                    fn()
                torch.cuda.synchronize()
                profiler.disable()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats("flashrun|triton", 30)
                print(f"{arch} {impl} {phase}: cProfile of {args.cprofile} calls\n{text.getvalue()}", flush=True)
        rows[impl] = row
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen2,llama")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", default=".")
    parser.add_argument("--label", default="")
    parser.add_argument("--cprofile", type=int, default=0, help="profile this many more calls of flash's phases")
    args = parser.parse_args()
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "families": {}}
    instrument()
    for arch in args.arch.split(","):
        results["families"][arch] = family(arch, args)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"model-host{args.label}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
