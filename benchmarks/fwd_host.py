"""Where one flash forward call's host time goes on a GPU, piece by piece (issue 20: inside
qwen2-1b the swap's forward call held the H200's host 290-420 us against SDPA's 60-120, NOTES v15).

Each piece is called REPS times back to back on tiny inputs in a model's layout ((B, N, H, D)
projections seen as (B, H, N, D)), so that the GPU never falls behind and no launch waits for a
queue slot: the host microseconds per call (median of ROUNDS rounds) are the host's own. Pieces,
outermost first: the Kernel call without and with autograd, and with its backward (at 256 rows);
``hopper._run_gluon`` (the plan); its six TensorDescriptors (made, and rebased where the plan
keeps templates); its two outputs; the plan's launch with descriptors made beforehand (Triton's
launcher: the six descriptors' CUtensorMaps, then the C launch); ``make_tensordesc_arg`` alone;
``fill_tma_descriptor`` alone; the C launch with every argument expanded beforehand; SDPA (cuDNN)
on the same inputs. Then a cProfile of the no-grad and autograd calls and of forward + backward
at 256 rows (the 20 functions with the most own time, then flashrun's, Triton's and torch's by
cumulative time), the last with its GPU time per call. GPU
only, from the repo root:

    python benchmarks/fwd_host.py --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPS, ROUNDS = 200, 7


def per_call_us(fn) -> float:
    """Median over ROUNDS of the host's microseconds per call of ``fn`` (REPS calls, then a sync)."""
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPS):
            fn()
        rounds.append((time.perf_counter() - start) / REPS * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(rounds), 1)


def inputs(batch: int, heads: int, kv_heads: int, n: int, d: int, grad: bool = False):
    def view(h):
        return torch.randn(batch, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(grad)
    return view(heads), view(kv_heads), view(kv_heads)


def pieces(shape: tuple[int, ...]) -> dict[str, float]:
    from triton.backends.nvidia import driver as nv_driver
    from triton.runtime import driver

    from flashrun import kernels
    from flashrun.kernels.flash import hopper
    try:
        from flashrun.kernels.flash.launch import rebased
    except ImportError:
        rebased = None

    flash = kernels.get("flash")
    q, k, v = inputs(*shape)
    qg, kg, vg = inputs(*shape, grad=True)
    scale = q.shape[-1] ** -0.5
    times: dict[str, float] = {}
    with torch.no_grad():
        flash(q, k, v, causal=True)
    assert hopper.LAST_PATH == hopper.GLUON_PATH, hopper.LAST_PATH
    flash(qg, kg, vg, causal=True).sum().backward()
    torch.cuda.synchronize()

    def no_grad():
        with torch.no_grad():
            flash(q, k, v, causal=True)
    times["kernel call, no grad"] = per_call_us(no_grad)
    times["kernel call, autograd"] = per_call_us(lambda: flash(qg, kg, vg, causal=True))
    # forward + backward at 256 rows (at 2048 the backward's GPU time, ~0.7 ms, would set the pace)
    qs, ks, vs = inputs(*shape[:3], 256, shape[4], grad=True)
    do = torch.randn_like(qs)
    times["forward + backward, N 256"] = per_call_us(lambda: flash(qs, ks, vs, causal=True).backward(do))
    times["sdpa (cudnn) forward + backward, N 256"] = per_call_us(lambda: F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True).backward(do))
    times["sdpa (cudnn), no grad"] = per_call_us(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))

    cfg = hopper.KERNELS[hopper.kernel_for(q.shape[-1], True, k.shape[2], hopper.query_tiles(q))]
    times["hopper._run_gluon"] = per_call_us(lambda: hopper._run_gluon(q, k, v, scale, True, cfg))
    (plan,) = [p for p in hopper._plans.values() if p.launch.compiled is not None][-1:]
    from flashrun.kernels.flash.hopper_jit import HALF_M
    (d0, d1), kv_rows = hopper.split_head_dim(q.shape[-1]), cfg.block_n

    def descriptors():
        return (*hopper._descriptors(q, HALF_M, d0, d1), *hopper._descriptors(k, kv_rows, d0, d1),
                *hopper._descriptors(v, kv_rows, d0, d1))
    times["six TensorDescriptors"] = per_call_us(descriptors)
    if rebased is not None:  # (a checkout before the plans kept templates has neither)
        times["six descriptors rebased"] = per_call_us(lambda: [rebased(first, t) for t, (first, _) in zip(
            (q, k, v), plan.descriptors) for _ in "01"])
    times["outputs (two empty)"] = per_call_us(lambda: hopper._outputs(q))
    stream = hopper._current_stream(q.device)
    times["current stream"] = per_call_us(lambda: hopper._current_stream(q.device))
    descs, (o, lse) = descriptors(), hopper._outputs(q)
    times["plan launch (descriptors made)"] = per_call_us(lambda: plan.launch(stream, *descs, o, lse))

    ck = plan.launch.compiled
    metas = ck.metadata.tensordesc_meta
    times["six make_tensordesc_arg"] = per_call_us(
        lambda: [nv_driver.make_tensordesc_arg(d, m) for d, m in zip(descs, metas)])
    fill = driver.active.utils.fill_tma_descriptor
    fills = [(d.base.data_ptr(), m["swizzle"], m["elem_size"], nv_driver.TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
              m["block_size"], d.shape, d.strides, 0) for d, m in zip(descs, metas)]
    times["six fill_tma_descriptor"] = per_call_us(lambda: [fill(*a) for a in fills])

    launcher = ck.run.launch
    cells = dict(zip(launcher.__code__.co_freevars, (c.cell_contents for c in launcher.__closure__ or ())))
    raw = cells.get("launcher")
    if raw is not None:  # Triton's C launch with every argument expanded beforehand
        expanded = [x for d, m in zip(descs, metas) for x in nv_driver.make_tensordesc_arg(d, m)]
        base = (*plan.launch.grid, stream, ck.function, ck.run.launch_cooperative_grid, ck.run.launch_pdl,
                None, None, ck.packed_metadata, None, None, None)
        args = (*expanded, o.data_ptr(), lse.data_ptr(), *plan.launch.tail)
        try:
            raw(*base, *args)
            torch.cuda.synchronize()
            times["C launch (all expanded)"] = per_call_us(lambda: raw(*base, *args))
        except Exception as exc:  # noqa: BLE001 - a probe: say why and go on
            times["C launch (all expanded)"] = f"failed: {exc}"
    return times


def profile(shape: tuple[int, ...], grad: bool, backward: bool = False) -> str:
    """cProfile of REPS calls: the no-grad or autograd forward at ``shape``, or (``backward``)
    forward + backward at 256 rows, followed by its GPU time per call (torch.profiler's device
    time of every kernel, memset and copy: is the GPU or the host setting the pace?)."""
    from flashrun import kernels

    flash = kernels.get("flash")
    if backward:
        shape = (*shape[:3], 256, shape[4])
    q, k, v = inputs(*shape, grad=grad)
    do = torch.randn_like(q)

    def call():
        o = flash(q, k, v, causal=True)
        if backward:
            o.backward(do)
    profiler = cProfile.Profile()
    with torch.set_grad_enabled(grad):
        call()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(REPS):
            call()
        profiler.disable()
    torch.cuda.synchronize()
    gpu = ""
    if backward:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        gpu = "\nGPU time per call (20 calls):\n" + "\n".join(
            f"  {e.key[:70]:70s} {e.device_time_total / 20:8.1f} us x{e.count / 20:g}"
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total) if e.device_time_total > 0)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats("flashrun|triton|torch", 40 if backward else 30)
    return text.getvalue() + gpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    shape = (1, 2, 1, 2048, 128)  # (B, H, H_KV, N, D): causal, the Gluon kernel, ~15 us of GPU per launch
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shape": shape,
               "us_per_call": pieces(shape)}
    import triton
    results["triton"] = triton.__version__
    for name, us in results["us_per_call"].items():
        print(f"{name:40s} {us}", flush=True)
    for name, grad, backward in (("grad_False", False, False), ("grad_True", True, False),
                                 ("backward_n256", True, True)):
        text = profile(shape, grad, backward)
        results[f"cprofile_{name}"] = text
        print(f"cProfile, {REPS} calls, {name}\n{text}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"fwd-host{args.label}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
