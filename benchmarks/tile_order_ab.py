"""The order in which a causal grid's tiles start (NOTES v18, ``jit.tile_of``): the same kernels
with their tiles head by head (``head``, the order before v18), heaviest first across all heads
(``across``), and as ``args.across_heads`` picks (``rule``, the shipped order), against cuDNN, in
one process.

Each cell times the forward (``flash._attn_forward``) and the backward alone
(``flash._attn_backward``, the default one, from the forward's output) through their lean plans,
so that the times are the GPU's: the plans are dropped whenever the order changes (a plan keeps
the order it was made with). cuDNN: its forward, and forward + backward through autograd. The
providers are timed in turns, ROUNDS rounds, each a do_bench median (L2 cleared); the median of
the rounds is reported.

Cells: the 1b models' prefill attention (qwen2: 4 x 12/2 heads, head_dim 128; llama: 4 x 32/8,
head_dim 64; 2048 keys, the model's (B, N, H, D) layout), and dense shapes from short to long.

    OUT=DIR python benchmarks/tile_order_ab.py --label=-1   # on a GPU; writes $OUT/tile_order{label}.json
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels.flash import args as flash_args, attention as flash, hopper, hopper_bwd  # noqa: E402

# (name, batch, heads, k/v heads, length, head_dim, window or None, model layout)
CELLS = (
    ("qwen2-prefill", 4, 12, 2, 2048, 128, None, True),
    ("llama-prefill", 4, 32, 8, 2048, 64, None, True),
    ("h16-2k-d128", 1, 16, 16, 2048, 128, None, False),
    ("h16-8k-d128", 1, 16, 16, 8192, 128, None, False),
    ("b32-h16-1k-d128", 32, 16, 16, 1024, 128, None, False),
    ("b8-h32-4k-d64", 8, 32, 32, 4096, 64, None, False),
    ("mistral-window", 4, 32, 8, 4096, 64, (1023, 0), True),
)
ORDERS = {"head": False, "rule": None, "across": True}  # args.ACROSS_OVERRIDE
ROUNDS = 3


def inputs(b, h, h_kv, n, d, model):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads):
        if model:  # (B, N, H, D) projections seen as (B, H, N, D)
            return torch.randn(b, n, heads, d, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
        return torch.randn(b, heads, n, d, device="cuda", generator=gen).to(torch.bfloat16)

    return draw(h), draw(h_kv), draw(h_kv), draw(h)


def order(override) -> None:
    flash_args.ACROSS_OVERRIDE = override
    for plans in (flash._forward_plans, flash._delta_plans, hopper._plans, hopper_bwd._plans):
        plans.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    rows = []
    print(f"{'cell':16s} {'provider':16s} {'path':24s} {'median ms':>9s}  rounds", flush=True)
    for name, b, h, h_kv, n, d, window, model in CELLS:
        q, k, v, do = inputs(b, h, h_kv, n, d, model)
        scale = d ** -0.5
        variant = flash._variant(q, b, n, window is None, window or (-1, -1), 0.0, None)
        fns, paths, times = {}, {}, {}
        for label, override in ORDERS.items():
            def fwd(override=override):
                return flash._attn_forward(q, k, v, scale, variant)

            def bwd(override=override, saved={}):
                if override not in saved:
                    saved[override] = flash._attn_forward(q, k, v, scale, variant)
                o, lse = saved[override]
                return flash._attn_backward(do, q, k, v, o, lse, scale, variant, deterministic=None)

            fns[f"{label} fwd"] = (fwd, override)
            fns[f"{label} bwd"] = (bwd, override)
        if window is None:  # (cuDNN through SDPA takes no sliding window)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

            def cudnn_fwd():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)

            def cudnn_both():
                cudnn_fwd().backward(do)

            fns["cudnn fwd"] = (cudnn_fwd, None)
            fns["cudnn fwd+bwd"] = (cudnn_both, None)
        for _ in range(ROUNDS):
            for provider, (fn, override) in fns.items():
                if not provider.startswith("cudnn"):
                    order(override)
                fn()
                torch.cuda.synchronize()
                if not provider.startswith("cudnn"):
                    paths[provider] = hopper.LAST_PATH if provider.endswith("fwd") else hopper_bwd.LAST_PATH
                ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median",
                                             grad_to_none=leaves if provider.startswith("cudnn") else None)
                times.setdefault(provider, []).append(ms)
        order(None)
        for provider, ms in times.items():
            row = {"cell": name, "provider": provider, "path": paths.get(provider, "cudnn"),
                   "ms": round(statistics.median(ms), 4), "rounds": [round(x, 4) for x in ms]}
            rows.append(row)
            print(f"{name:16s} {provider:16s} {row['path']:24s} {row['ms']:9.4f}  {row['rounds']}", flush=True)
        del q, k, v, do, fns
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tile_order{args.label}.json").write_text(json.dumps({
        "torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
