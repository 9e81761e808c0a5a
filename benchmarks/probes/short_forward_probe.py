"""Issue 22's short forward shapes: every launch the forward could take there, timed against cuDNN.

Cells: the bench sweep's shapes (hidden 2048, B = 32768 / N, dense (B, H, N, D)) at N = 512 and
1024, head_dim 64 and 128, full and causal, fp16 and bf16. Per cell: cuDNN, the shipped path,
every portable config of the tuner's space and a few outside it (``EXTRA``), and every Gluon
kernel of ``hopper.KERNELS`` at that head_dim forced (``hopper.OVERRIDE``). Everything compiles
ahead in parallel (flashrun's ``warmup.Batch``); the GPU runs a few seconds of matmuls before the
first timing (a cold GPU's first timings ran slow in v12). do_bench medians, L2 cleared; each
entry's max error against cuDNN's output beside it.

``--cells gate`` checks round 14's gate and table changes where the sweep did not look: the Gluon
persistent kernels (shipped) against the portable kernel (``hopper.ENABLED = False``) at head_dim
128 from 512 keys and 64 from 1024 with few programs (1-8 sequences of 16 or 32 heads), and at
head_dim 128 causal the 64x64 tile with and without TMA; each entry timed three times, in turns.

``--cells causal`` times causal cells from 512 to 4096 keys (head_dim 64 and 128) and the prefill
cells below: shipped, cuDNN and every Gluon kernel at that head_dim (the persistent ones' causal
tile order, round 22), three times in turns.

``--cells d192`` times head_dim 192 (the bench sweep's 10 heads), full and causal, 1024 to 8192
keys, fp16 and bf16: shipped, cuDNN and both Gluon 192 kernels (one tile per program and
persistent), three times in turns - which kernel the gate should send each mask to. ``--cells d96``
and ``--cells d256`` do the same at head_dim 96 (21 heads; the Gluon 96 kernels are in no gate
yet: this decides where they go) and 256 (8 heads).

``--cells lengths`` times head_dim 64 and 128, bf16, full and causal, at 1024, 4096 and 16384 keys:
shipped, cuDNN and every Gluon kernel at that head_dim, three times in turns (round 28: Q as QKᵀ's
register operand, the ``-qregs`` kernels, against the shipped ones).

``--cells fp8`` times the e4m3 forward (bf16, the bench sweep's heads, 1024 to 16384 keys, head_dim 64, 128
and 256, full and causal; inputs quantized once by ``quantize_qkv``): shipped (``flash_attention_fp8``),
every one-block Gluon kernel at that head_dim with FP8 (``hopper.run_fp8``), the e4m3-only ones
(``hopper.FP8_KERNELS``, ``FP8_TILES``: wider key blocks), and cuDNN's bf16 forward on
the unquantized inputs, three times in turns; errors are against cuDNN's bf16 output (e4m3's own, about 1e-2).

``--cells prefill`` times only the 1b models' prefill attention (llama 32/8 D64 and qwen2 12/2
D128, bf16 causal 4 x 2048, the model's (B, N, H, D) layout seen as (B, H, N, D)): shipped and
cuDNN, for A/Bs of one commit against another in separate processes.

    OUT=DIR python benchmarks/probes/short_forward_probe.py [--cells short|gate|tiles|causal|d96|d192|d256|lengths|fp8|prefill]
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels import LaunchConfig, tuning, warmup  # noqa: E402
from flashrun.kernels.flash import attention as flash, hopper  # noqa: E402

os.environ.setdefault("FLASHRUN_FIRST_USE", "wait")  # a Gluon path's first use checks before the call, as commands do

C = LaunchConfig


def portable(q, k, v, causal=True):
    """flash_attention through the portable kernel (the Gluon forward off for the call)."""
    hopper.ENABLED = False
    try:
        return flash.flash_attention(q, k, v, causal=causal)
    finally:
        hopper.ENABLED = True


EXTRA = {  # portable configs outside the tuner's space, by head_dim
    64: [C(64, 128, 4, 3, True), C(128, 64, 8, 3, True, True), C(64, 64, 4, 2, True), C(64, 64, 4, 4, True),
         C(128, 64, 4, 2, True), C(64, 64, 4, 3, True, True)],
    128: [C(64, 64, 4, 3, True), C(64, 64, 4, 2, True), C(64, 128, 4, 2, True), C(128, 64, 8, 2, True, True),
          C(64, 64, 4, 3, True, True), C(128, 64, 8, 3, True, True), C(64, 32, 4, 3, False), C(64, 128, 8, 3, True)],
}


def short_cells():
    for n, d, causal, dtype in itertools.product((512, 1024), (64, 128), (False, True), (torch.float16, torch.bfloat16)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": causal, "dtype": dtype,
               "layout": "dense"}


def gate_cells():
    for n, b, h in itertools.product((512, 1024), (1, 2, 4, 8), (16,)):
        yield {"b": b, "h": h, "h_kv": h, "n": n, "d": 128, "causal": False, "dtype": torch.bfloat16, "layout": "dense"}
    for b in (1, 2, 4, 8):
        yield {"b": b, "h": 32, "h_kv": 32, "n": 1024, "d": 64, "causal": False, "dtype": torch.float16,
               "layout": "dense"}
    for n, dtype in itertools.product((512, 1024), (torch.float16, torch.bfloat16)):
        yield {"b": 32768 // n, "h": 16, "h_kv": 16, "n": n, "d": 128, "causal": True, "dtype": dtype, "layout": "dense"}


def tiles_cells():
    for n, d, dtype in itertools.product((512, 1024), (64, 128), (torch.float16, torch.bfloat16)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": True, "dtype": dtype,
               "layout": "dense"}


# causal tiles with 32-key blocks (the sweep's 64x32 without TMA came second at 512 causal keys,
# head_dim 128, and TMA lifted 64x64 by 1.13x there), beside the shipped ones
TILES = [C(64, 64, 4, 3, True), C(64, 64, 4, 2, True), C(64, 32, 4, 3, False), C(64, 32, 4, 3, True),
         C(64, 32, 4, 2, True), C(64, 32, 4, 4, True)]


def causal_cells():
    """Causal shapes from 512 to 4096 keys (the bench sweep's B = 32768 / N, hidden 2048), and the 1b
    models' prefill attention: the Gluon kernels' causal tile order (persistent ones) against the
    shipped path."""
    for n, d, dtype in itertools.product((512, 1024, 2048, 4096), (64, 128), (torch.float16, torch.bfloat16)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": True, "dtype": dtype,
               "layout": "dense"}
    yield from prefill_cells()


def head_dim_cells(d: int):
    for n, causal, dtype in itertools.product((1024, 2048, 4096, 8192), (False, True), (torch.float16, torch.bfloat16)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": causal,
               "dtype": dtype, "layout": "dense"}


def lengths_cells():
    for n, d, causal in itertools.product((1024, 4096, 16384), (64, 128), (False, True)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": causal,
               "dtype": torch.bfloat16, "layout": "dense"}


def fp8_cells():
    for n, d, causal in itertools.product((1024, 4096, 16384), (64, 128, 256), (False, True)):
        yield {"b": 32768 // n, "h": 2048 // d, "h_kv": 2048 // d, "n": n, "d": d, "causal": causal,
               "dtype": torch.bfloat16, "layout": "dense"}


# e4m3-only candidates beside hopper.FP8_KERNELS (an fp8 stage holds twice the keys of a bf16 one in
# the same bytes). Triton 3.6 (compile_hopper.py --fp8): d64-n256 spills 20 B full and 372 B causal.
FP8_TILES = {
    "d64-n256": hopper.HopperConfig(64, block_n=256, stages=3, persistent=True),
    "d128-n128-s4": hopper.HopperConfig(128, block_n=128, stages=4, persistent=True),
    "d256-n128-base": hopper.HopperConfig(256, block_n=128, stages=2, overlap=False),
}


def fp8_launches(cell, q, k, v) -> dict:
    """The e4m3 forwards of ``--cells fp8`` on q, k, v quantized once."""
    from flashrun.kernels import flash_attention_fp8, quantize_qkv

    q8, k8, v8, *descales = quantize_qkv(q, k, v)
    causal, scale = cell["causal"], cell["d"] ** -0.5
    calls = {"shipped": lambda: flash_attention_fp8(q8, k8, v8, *descales, causal=causal)}
    for name, cfg in (hopper.KERNELS | hopper.FP8_KERNELS | FP8_TILES).items():
        if cfg.head_dim == cell["d"] and not hopper.split_head_dim(cfg.head_dim)[1]:
            calls[f"gluon {name}"] = lambda cfg=cfg: hopper.run_fp8(q8, k8, v8, *descales, scale, causal, cfg)[0]
    return calls


def prefill_cells():
    for h, h_kv, d in ((32, 8, 64), (12, 2, 128)):
        yield {"b": 4, "h": h, "h_kv": h_kv, "n": 2048, "d": d, "causal": True, "dtype": torch.bfloat16,
               "layout": "model"}


def inputs(cell):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, n, d, dtype = cell["b"], cell["n"], cell["d"], cell["dtype"]
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
               for h in (cell["h"], cell["h_kv"], cell["h_kv"]))
    if cell["layout"] == "dense":
        q, k, v = (t.contiguous() for t in (q, k, v))
    return q, k, v


def launches(cell, q, k, v, cells: str) -> dict:
    """name -> a call that runs that launch."""
    causal = cell["causal"]
    if cells == "fp8":
        return fp8_launches(cell, q, k, v)
    calls = {"shipped": lambda: flash.flash_attention(q, k, v, causal=causal)}
    if cells == "tiles":
        for cfg in TILES:
            calls[f"cfg {cfg}"] = lambda cfg=cfg: flash.flash_attention(q, k, v, causal=causal, launch={"fwd": cfg})
    elif cells == "gate" and causal:
        for cfg in (C(64, 64, 4, 3, False), C(64, 64, 4, 3, True)):
            calls[f"cfg {cfg}"] = lambda cfg=cfg: flash.flash_attention(q, k, v, causal=causal, launch={"fwd": cfg})
    elif cells == "gate":
        calls["portable"] = lambda: portable(q, k, v, causal)
    if cells not in ("short", "causal", "d96", "d192", "d256", "lengths"):
        return calls
    if cells == "short":
        for cfg in dict.fromkeys([*tuning.candidates("fwd", cell["d"], cell["dtype"]), *EXTRA[cell["d"]]]):
            calls[f"cfg {cfg}"] = lambda cfg=cfg: flash.flash_attention(q, k, v, causal=causal, launch={"fwd": cfg})
    for name, cfg in hopper.KERNELS.items():
        if cfg.head_dim == cell["d"]:
            calls[f"gluon {name}"] = lambda cfg=cfg: hopper._run_gluon(q, k, v, q.shape[-1] ** -0.5, causal, cfg)[0]
    return calls


def heat(seconds: float = 3.0) -> None:
    """Matmuls until the GPU has run ``seconds`` (clocks up before the first timing)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def timed(fn, ref) -> dict:
    out = fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return {"ms": round(ms, 4), "err": round((out.float() - ref.float()).abs().max().item(), 5)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", choices=("short", "gate", "tiles", "causal", "d96", "d192", "d256", "lengths",
                                            "fp8", "prefill"), default="short")
    opts = parser.parse_args()
    cells = list({"short": short_cells, "gate": gate_cells, "tiles": tiles_cells, "causal": causal_cells,
                  "d96": lambda: head_dim_cells(96), "d192": lambda: head_dim_cells(192),
                  "d256": lambda: head_dim_cells(256), "lengths": lengths_cells, "fp8": fp8_cells,
                  "prefill": prefill_cells}[opts.cells]())
    repeats = 3 if opts.cells in ("gate", "tiles", "causal", "d96", "d192", "d256", "lengths", "fp8") else 1
    prepared = [(cell, *inputs(cell)) for cell in cells]
    start = time.perf_counter()
    batch = warmup.Batch()
    kernels = batch.collect(lambda: [fn() for cell, q, k, v in prepared
                                     for fn in launches(cell, q, k, v, opts.cells).values()])
    batch.wait(kernels)
    batch.close()
    compiled = {"kernels": len(kernels), "seconds": round(time.perf_counter() - start, 1)}
    print(f"compiled {compiled['kernels']} kernels ahead in {compiled['seconds']} s", flush=True)
    heat()
    rows = []
    for cell, q, k, v in prepared:
        group = cell["h"] // cell["h_kv"]
        k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, is_causal=cell["causal"])

        ref = cudnn()
        row = {**cell, "dtype": str(cell["dtype"]).removeprefix("torch.")}
        calls = {"cudnn": cudnn, **launches(cell, q, k, v, opts.cells)}
        for _ in range(repeats):  # in turns, so that a drift falls on every entry alike
            for name, fn in calls.items():
                if "error" in row.get(name, {}):
                    continue
                try:
                    got = timed(fn, ref)
                except Exception as exc:  # noqa: BLE001 - a launch that cannot run here is a result too
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    continue
                if name == "shipped":
                    got["path"] = hopper.LAST_PATH
                    got["config"] = tuning.chosen().get("fwd", {}).get("config")
                runs = row.setdefault(name, {"runs": []})["runs"]
                runs.append(got["ms"])
                row[name].update(got, ms=statistics.median(runs))
        timings = {name: r["ms"] for name, r in row.items() if isinstance(r, dict) and "ms" in r and name != "cudnn"}
        best = min(timings, key=timings.get)
        row["best"] = best
        row["summary"] = {"cudnn/shipped": round(row["cudnn"]["ms"] / timings["shipped"], 3) if "shipped" in timings
                          else None, "cudnn/best": round(row["cudnn"]["ms"] / timings[best], 3)}
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("b", "h", "n", "d", "causal", "dtype", "best", "summary")}
                         | {"shipped": row.get("shipped")}), flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"short_fwd_{opts.cells}.json").write_text(json.dumps({"compiled": compiled, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
