"""One-shot H200 probe of the Gluon sm_90 forward (flashrun/kernels/flash/hopper.py).

    python benchmarks/probe_hopper.py [--variants base,overlap,pingpong,overlap-s+1] [--budget-s 200]

Variants (flash_hopper.HopperConfig): base (the default: no overlap), overlap (FA3's
intra-warpgroup pipelining), pingpong (overlap + the two consumers taking turns at the tensor
cores through mbarriers), overlap-s+1 (overlap with one more K/V stage, where it fits).

1. The path's state: Triton/torch versions, the Gluon API check, what flash's first-use check
   decides (forward_path), in a clean process state.
2. Correctness of the Gluon kernel itself (called directly, every variant): fp16/bf16 x D 64/128/256 x
   causal/full x N in (17, 200, 1024, 4096) for the default variant (other variants: fp16, N 1024),
   plus GQA and bottom-right causal Nq != Nk cases (default variant), against SDPA's math in float32. Bound, as
   flashrun's judge: 2 x the portable flash forward's max error + atol(dtype) x max(1, max|ref|);
   LSE against float32 logsumexp within 1e-2 absolute. NaN isolation: batch entry 1 (q, k, v) is
   NaN, entry 0 must stay finite and correct.
3. Timing (triton.testing.do_bench, median), D in --timing-dims (64, 128): N in (1024, 4096, 16384), hidden 2048 (H = 2048 / D,
   B = 32768 / N): each Gluon variant, the portable flash forward (tuned, as flash runs it) and
   SDPA's cuDNN backend; TFLOP/s = 4 B H N^2 D (x 0.5 causal) / time. Variants are timed in
   fp16; bf16 times the default variant only.

Every case is caught on its own (a failing case prints FAIL and its traceback's last lines);
results go to $OUT/probe_hopper.json after every section. Cases past --budget-s are skipped
(printed), so the whole run stays under 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels.flash import attention as flash, hopper as flash_hopper  # noqa: E402

ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # flashrun/harness/judge.py's table
FACTOR = 2.0
OUT = Path(os.environ.get("OUT", "."))
RESULTS: dict = {"env": {}, "path": {}, "correctness": [], "timing": []}
START = time.perf_counter()


def variants(head_dim: int) -> dict[str, flash_hopper.HopperConfig]:
    """The kernel variants this probe compares, those whose shared memory fits."""
    base = flash_hopper.CONFIGS[head_dim]
    every = {"base": base, "overlap": replace(base, overlap=True),
             "overlap-s+1": replace(base, overlap=True, stages=base.stages + 1),
             "pingpong": replace(base, overlap=True, pingpong=True)}
    return {name: cfg for name, cfg in every.items()
            if flash_hopper.smem_bytes(head_dim, cfg) <= flash_hopper.SMEM_LIMIT - 1024}


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "probe_hopper.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def tail(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join("    " + s for s in text[-lines:])


def elapsed() -> float:
    return time.perf_counter() - START


def gluon(q, k, v, causal, cfg):
    flash_hopper.OVERRIDE = cfg
    try:
        return flash_hopper._run_gluon(q, k, v, q.shape[-1] ** -0.5, causal)
    finally:
        flash_hopper.OVERRIDE = None


def portable(q, k, v, causal, launch=None):
    variant = flash._variant(q, q.shape[0], k.shape[2], causal, (-1, -1), 0.0, None)
    return flash._attn_forward(q, k, v, q.shape[-1] ** -0.5, variant, launch, try_gluon=False)


def reference(q, k, v, causal):
    """float32 SDPA math (GQA expanded) and float32 logsumexp, bottom-right causal."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    n_q, n_k = q.shape[2], k.shape[2]
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = p @ vf
    return o, lse


def check_case(dtype, d, causal, n_q, n_k, h, h_kv, name, cfg, nan_neighbour=True) -> None:
    label = (f"{name:12s} {str(dtype)[6:]:8s} D={d:<3d} {'causal' if causal else 'full  '} Nq={n_q:<5d} Nk={n_k:<5d} "
             f"H={h}/{h_kv}")
    rec = {"variant": name, "dtype": str(dtype)[6:], "head_dim": d, "causal": causal, "n_q": n_q, "n_k": n_k,
           "heads": h, "kv_heads": h_kv, "config": asdict(cfg)}
    try:
        g = torch.Generator(device="cuda").manual_seed(n_q * 7 + d)
        b = 2
        q = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(b, h_kv, n_k, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(b, h_kv, n_k, d, device="cuda", dtype=dtype, generator=g)
        if nan_neighbour:  # batch entry 1 all NaN: entry 0 must not see it (TMA boxes past a head's rows)
            for t in (q, k, v):
                t[1] = float("nan")
        o, lse = gluon(q, k, v, causal, cfg)
        o_ref, lse_ref = reference(q[:1], k[:1], v[:1], causal)
        o_port, _ = portable(q[:1], k[:1], v[:1], causal, launch="default")
        torch.cuda.synchronize()
        o0, lse0 = o[:1].float(), lse[:1]
        err = (o0 - o_ref).abs().max().item()
        yard = (o_port.float() - o_ref).abs().max().item()
        bound = FACTOR * yard + ATOL[dtype] * max(1.0, o_ref.abs().max().item())
        finite_ref = torch.isfinite(lse_ref)
        lse_err = (lse0[finite_ref] - lse_ref[finite_ref]).abs().max().item() if finite_ref.any() else 0.0
        lse_inf_ok = bool((lse0[~finite_ref] == float("-inf")).all())
        nonfinite = int((~torch.isfinite(o0)).sum().item())
        ok = nonfinite == 0 and err <= bound and lse_err <= 1e-2 and lse_inf_ok
        rec.update(ok=ok, max_abs=err, bound=bound, portable_max_abs=yard, lse_max_abs=lse_err, nonfinite=nonfinite,
                   lse_inf_ok=lse_inf_ok)
        print(f"{'ok  ' if ok else 'FAIL'} {label}  max|o-ref| {err:.2e} (bound {bound:.2e}, portable {yard:.2e})  "
              f"max|lse-ref| {lse_err:.1e}" + (f"  NONFINITE {nonfinite}" if nonfinite else "")
              + ("" if lse_inf_ok else "  LSE of keyless rows not -inf"), flush=True)
    except Exception as exc:  # noqa: BLE001 - one case never ends the probe
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        print(f"FAIL {label}  raised {type(exc).__name__}\n{tail(exc)}", flush=True)
    RESULTS["correctness"].append(rec)


def bench(fn) -> float:
    fn()  # compile / tune outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_case(dtype, d, causal, n, names, budget_s) -> None:
    h, b = 2048 // d, 32768 // n
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    label = f"{str(dtype)[6:]:8s} D={d:<3d} {'causal' if causal else 'full  '} N={n:<5d} B={b:<2d} H={h}"
    row = {"dtype": str(dtype)[6:], "head_dim": d, "causal": causal, "n": n, "batch": b, "heads": h, "ms": {},
           "tflops": {}, "errors": {}}
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    providers = {f"gluon:{name}": (lambda cfg=cfg: gluon(q, k, v, causal, cfg))
                 for name, cfg in variants(d).items() if name in names}
    providers["flash-tl"] = lambda: portable(q, k, v, causal)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    providers["cudnn"] = cudnn
    for name, fn in providers.items():
        if elapsed() > budget_s:
            row["errors"][name] = "skipped: time budget"
            continue
        try:
            ms = bench(fn)
            row["ms"][name] = ms
            row["tflops"][name] = flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            row["errors"][name] = f"{type(exc).__name__}: {exc}"[:1000]
            print(f"FAIL timing {label} {name}: {type(exc).__name__}\n{tail(exc, 4)}", flush=True)
    tf = row["tflops"]
    cells = "  ".join(f"{p} {tf[p]:6.1f}" for p in tf)
    ratios = ""
    if "cudnn" in tf:
        ratios = "  vs cuDNN: " + " ".join(f"{p} {tf[p] / tf['cudnn']:.2f}x" for p in tf if p != "cudnn")
    print(f"     {label}  TFLOP/s: {cells}{ratios}", flush=True)
    RESULTS["timing"].append(row)
    del q, k, v


def path_state() -> None:
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
           "gluon_api": flash_hopper.gluon_api() or "ok"}
    RESULTS["env"] = env
    print("env: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(1, 16, 1024, 128, device="cuda", dtype=dtype)
        try:
            t0 = time.perf_counter()
            path = flash.forward_path(q, q, q, causal=True)  # runs the first-use check
            RESULTS["path"][str(dtype)[6:]] = {"path": path, "check_s": time.perf_counter() - t0,
                                               "reason": flash_hopper._checked.get(dtype)}
            print(f"flash.forward_path ({str(dtype)[6:]}, D=128 causal N=1024): {path}  "
                  f"(first-use check {time.perf_counter() - t0:.1f}s; {flash_hopper._checked.get(dtype) or 'passed'})",
                  flush=True)
            flash.attention_forward(q, q, q, causal=True)
            print(f"  flash_hopper.LAST_PATH after a forward: {flash_hopper.LAST_PATH}", flush=True)
        except Exception as exc:  # noqa: BLE001
            RESULTS["path"][str(dtype)[6:]] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            print(f"FAIL forward_path {dtype}: {type(exc).__name__}\n{tail(exc)}", flush=True)
    save()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,overlap,pingpong,overlap-s+1")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip cases that would start after this")
    ap.add_argument("--timing-dims", default="64,128", help="head dims to time (and to check variants at)")
    ns = ap.parse_args()
    names = [n for n in ns.variants.split(",") if n]
    ns.timing_dims = [int(d) for d in ns.timing_dims.split(",") if d]
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    path_state()

    print("\n== correctness (vs float32 SDPA math; batch entry 1 is NaN) ==", flush=True)
    for name in names:
        for dtype in ((torch.float16, torch.bfloat16) if name == "base" else (torch.float16,)):
            for d in flash_hopper.HEAD_DIMS:
                if name not in variants(d) or (name != "base" and d not in ns.timing_dims):
                    continue
                cfg = variants(d)[name]
                for causal in (False, True):
                    for n in ((17, 200, 1024, 4096) if name == "base" else (1024,)):
                        if elapsed() > ns.budget_s * 0.45:
                            print(f"skip {name} {dtype} D={d} N={n}: correctness budget spent", flush=True)
                            continue
                        check_case(dtype, d, causal, n, n, 2, 2, name, cfg)
                # GQA 4:1 and bottom-right causal with Nq != Nk (both directions), one dtype each
                if name == "base" and dtype == torch.float16 and elapsed() <= ns.budget_s * 0.45:
                    check_case(dtype, d, False, 333, 333, 8, 2, name, cfg)
                    check_case(dtype, d, True, 100, 300, 4, 1, name, cfg)
                    check_case(dtype, d, True, 300, 100, 4, 2, name, cfg)
    save()
    bad = [r for r in RESULTS["correctness"] if not r.get("ok")]
    print(f"correctness: {len(RESULTS['correctness']) - len(bad)} ok, {len(bad)} failed  ({elapsed():.0f}s)", flush=True)

    print("\n== timing (do_bench median; TFLOP/s; hidden 2048, 32768 tokens) ==", flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        for d in ns.timing_dims:
            for causal in (False, True):
                for n in (1024, 4096, 16384):
                    if elapsed() > ns.budget_s:
                        print(f"skip timing {dtype} D={d} N={n}: time budget", flush=True)
                        continue
                    try:
                        time_case(dtype, d, causal, n, names if dtype == torch.float16 else ["base"], ns.budget_s)
                    except Exception as exc:  # noqa: BLE001
                        print(f"FAIL timing {dtype} D={d} N={n}: {type(exc).__name__}\n{tail(exc)}", flush=True)
                    save()
    save()
    print(f"\nwrote {OUT / 'probe_hopper.json'} ({elapsed():.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
