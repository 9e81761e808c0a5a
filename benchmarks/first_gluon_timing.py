"""Is the first timing of the Gluon forward in a process slow (NOTES v12: seen four times, among
them the fp16 0.80x at qwen2's 4 x 12/2 heads)? qwen2-1b's prefill attention (causal, 2048 keys,
head_dim 128, the model's layout), fp16 then bf16, through flash_attention's shipped path (the
Gluon kernel there) and with the Gluon path off (the portable kernel), in turns, six rounds, each a
do_bench median (L2 cleared); cuDNN beside. One process: a slow first round shows as round 0.

    OUT=DIR python benchmarks/first_gluon_timing.py   # on an sm_90 GPU; writes $OUT/first_gluon_timing.json
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


def main() -> None:
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(4, 2048, 12, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        k, v = (torch.randn(4, 2048, 2, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)
                for _ in range(2))

        def shipped():
            return flash.flash_attention(q, k, v, causal=True)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        for rnd in range(6):
            for name, fn, gluon in (("shipped", shipped, True), ("portable", shipped, False), ("cudnn", cudnn, None)):
                hopper.ENABLED = gluon is not False
                fn()
                path = hopper.LAST_PATH if gluon is not None else "cudnn"
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                rows.append({"dtype": str(dtype)[6:], "round": rnd, "provider": name, "path": path, "ms": round(ms, 4)})
                print(f"{str(dtype)[6:]:8s} round {rnd} {name:8s} {path:11s} {ms:.4f} ms", flush=True)
        hopper.ENABLED = True
    out = Path(os.environ.get("OUT", "."))
    (out / "first_gluon_timing.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
