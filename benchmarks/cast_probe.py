"""Round 24's experiment on the default backward's dQ (NOTES v24): the float32 buffer filled before
the kernel and cast after it ("fill"), against the kernel casting each query block itself once its
last contributor's reduce-add has landed (hopper_bwd.last_cast): CAST_SYNC 0 as built, 1 the same
counters without the casts (wrong by design: what the casts cost). Each variant's dQ against the
fill path's (on memory poisoned with NaN first, so that an uncast block shows), the kept workspace
zero after its first call and after its timing, and do_bench medians in two rounds of every variant.

    python benchmarks/cast_probe.py [--out DIR]
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels import flash_attention  # noqa: E402
from flashrun.kernels.flash import hopper_bwd  # noqa: E402

SHAPES = [(32, 32, 1024, 64, True), (32, 16, 1024, 128, True), (8, 32, 4096, 64, False),
          (8, 16, 4096, 128, False), (2, 16, 16384, 128, True)]  # (B, H, N, D, causal), bf16
VARIANTS = ["fill", 0, 1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ns = ap.parse_args()
    last_cast = hopper_bwd.last_cast
    rows = []
    for b, h, n, d, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attention(q, k, v, causal=causal)
        times, ref = {}, None
        for rnd in range(2):
            for var in VARIANTS:
                hopper_bwd.last_cast = (lambda cfg, window: False) if var == "fill" else last_cast
                hopper_bwd.CAST_SYNC = 0 if var == "fill" else var
                q.grad = None
                poison = torch.full_like(q, float("nan"))  # the block dQ's allocation will reuse
                del poison
                out.backward(do, retain_graph=True)
                torch.cuda.synchronize()
                if rnd == 0:
                    if var == "fill":
                        ref = q.grad.float().clone()
                    err = (q.grad.float() - ref).abs().max().item()
                    dirty = sum(t.count_nonzero().item() for pair in hopper_bwd._workspaces.values() for t in pair)
                    rows.append({"shape": [b, h, n, d, causal], "variant": var, "dq_err": err, "dirty": dirty,
                                 "path": hopper_bwd.LAST_PATH})
                times.setdefault(var, []).append(triton.testing.do_bench(
                    lambda: out.backward(do, retain_graph=True), warmup=25, rep=150, grad_to_none=[q, k, v]))
                torch.cuda.synchronize()
                if var == 1:  # its casts are off: nothing zeroes the workspace behind it
                    hopper_bwd.release_workspaces()
                if rnd == 0:
                    rows[-1]["dirty_after_timing"] = sum(t.count_nonzero().item()
                                                         for pair in hopper_bwd._workspaces.values() for t in pair)
        hopper_bwd.last_cast = last_cast
        label = f"B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}"
        print(label + "  " + "  ".join(f"{v}: {min(t):.3f}" for v, t in times.items())
              + f"   (ratio to fill: " + " ".join(f"{v}={min(times['fill']) / min(t):.3f}" for v, t in times.items()
                                              if v != "fill") + ")", flush=True)
        for r in rows:
            if r["shape"] == [b, h, n, d, causal]:
                r["ms"] = times[r["variant"]]
        del q, k, v, do, out
        torch.cuda.empty_cache()
    for r in rows:
        print(f"{r['shape']} {r['variant']}: dq max diff to fill {r['dq_err']:.3g}, workspace non-zero {r['dirty']} "
              f"(after timing {r['dirty_after_timing']}), {r['path']}")
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    Path(ns.out, "cast_probe.json").write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                                          "triton": triton.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
