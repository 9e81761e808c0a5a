"""Where a short flash forward's host time goes (issue 23's finding at N = 512: the wall time per
call is above the GPU time). For each shape of the default sweep at N = 512 and 1024 (float16,
hidden 2048, B = 32768 / N): the host time per call (200 calls enqueued without waiting for the
GPU), the wall time per call (200 calls, then one synchronize), and a cProfile of 100 calls (the
15 functions with the most own time). Run on a GPU from the repo root:

    python benchmarks/host_overhead.py > host-overhead.txt

``--stubbed`` measures flashrun's own part alone, on any machine, GPU or not: Triton's driver
replaced by one that names an sm_90 target (tests/precompile_sm90.py's), every launch handed to
a no-op instead of Triton (so neither Triton's per-call launch nor the GPU is timed), and the
mean host time per forward call over 2000 calls, without and with autograd, on the same shapes,
then per backward call (``torch.autograd.grad`` of one kept forward, and flashrun's
``_attn_backward`` alone; GQA 4:1; the portable backward, since CPU tensors never take the Gluon
one), then per decode call and KV-cache call without autograd (:func:`stubbed_decode`):

    python benchmarks/host_overhead.py --stubbed
"""

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's flashrun
STUBBED = "--stubbed" in sys.argv
if STUBBED:
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels' launchers, never run (read at their import)

import torch  # noqa: E402

SHAPES = [(512, 64, False), (512, 64, True), (512, 128, False), (512, 128, True), (1024, 64, True), (1024, 128, True)]


def stubbed() -> None:
    """flashrun's own host time per forward call, launches stubbed, on a fake sm_90 device."""
    sys.path.insert(0, str(REPO / "tests"))
    import triton
    from precompile_sm90 import Sm90

    triton.runtime.driver.set_active(Sm90())
    torch.cuda.get_device_name = lambda *args: "NVIDIA H200"  # the shipped table's GPU
    torch.cuda.current_device = lambda: 0
    from flashrun.kernels import flash_attention, tuning
    from flashrun.kernels.flash import args, attention

    attention.check_inputs = lambda *a, **k: None  # "tensors on the CPU": they are, here
    attention._tma_ok = lambda q, k, v: False  # TMA descriptors would ask the (absent) GPU
    args._multiprocessors = lambda device: 132
    with tuning.compile_only(lambda kernel, grid, args, kwargs: None):
        for n, d, causal in SHAPES:
            b, h = 32768 // n, 2048 // d
            times = []
            for grad in (False, True):
                q = torch.randn(b, h, n, d, dtype=torch.float16, requires_grad=grad)
                for _ in range(20):
                    flash_attention(q, q, q, causal=causal)
                start = time.perf_counter()
                for _ in range(2000):
                    flash_attention(q, q, q, causal=causal)
                times.append((time.perf_counter() - start) / 2000 * 1e6)
            print(f"B{b} H{h} N{n} D{d} fp16 {'causal' if causal else 'full':6}: flashrun's own host time "
                  f"{times[0]:.1f} us/call, {times[1]:.1f} us with autograd (launch stubbed)")
        stubbed_backward(flash_attention)
    stubbed_decode()


def stubbed_decode() -> None:
    """Host time per decode call without autograd (B1 MQA 32/1 x 16k keys, D128 bf16) and per
    KV-cache call (the same cache as (B, N, H_kv, D), lengths a device tensor), every kernel launch
    a no-op: the minimum over 15 rounds of 500 calls (a noisy 2-core CPU's medians wander)."""
    from flashrun.kernels import flash_attention, flash_attention_with_kvcache
    from flashrun.kernels.flash import attention, decode, launch

    attention.check_inputs = lambda *a, **k: None  # "tensors on the CPU": they are, here
    decode._multiprocessors = lambda device: 132
    decode._check_device = lambda q: None
    decode._current_stream = lambda device: 0
    launch._Launch.__call__ = lambda self, stream, *args: None
    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 16384, 128, dtype=torch.bfloat16)
    kc = k.transpose(1, 2).contiguous()
    lengths = torch.full((1,), 16384, dtype=torch.int32)
    calls = {"decode B1 H32/1 N16384 D128 bf16": lambda: flash_attention(q, k, k),
             "KV cache, the same": lambda: flash_attention_with_kvcache(q.transpose(1, 2), kc, kc, lengths)}
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            rounds = []
            for _ in range(15):
                start = time.perf_counter()
                for _ in range(500):
                    fn()
                rounds.append((time.perf_counter() - start) / 500 * 1e6)
            print(f"{name}: flashrun's own host time min {min(rounds):.1f} us/call, median "
                  f"{sorted(rounds)[7]:.1f} (no autograd, launches stubbed)")


def stubbed_backward(flash_attention) -> None:
    """Host time per backward call, launches stubbed (the caller's compile_only): through autograd,
    and flashrun's ``_attn_backward`` called directly. CPU tensors: autograd's own tensor work
    (dK + dV, dQ's cast) runs on the CPU here, where a GPU host would only enqueue it, so the
    first overstates; the second is what a GPU host pays in flashrun's Python too."""
    from flashrun.kernels.flash import attention

    def per_call(fn, calls: int = 500) -> float:
        for _ in range(20):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    for n, d, causal in SHAPES:
        q = torch.randn(1, 8, n, d, dtype=torch.float16, requires_grad=True)
        k = torch.randn(1, 2, n, d, dtype=torch.float16, requires_grad=True)
        do = torch.randn(1, 8, n, d, dtype=torch.float16)
        out = flash_attention(q, k, k, causal=causal)
        variant = attention._variant(q, 1, n, causal, (-1, -1), 0.0, None)
        o, lse = attention._attn_forward(q.detach(), k.detach(), k.detach(), d ** -0.5, variant)
        total = per_call(lambda: torch.autograd.grad(out, (q, k), do, retain_graph=True))
        own = per_call(lambda: attention._attn_backward(do, q.detach(), k.detach(), k.detach(), o, lse, d ** -0.5,
                                                        variant))
        print(f"B1 H8/2 N{n} D{d} fp16 {'causal' if causal else 'full':6}: backward {total:.0f} us/call through "
              f"autograd, flashrun's _attn_backward {own:.0f} us (launch stubbed)")


def main() -> None:
    if STUBBED:
        return stubbed()
    from flashrun.kernels import flash_attention

    for n, d, causal in SHAPES:
        b, h = 32768 // n, 2048 // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        for _ in range(10):
            flash_attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            flash_attention(q, k, v, causal=causal)
        host = (time.perf_counter() - start) / 200
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 200
        # the GPU alone: the kernel time of one call from CUDA events around 50 calls
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        for _ in range(50):
            flash_attention(q, k, v, causal=causal)
        events[1].record()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            flash_attention(q, k, v, causal=causal)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(f"== B{b} H{h} N{n} D{d} fp16 {'causal' if causal else 'full'}: host {host * 1e6:.0f} us/call, "
              f"wall {wall * 1e6:.0f} us/call, events {events[0].elapsed_time(events[1]) * 1e3 / 50:.0f} us/call")
        print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip())[:3000])


if __name__ == "__main__":
    main()
