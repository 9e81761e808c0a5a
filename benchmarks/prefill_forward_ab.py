"""The 1b models' prefill attention shapes, forward alone (bf16, causal, 4 x 2048): the shipped
path (tuned table, Triton below the Gluon gate) against the heuristic Triton config, each Gluon
kernel forced (hopper.OVERRIDE), and cuDNN; max error against cuDNN's output beside each. Two
layouts: ``dense`` (B, H, N, D) tensors, and ``model``, what transformers hands an attention
function: (B, N, H, D) projections seen as (B, H, N, D).

    OUT=DIR python benchmarks/prefill_forward_ab.py [--sweep]   # on the GPU; writes $OUT/fwd_ab.json

--sweep also times, in the model layout, every forward candidate the tuner has for the head dim
and a few launch configs outside its space (other tiles, stages, warp specialization).
--gluon-sweep times, in the model layout, the Gluon forward over its config space (one or two
consumer warpgroups, 64- or 128-key blocks, 2-4 stages, with and without the intra-warpgroup
overlap, persistent or not), compiled ahead in parallel (flashrun's warmup.Batch), each config
timed in REPEATS separate do_bench calls (the Gluon forward's times varied from call to call in
v11); and one config's single launches, timed with CUDA events, as percentiles.
"""

import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels import LaunchConfig, tuning, warmup  # noqa: E402
from flashrun.kernels.flash import attention as flash, hopper  # noqa: E402

SHAPES = (("llama", 32, 8, 64), ("qwen2", 12, 2, 128))  # (family, heads, k/v heads, head_dim)
REPEATS = 3


def gluon_space(d: int) -> list[hopper.HopperConfig]:
    """The Gluon forward's configs at head_dim ``d`` that fit an SM's shared memory."""
    space = []
    for consumers, block_n, stages, overlap, persistent in itertools.product(
            (1, 2), (64, 128), (2, 3, 4), (True, False), (False, True)):
        regs = {} if consumers == 2 else {"consumer_regs": 232, "maxnreg": 128}
        cfg = hopper.HopperConfig(d, block_n=block_n, stages=stages, overlap=overlap, consumers=consumers,
                                  persistent=persistent, **regs)
        if hopper.smem_bytes(cfg) + 2048 <= hopper.SMEM_LIMIT:
            space.append(cfg)
    return space


def gluon_name(cfg: hopper.HopperConfig) -> str:
    return (f"gluon c{cfg.consumers} n{cfg.block_n} s{cfg.stages}{' overlap' if cfg.overlap else ''}"
            f"{' persistent' if cfg.persistent else ''}")


def gluon_sweep(q, k, v, ref, row: dict) -> None:
    """Every :func:`gluon_space` config: compiled ahead together, then each timed REPEATS times."""
    space = gluon_space(q.shape[-1])
    batch = warmup.Batch()
    kernels = batch.collect(lambda: [hopper._run_gluon(q, k, v, q.shape[-1] ** -0.5, True, cfg) for cfg in space])
    print(f"compiled {len(kernels)} Gluon kernels in {batch.wait(kernels):.1f} s", flush=True)
    batch.close()
    for cfg in space:
        def run(cfg=cfg):
            return hopper._run_gluon(q, k, v, q.shape[-1] ** -0.5, True, cfg)[0]
        try:
            got = [timed(run, ref) for _ in range(REPEATS)]
            row[gluon_name(cfg)] = {"ms": [t["ms"] for t in got], "err": got[0]["err"]}
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a result too
            row[gluon_name(cfg)] = {"error": repr(exc)[:200]}
    ok = {name: min(r["ms"]) for name, r in row.items() if name.startswith("gluon c") and "ms" in r}
    best = min(ok, key=ok.get)
    cfg = next(c for c in space if gluon_name(c) == best)
    row["best gluon launches (CUDA events, ms)"] = {"config": best, **single_launches(
        lambda: hopper._run_gluon(q, k, v, q.shape[-1] ** -0.5, True, cfg))}


def single_launches(fn, count: int = 200) -> dict:
    """Percentiles of ``count`` single launches, each between CUDA events (L2 not flushed)."""
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {f"p{p}": round(times[min(count - 1, count * p // 100)], 4) for p in (0, 10, 50, 90, 100)}


def timed(fn, ref) -> dict:
    out = fn()
    torch.cuda.synchronize()
    return {"ms": triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"),
            "err": (out.float() - ref.float()).abs().max().item(), "path": hopper.LAST_PATH}


def main() -> None:
    results = {}
    for (family, h, h_kv, d), layout in itertools.product(SHAPES, ("dense", "model")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = ((4, 2048, h, d), (4, 2048, h_kv, d), (4, 2048, h_kv, d))
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                   for shape in shapes)
        if layout == "dense":
            q, k, v = (t.contiguous() for t in (q, k, v))
        k_all, v_all = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)

        def shipped():
            return flash.flash_attention(q, k, v, causal=True)

        heuristic = {"fwd": tuning.default("fwd", d, torch.bfloat16)}
        ref = cudnn()
        row = {"shipped": timed(shipped, ref),
               "heuristic": timed(lambda: flash.flash_attention(q, k, v, causal=True, launch=heuristic), ref),
               "cudnn": timed(cudnn, ref)}
        for name, cfg in hopper.KERNELS.items():
            if cfg.head_dim != d or name not in (f"d{d}", f"d{d}-persistent"):
                continue
            hopper.OVERRIDE = cfg
            try:
                row[f"gluon-{name}"] = timed(shipped, ref)
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a result too
                row[f"gluon-{name}"] = {"error": repr(exc)[:300]}
            finally:
                hopper.OVERRIDE = None
        if layout == "model" and "--sweep" in sys.argv[1:]:
            extra = [LaunchConfig(64, 128, 4, 3, True), LaunchConfig(128, 64, 8, 3, True, True),
                     LaunchConfig(64, 64, 4, 4, True), LaunchConfig(64, 64, 4, 2, True),
                     LaunchConfig(128, 128, 8, 4, True, True), LaunchConfig(64, 64, 4, 3, True, True),
                     LaunchConfig(128, 64, 4, 2, True), LaunchConfig(128, 128, 8, 2, True, True)]
            for cfg in dict.fromkeys([*tuning.candidates("fwd", d, torch.bfloat16), *extra]):
                try:
                    row[f"cfg {cfg}"] = timed(lambda: flash.flash_attention(q, k, v, causal=True, launch={"fwd": cfg}),
                                              ref)
                except Exception as exc:  # noqa: BLE001 - a config that does not fit is a result too
                    row[f"cfg {cfg}"] = {"error": repr(exc)[:200]}
        if layout == "model" and "--gluon-sweep" in sys.argv[1:]:
            gluon_sweep(q, k, v, ref, row)
            row["shipped launches (CUDA events, ms)"] = single_launches(shipped)
            row["cudnn launches (CUDA events, ms)"] = single_launches(cudnn)
        results[f"{family}-{layout}"] = row
        print(family, layout, json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fwd_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
