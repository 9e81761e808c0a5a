"""The 1b models' prefill attention shapes, forward alone (bf16, causal, 4 x 2048): the shipped
path (tuned table, Triton below the Gluon gate) against the heuristic Triton config, each Gluon
kernel forced (hopper.OVERRIDE), and cuDNN; max error against cuDNN's output beside each. Two
layouts: ``dense`` (B, H, N, D) tensors, and ``model``, what transformers hands an attention
function: (B, N, H, D) projections seen as (B, H, N, D).

    OUT=DIR python benchmarks/prefill_forward_ab.py [--sweep]   # on the GPU; writes $OUT/fwd_ab.json

--sweep also times, in the model layout, every forward candidate the tuner has for the head dim
and a few launch configs outside its space (other tiles, stages, warp specialization).
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

from flashrun.kernels import LaunchConfig, tuning  # noqa: E402
from flashrun.kernels.flash import attention as flash, hopper  # noqa: E402

SHAPES = (("llama", 32, 8, 64), ("qwen2", 12, 2, 128))  # (family, heads, k/v heads, head_dim)


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
        results[f"{family}-{layout}"] = row
        print(family, layout, json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fwd_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
