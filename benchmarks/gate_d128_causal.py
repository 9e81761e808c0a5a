"""Where the Gluon d128 forward beats the portable one, causal, head_dim 128 (NOTES v12; hopper.GATE):
bf16 at N = 1024 and 2048 over batch x heads (qwen2-like 12/2, llama-like 32/8, MHA 16/16),
the portable kernel (hopper.ENABLED = False) against the Gluon kernel forced (hopper.OVERRIDE),
both through flash_attention, cuDNN beside; then fp16 and bf16 at N = 2048 through the shipped
path. do_bench medians (L2 cleared), the better of two.

    OUT=DIR python benchmarks/gate_d128_causal.py      # on an sm_90 GPU; writes $OUT/gate_d128_causal.json
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels.flash import attention as flash, hopper  # noqa: E402

SHAPES = ((4, 12, 2), (8, 12, 2), (4, 32, 8), (16, 12, 2), (16, 16, 16), (32, 16, 16))  # (batch, heads, kv heads)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return round(min(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") for _ in range(2)), 4)


def inputs(b, h, h_kv, n, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, n, h, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, n, h_kv, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


def forced(q, k, v, cfg):
    hopper.OVERRIDE = cfg
    try:
        return flash.flash_attention(q, k, v, causal=True)
    finally:
        hopper.OVERRIDE = None


def portable(q, k, v, causal=True):
    """flash_attention through the portable kernel (the Gluon forward off for the call)."""
    hopper.ENABLED = False
    try:
        return flash.flash_attention(q, k, v, causal=causal)
    finally:
        hopper.ENABLED = True


def main() -> None:
    out = {"by_batch": [], "by_dtype": []}
    for n in (1024, 2048):
        for b, h, h_kv in SHAPES:
            q, k, v = inputs(b, h, h_kv, n, torch.bfloat16)
            ka, va = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, ka, va, is_causal=True)

            row = {"n": n, "b": b, "h": h, "h_kv": h_kv, "tiles": b * h * triton.cdiv(n, 128),
                   "portable": timed(lambda: portable(q, k, v)),
                   "gluon": timed(lambda: forced(q, k, v, hopper.KERNELS["d128"])), "cudnn": timed(cudnn)}
            row["gluon/portable speed"] = round(row["portable"] / row["gluon"], 3)
            print(json.dumps(row), flush=True)
            out["by_batch"].append(row)
    for dtype in (torch.float16, torch.bfloat16):
        for b, h, h_kv in ((4, 12, 2), (16, 16, 16), (4, 32, 8)):
            q, k, v = inputs(b, h, h_kv, 2048, dtype, seed=1)
            row = {"dtype": str(dtype).removeprefix("torch."), "b": b, "h": h, "h_kv": h_kv,
                   "portable": timed(lambda: portable(q, k, v)),
                   "shipped": timed(lambda: flash.flash_attention(q, k, v, causal=True)), "shipped path": hopper.LAST_PATH}
            row["shipped/portable speed"] = round(row["portable"] / row["shipped"], 3)
            print(json.dumps(row), flush=True)
            out["by_dtype"].append(row)
    Path(os.environ.get("OUT", "."), "gate_d128_causal.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
