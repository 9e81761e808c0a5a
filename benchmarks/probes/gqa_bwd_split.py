"""The 1b models' attention backward (bf16, causal, 4 x 2048, the model's layout): flash's fused
and deterministic backwards with the dK/dV kernel's GQA split forced to each divisor of the group
(``attention._kv_split``), its parts adding into one float32 head ("adds") or writing partials
that the launcher sums ("partials", ``args.ADD_SPLIT`` off), against cuDNN's on k/v expanded to
every query head (the kernel alone: transformers' repeat of k/v is not timed). The backward
alone, entries timed in turns, three rounds: GPU milliseconds per call (the profiler's device
times of every kernel, memset and copy of 10 calls; round 14's first version timed do_bench's
wall medians, which the backward's host time dominated at these shapes, NOTES v14), and per
entry the GPU time of each kernel (last round).

    OUT=DIR python benchmarks/probes/gqa_bwd_split.py      # on an sm_90 GPU; writes $OUT/gqa_bwd_split.json
    OUT=DIR python benchmarks/probes/gqa_bwd_split.py --fused-only   # the fused backward's entries and cuDNN's
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels import warmup  # noqa: E402
from flashrun.kernels.flash import args as flash_args, attention as flash, hopper, hopper_bwd  # noqa: E402

os.environ.setdefault("FLASHRUN_FIRST_USE", "wait")  # a Gluon path's first use checks before the call, as commands do

SHAPES = (("llama", 32, 8, 64), ("qwen2", 12, 2, 128))  # (family, heads, k/v heads, head_dim)
ROUNDS = 3


def leaves(h, h_kv, d):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(4, 2048, heads, d, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
                   for heads in (h, h_kv, h_kv, h))
    return [t.requires_grad_() for t in (q, k, v)], do


def backward_of(forward, inputs, do):
    """A call that runs the backward of one forward (kept), and what it last said about its path."""
    out = forward(*inputs)

    def run():
        return torch.autograd.grad(out, inputs, do, retain_graph=True)
    return run


def main() -> None:
    default_split = flash._kv_split
    results = {}
    for family, h, h_kv, d in SHAPES:
        (q, k, v), do = leaves(h, h_kv, d)
        group = h // h_kv
        entries = {}
        for det in (False,) if "--fused-only" in sys.argv[1:] else (False, True):
            fn = backward_of(lambda q, k, v, det=det: flash.flash_attention(q, k, v, causal=True, deterministic=det),
                             (q, k, v), do)
            for split in (None, *(s for s in range(1, group + 1) if group % s == 0)):
                def forced(programs, grp, device, waves=None, split=split):
                    return split if split is not None else default_split(programs, grp, device, waves)
                for adds in ((True,) if split == 1 else (True, False)):
                    if det and adds and split not in (None, 2):  # the deterministic one adds only 2 parts
                        continue
                    name = (f"{'deterministic' if det else 'fused'} split {split or 'rule'}"
                            + ("" if adds else " partials"))
                    entries[name] = lambda fn=fn, forced=forced, adds=adds: _with_split(forced, adds, fn, default_split)
        k_all = k.detach().repeat_interleave(group, 1).requires_grad_()
        v_all = v.detach().repeat_interleave(group, 1).requires_grad_()

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        entries["cudnn"] = backward_of(cudnn, (q, k_all, v_all), do)
        batch = warmup.Batch()  # every specialization compiled ahead, in parallel
        batch.wait(batch.collect(lambda: [fn() for fn in entries.values()]))
        batch.close()
        ref = entries["cudnn"]()
        row = {name: {"runs": []} for name in entries}
        for name, fn in entries.items():  # first calls: compile, check, and the error against cuDNN's dq
            got = fn()
            row[name]["dq_err"] = round((got[0].float() - ref[0].float()).abs().max().item(), 4)
            dk_ref = ref[1].float().view(4, h_kv, group, 2048, d).sum(2) if name != "cudnn" else ref[1].float()
            row[name]["dk_err"] = round((got[1].float() - dk_ref).abs().max().item(), 4)
            row[name]["path"] = hopper_bwd.LAST_PATH if name != "cudnn" else "cudnn"
        torch.cuda.synchronize()
        for _ in range(ROUNDS):
            for name, fn in entries.items():
                total, kernels = gpu_ms(fn)
                row[name]["runs"].append(round(total, 4))
                row[name]["kernels_ms"] = kernels
        for name in row:
            row[name]["ms"] = statistics.median(row[name]["runs"])
            row[name]["cudnn/this"] = round(statistics.median(row["cudnn"]["runs"]) / row[name]["ms"], 3)
        results[family] = row
        print(family, json.dumps({name: (r["ms"], r["cudnn/this"], r["path"], r["dq_err"], r["dk_err"])
                                  for name, r in row.items()}),
              flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gqa_bwd_split.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                        "triton": triton.__version__, "hopper_on": hopper.ENABLED,
                                                        "results": results}, indent=1))


def gpu_ms(fn, calls: int = 10) -> tuple[float, dict]:
    """GPU milliseconds per call, in all and per kernel (name cut to 60 characters)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {e.key[:60]: round(e.self_device_time_total / calls / 1e3, 4) for e in prof.key_averages()
               if e.self_device_time_total > 0}
    return sum(kernels.values()), dict(sorted(kernels.items(), key=lambda kv: -kv[1]))


def _with_split(forced, adds, fn, default_split):
    flash._kv_split, flash_args.ADD_SPLIT = forced, adds
    try:
        return fn()
    finally:
        flash._kv_split, flash_args.ADD_SPLIT = default_split, True


if __name__ == "__main__":
    main()
