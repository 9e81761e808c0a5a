"""The 1b models' attention backward (bf16, causal, 4 x 2048, the model's layout): flash's fused
and deterministic backwards with the dK/dV kernel's GQA split forced to each divisor of the group
(``attention._kv_split``), against cuDNN's on k/v expanded to every query head (the kernel alone:
transformers' repeat of k/v is not timed). do_bench medians of the backward alone (L2 cleared),
entries timed in turns, three rounds.

    OUT=DIR python benchmarks/gqa_bwd_split.py      # on an sm_90 GPU; writes $OUT/gqa_bwd_split.json
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels import warmup  # noqa: E402
from flashrun.kernels.flash import attention as flash, hopper, hopper_bwd  # noqa: E402

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
        for det in (False, True):
            fn = backward_of(lambda q, k, v, det=det: flash.flash_attention(q, k, v, causal=True, deterministic=det),
                             (q, k, v), do)
            for split in (None, *(s for s in range(1, group + 1) if group % s == 0)):
                def forced(programs, grp, device, waves=None, split=split):
                    return split if split is not None else default_split(programs, grp, device, waves)
                entries[f"{'deterministic' if det else 'fused'} split {split or 'rule'}"] = \
                    lambda fn=fn, forced=forced: _with_split(forced, fn, default_split)
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
            row[name]["path"] = hopper_bwd.LAST_PATH if name != "cudnn" else "cudnn"
        torch.cuda.synchronize()
        for _ in range(ROUNDS):
            for name, fn in entries.items():
                row[name]["runs"].append(round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), 4))
        for name in row:
            row[name]["ms"] = statistics.median(row[name]["runs"])
            row[name]["cudnn/this"] = round(statistics.median(row["cudnn"]["runs"]) / row[name]["ms"], 3)
        results[family] = row
        print(family, json.dumps({name: (r["ms"], r["cudnn/this"], r["path"], r["dq_err"]) for name, r in row.items()}),
              flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gqa_bwd_split.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                        "triton": triton.__version__, "hopper_on": hopper.ENABLED,
                                                        "results": results}, indent=1))


def _with_split(forced, fn, default_split):
    flash._kv_split = forced
    try:
        return fn()
    finally:
        flash._kv_split = default_split


if __name__ == "__main__":
    main()
