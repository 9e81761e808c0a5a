"""Time the same flash calls with two checkouts of flashrun, one process each, on the GPU.

    PYTHONPATH=<old checkout> python benchmarks/ab_old_new.py old > old.json
    PYTHONPATH=<this checkout> python benchmarks/ab_old_new.py new > new.json

Each label's process imports whichever flashrun comes first on sys.path, so the two runs differ
only in the code. Both use the shipped tuned table (same launch-config space), so they launch
the same configs. Per case: triton.testing.do_bench's median (GPU events around each call) and the
wall time per call of 200 back-to-back calls with one synchronize at the end - when the second
is the larger, the call is bound by its Python overhead, not by the GPU.

    ... ab_old_new.py LABEL --only bwd --profile   # only the cases whose name holds "bwd", and
                                                    # each one's GPU time per kernel (3 calls)
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton

import flashrun
from flashrun.kernels import flash_attention

CASES = [  # (name, B, H, Nq, Nk, D, causal, mode)
    ("decode Nk=4096", 8, 16, 1, 4096, 128, False, "fwd"),
    ("decode Nk=16384", 2, 16, 1, 16384, 128, False, "fwd"),
    ("fwd D64 causal N=1024", 32, 32, 1024, 1024, 64, True, "fwd"),
    ("bwd D64 causal N=4096", 8, 32, 4096, 4096, 64, True, "bwd"),
    ("bwd D128 causal N=4096", 8, 16, 4096, 4096, 128, True, "bwd"),
    ("bwd D128 full N=4096", 8, 16, 4096, 4096, 128, False, "bwd"),
]


def kernel_times(call, calls: int = 3) -> dict[str, float]:
    """GPU µs per call of each kernel ``call`` launches (torch.profiler), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {evt.key[:60]: evt.device_time_total / calls for evt in prof.key_averages() if evt.device_time_total > 0}
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main() -> None:
    label = sys.argv[1]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    out = {"label": label, "flashrun": flashrun.__file__, "triton": triton.__version__, "cases": {}}
    for name, b, h, nq, nk, d, causal, mode in CASES:
        if only not in name:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(mode == "bwd")
        k = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(mode == "bwd")
        v = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(mode == "bwd")
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    flash_attention(q, k, v, causal=causal)
        else:
            o = flash_attention(q, k, v, causal=causal)
            do = torch.randn_like(o)

            def call():
                torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        call()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
        start = time.perf_counter()
        for _ in range(200):
            call()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / 200 * 1e3
        out["cases"][name] = {"ms": ms, "wall_ms_per_call": wall_ms}
        print(f"{label:4} {name:24} do_bench {ms * 1e3:9.1f} us   wall/call {wall_ms * 1e3:9.1f} us", file=sys.stderr)
        if "--profile" in sys.argv:
            out["cases"][name]["kernels_us"] = kernel_times(call)
            print("     " + ", ".join(f"{k} {t:.0f}" for k, t in out["cases"][name]["kernels_us"].items()),
                  file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
