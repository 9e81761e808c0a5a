"""The Gluon sm_90 forward's host path (NOTES v12): the d128 kernel at qwen2-1b's prefill shape
(bf16, causal, 4 x 2048, 12/2 heads), through flash_attention (hopper.OVERRIDE), through
hopper._run_gluon directly, and the portable Triton forward, in a model's (B, N, H, D) layout and
dense; three do_bench rounds each (L2 cleared between calls), then 200 calls back to back (no
clearing: a call whose host work outlasts its kernel shows its host time here).

    OUT=DIR python benchmarks/gluon_path.py      # on an sm_90 GPU; writes $OUT/gluon_path.json
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels.flash import attention as flash, hopper  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg = hopper.KERNELS["d128"]
    out = {}
    for layout in ("model", "dense"):
        q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                   for s in ((4, 2048, 12, 128), (4, 2048, 2, 128), (4, 2048, 2, 128)))
        if layout == "dense":
            q, k, v = (t.contiguous() for t in (q, k, v))

        def via_flash():
            hopper.OVERRIDE = cfg
            try:
                return flash.flash_attention(q, k, v, causal=True)
            finally:
                hopper.OVERRIDE = None

        fns = {"via flash_attention": via_flash,
               "direct _run_gluon": lambda: hopper._run_gluon(q, k, v, 128 ** -0.5, True, cfg)[0],
               "triton shipped": lambda: flash.flash_attention(q, k, v, causal=True)}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for rnd in range(3):
            for name, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                out.setdefault(f"{layout} {name}", []).append(round(ms, 4))
                print(layout, rnd, name, round(ms, 4), hopper.LAST_PATH, flush=True)
        for name, fn in fns.items():
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start.record()
            for _ in range(200):
                fn()
            end.record()
            end.synchronize()
            out[f"{layout} {name} back-to-back"] = round(start.elapsed_time(end) / 200, 4)
            print(layout, "back-to-back", name, out[f"{layout} {name} back-to-back"], flush=True)
    Path(os.environ.get("OUT", "."), "gluon_path.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
