"""Back-to-back backward calls (bf16, causal, the model's (B, N, H, D) layout): milliseconds per
call of ``torch.autograd.grad`` over REPS calls with one synchronize at the end - the host's pace
where it is slower than the GPU - and the same calls' GPU time alone (the profiler's device times
of every kernel they ran). flash's default backward (the Gluon one with dQ inside on sm_90) beside cuDNN's.
For an A/B of one commit against another, run it from each checkout.

``--enqueue`` times only the Gluon dK/dV launcher itself (``hopper_bwd._run_gluon``, dQ not
fused, no GQA split): the host's microseconds per call over ENQUEUE calls enqueued without waiting
(the GPU far behind), on the same shapes.

    OUT=DIR python benchmarks/bwd_host.py [--enqueue]   # on a GPU; writes $OUT/bwd_host[_enqueue].json
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels.flash import attention as flash, hopper_bwd  # noqa: E402

SHAPES = ((1, 8, 2, 512, 128), (2, 16, 4, 1024, 64), (4, 12, 2, 2048, 128), (4, 32, 8, 2048, 64))  # (B, H, H_KV, N, D)
REPS = 50
ENQUEUE = 200


def run_of(forward, inputs, do):
    out = forward(*inputs)
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


def paced(fn) -> float:
    """Milliseconds per call, REPS calls back to back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPS * 1e3


def gpu(fn, calls: int = 10) -> float:
    """GPU milliseconds per call: every kernel, memset and copy the calls ran, summed from the
    profiler's device times (the host's pace left out)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def enqueue(q, k, v, do) -> float:
    """Host microseconds per Gluon dK/dV launch, ENQUEUE launches without waiting."""
    o, lse = flash._attn_forward(q, k, v, q.shape[-1] ** -0.5, flash.Variant(causal=True), "default", try_gluon=False)
    delta = (o.float() * do.float()).sum(-1)
    cfg = hopper_bwd._config(q.shape[-1], False)
    for _ in range(3):
        hopper_bwd._run_gluon(q, k, v, do, lse, delta, q.shape[-1] ** -0.5, True, cfg)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ENQUEUE):
        hopper_bwd._run_gluon(q, k, v, do, lse, delta, q.shape[-1] ** -0.5, True, cfg)
    host = (time.perf_counter() - start) / ENQUEUE * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    only_enqueue = "--enqueue" in sys.argv[1:]
    rows = []
    for b, h, h_kv, n, d in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, n, heads, d, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
                       for heads in (h, h_kv, h_kv, h))
        if only_enqueue:
            rows.append({"shape": [b, h, h_kv, n, d], "gluon_dkdv_enqueue_us": round(enqueue(q, k, v, do), 1)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        k_all = k.detach().repeat_interleave(h // h_kv, 1).requires_grad_()
        v_all = v.detach().repeat_interleave(h // h_kv, 1).requires_grad_()

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        calls = {"flash": run_of(lambda q, k, v: flash.flash_attention(q, k, v, causal=True), (q, k, v), do),
                 "cudnn": run_of(cudnn, (q, k_all, v_all), do)}
        row = {"shape": [b, h, h_kv, n, d]}
        for name, fn in calls.items():
            for _ in range(3):
                fn()  # compile, check, plan
            row[name] = {"paced_ms": round(paced(fn), 4), "gpu_ms": round(gpu(fn), 4)}
        row["flash"]["path"] = hopper_bwd.LAST_PATH
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bwd_host{'_enqueue' if only_enqueue else ''}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
