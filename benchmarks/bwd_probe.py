"""One-shot H200 probe of flash's backward designs against cuDNN and FlexAttention (issue 21).

    OUT=/some/dir python benchmarks/bwd_probe.py [--budget-s 230] [--designs NAME,...] [--no-flex]
    python benchmarks/bwd_probe.py --dry-run   # the same code path on the CPU (Triton's interpreter),
                                               # two checks per design and one tiny timed shape

Designs (launch configs pinned, no tuning; :data:`DESIGNS`; default: all but atomic-2cta), each a
name for one way to run flash's backward:
  det-*     the deterministic backward: dK/dV kernel + dQ kernel, 7 matmuls per tile pair, no atomics
  atomic-*  the 5-matmul backward: the dK/dV kernel adds dQ's partials into float32 (Hopper: one
            TMA reduce-add per tile; split head dims: element atomics)
1. Correctness, each design on small inputs (B=2, H_kv=2, Nq=272 != Nk=336: multiples of 16 that
   end in partial blocks, so the checked kernels are the timed ones; fp16 and bf16, full, causal,
   GQA 4:1, window + softcap + ALiBi; D = 64, 128, 96, 192):
   dQ, dK, dV against float64 maths on the GPU, within 2 x the error of the same maths in the
   input dtype + atol(dtype) x max(1, max|ref|) (flashrun's judge's rule), with NaN in the
   neighbouring batch entry (its gradients must stay out of entry 0).
2. Timing: the backward alone (torch.autograd.grad of a kept graph, triton.testing.do_bench's
   median), TFLOP/s = 2.5 x 4·B·H·(visible pairs)·D (causal halves the pairs; see
   flashrun/harness/shapes.py), every design, SDPA's cuDNN backend and FlexAttention (compiled
   once per shape, donated buffers off, as flashrun bench prepares it) where --no-flex is not given.
3. Registers: n_regs / n_spills of every backward kernel compiled in this process (Triton's
   cache), with the ptxas facts tests/compile_bwd.py reads (spill instructions inside loops,
   wgmma serialized: C7515).

Results go to $OUT/bwd_probe.json after every case; a table at the end: flash / Flex and
flash / cuDNN per shape for each design. Cases past --budget-s are skipped (printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # compile_bwd.resources

import torch  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels import LaunchConfig as C, tuning  # noqa: E402
from flashrun.kernels.flash import alibi_slopes, attention as flash_attn, bwd as flash_bwd  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEVICE = "cpu" if DRY_RUN else "cuda"
ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # flashrun/harness/judge.py's table
RESULTS: dict = {"env": {}, "correctness": [], "timing": [], "kernels": []}
START = time.perf_counter()

# name -> (deterministic, {head_dim class: pins}); small: D <= 64, large: D <= 128, huge: above (96 is
# large, 192 huge, as in kernels/tuning.py). Registers and programs per SM below are triton 3.6's
# ptxas on the CPU (tests/compile_bwd.py, bf16, D = 128): *-flex are FlexAttention's H100 tiles, one
# 8-warp program per SM; *-2cta fit two 4-warp programs per SM (96-100 KB of shared memory, <= 255
# registers x 128 threads), so one program's softmax overlaps the other's matmuls - except
# atomic-2cta at D = 128, whose dS transpose and dQ staging take it to 136 KB (one per SM).
DEFAULT_DESIGNS = "det-flex,det-2cta,atomic-w8"  # (atomic-2cta on request: compiles are the probe's cost)
DESIGNS = {
    "det-flex": (True, {"small": {"bwd_dkdv": C(64, 128, 8, 3), "bwd_dq": C(128, 64, 8, 3)},
                        "large": {"bwd_dkdv": C(64, 128, 8, 3), "bwd_dq": C(128, 64, 8, 3)},
                        "huge": {"bwd_dkdv": C(64, 64, 8, 2), "bwd_dq": C(64, 64, 8, 2)}}),
    "det-2cta": (True, {"small": {"bwd_dkdv": C(64, 64, 4, 2), "bwd_dq": C(64, 64, 4, 2)},
                        "large": {"bwd_dkdv": C(64, 64, 4, 2), "bwd_dq": C(64, 64, 4, 2)},
                        "huge": {"bwd_dkdv": C(16, 64, 4, 2), "bwd_dq": C(64, 16, 4, 2)}}),
    "atomic-w8": (False, {"small": {"bwd_fused": C(64, 128, 8, 3)}, "large": {"bwd_fused": C(64, 128, 8, 3)},
                          "huge": {"bwd_fused": C(64, 64, 8, 2)}}),
    "atomic-2cta": (False, {"small": {"bwd_fused": C(64, 64, 4, 2)}, "large": {"bwd_fused": C(64, 64, 4, 2)},
                            "huge": {"bwd_fused": C(32, 64, 8, 2)}}),
}


def head_class(d: int) -> str:
    return "small" if d <= 64 else "large" if d <= 128 else "huge"


# (label, dtype, B, H, H_kv, N, D, causal, window, softcap, alibi, time flex?)
def timing_shapes() -> list[tuple]:
    bf16, fp16 = torch.bfloat16, torch.float16
    def plain(d, causal, n, flex):
        return (bf16, 32768 // n, 2048 // d, 2048 // d, n, d, causal, (-1, -1), 0.0, False, flex)

    # most telling first: --budget-s skips from the end (Flex, whose compile is the slow part, only
    # on the comparison shapes)
    rows = [plain(128, True, 8192, True), plain(128, False, 8192, True),
            (bf16, 4, 32, 8, 8192, 128, True, (-1, -1), 0.0, False, True),  # Llama-style GQA 32/8
            (bf16, 2, 16, 16, 16384, 128, False, (4096, 0), 0.0, False, True),  # sliding window 4096
            (bf16, 8, 16, 16, 4096, 128, True, (-1, -1), 50.0, False, True),  # softcap 50
            (bf16, 8, 16, 16, 4096, 128, True, (-1, -1), 0.0, True, True),  # ALiBi
            plain(64, True, 8192, True), plain(64, False, 8192, False),
            (bf16, 8, 2048 // 96, 2048 // 96, 4096, 96, True, (-1, -1), 0.0, False, False),
            (bf16, 8, 2048 // 192, 2048 // 192, 4096, 192, True, (-1, -1), 0.0, False, False),
            *(plain(d, causal, n, False) for n in (4096, 1024) for d in (128, 64) for causal in (True, False)),
            (bf16, 16, 32, 8, 2048, 128, True, (-1, -1), 0.0, False, False),
            (fp16, 4, 16, 16, 8192, 128, True, (-1, -1), 0.0, False, False)]
    return [(label(*r[:10]), *r) for r in rows]


def label(dtype, b, h, h_kv, n, d, causal, window, softcap, alibi) -> str:
    parts = [str(dtype).removeprefix("torch."), f"D{d}", "causal" if causal else "full", f"N{n}", f"B{b}xH{h}"]
    parts += [f"gqa{h}/{h_kv}"] if h != h_kv else []
    parts += [f"window{window[0]}"] if window != (-1, -1) else []
    parts += [f"softcap{softcap:g}"] if softcap else []
    parts += ["alibi"] if alibi else []
    return " ".join(parts)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bwd_probe.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def tail(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join("    " + s for s in text[-lines:])


def elapsed() -> float:
    return time.perf_counter() - START


def pins(design: str, d: int, dtype) -> tuple[bool, dict]:
    """(deterministic, launch): the design's backward configs and the forward's default (the
    forward is not timed; pinning it keeps tuning out of the probe's time)."""
    deterministic, by_class = DESIGNS[design]
    return deterministic, {"fwd": tuning.default("fwd", d, dtype), **by_class[head_class(d)]}


def flash_fn(design: str, d: int, dtype, causal, window, softcap, slopes):
    deterministic, launch = pins(design, d, dtype)
    return lambda q, k, v: flash_attn.flash_attention(q, k, v, causal=causal, launch=launch, window=window,
                                                      softcap=softcap, alibi_slopes=slopes, deterministic=deterministic)


def precompile(cases: list[tuple]) -> None:
    """Compile every backward kernel the probe will run, in parallel (as the tuner precompiles:
    kernels.tuning.launch only compiles while tuning._warming is set), so the checks and timings
    that follow find them in Triton's cache. ``cases``: (design, dtype, B, H, H_kv, Nq, Nk, D,
    causal, window, softcap, alibi)."""
    from concurrent.futures import ThreadPoolExecutor

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None:
        return
    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 8) as pool, mode(pool, ignore_errors=True):
        tuning._warming = True
        try:
            for design, dtype, b, h, h_kv, n_q, n_k, d, causal, window, softcap, alibi in cases:
                q = torch.empty(b, h, n_q, d, device=DEVICE, dtype=dtype)
                k = torch.empty(b, h_kv, n_k, d, device=DEVICE, dtype=dtype)
                lse = torch.empty(b, h, n_q, device=DEVICE)
                slopes = alibi_slopes(h, DEVICE) if alibi else None
                variant = flash_attn._variant(q, b, n_k, causal, window, softcap, slopes)
                deterministic, launch = pins(design, d, dtype)
                flash_attn._attn_backward(q, q, k, k, q, lse, d ** -0.5, variant, launch, deterministic)
        finally:
            tuning._warming = False
    print(f"  {len(cases)} cases' backward kernels compiled in {time.perf_counter() - start:.0f}s", flush=True)


def reference(q, k, v, causal, window, softcap, slopes, dtype=torch.float64):
    """softmax(s) v in ``dtype`` with the kernels' conventions (bottom-right alignment, a window
    side -1 unbounded, ALiBi -slope·|i + Nk - Nq - j|, rows that see no key output 0)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n_q, n_k = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
    cols = torch.arange(n_k, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes.to(dtype)[:, None, None] * (rows - cols).abs()
    left, right = window
    right = 0 if causal else right
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= cols >= rows - left
    if right >= 0:
        keep &= cols <= rows + right
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), do)


CHECK_NQ, CHECK_NK = 272, 336


def check_cases() -> list[tuple]:
    """(dtype, D, causal, window, softcap, alibi, GQA group) of the correctness checks, per design;
    but for two, each compiles what a timed shape compiles too."""
    bf16, fp16 = torch.bfloat16, torch.float16
    return [(bf16, 128, True, (-1, -1), 0.0, False, 4), (bf16, 128, False, (-1, -1), 0.0, False, 1),
            (fp16, 128, True, (-1, -1), 0.0, False, 1), (bf16, 64, True, (-1, -1), 0.0, False, 1),
            (fp16, 64, False, (-1, -1), 0.0, False, 1), (bf16, 128, False, (100, 17), 30.0, True, 1),
            (bf16, 96, True, (-1, -1), 0.0, False, 1), (bf16, 192, True, (-1, -1), 0.0, False, 1)]


def check(design: str, dtype, d: int, causal: bool, window, softcap: float, alibi: bool, group: int) -> None:
    h = 2 * group
    name = f"{design} {label(dtype, 2, h, 2, CHECK_NQ, d, causal, window, softcap, alibi)} Nk{CHECK_NK}"
    gen = torch.Generator(device="cpu").manual_seed(d + 7 * causal)
    q = torch.randn(2, h, CHECK_NQ, d, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(2, 2, CHECK_NK, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
    do = torch.randn(2, h, CHECK_NQ, d, generator=gen).to(DEVICE, dtype)
    slopes = alibi_slopes(h, DEVICE) if alibi else None
    # entry 0 is judged; entry 1 holds NaN everywhere, which must not reach entry 0
    q[1], k[1], v[1], do[1] = float("nan"), float("nan"), float("nan"), float("nan")
    try:
        got = grads(flash_fn(design, d, dtype, causal, window, softcap, slopes), q, k, v, do)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        ref = grads(lambda *t: reference(*t, causal, window, softcap, slopes), q[:1].double(), k[:1].double(),
                    v[:1].double(), do[:1].double())
        low = grads(lambda *t: reference(*t, causal, window, softcap, slopes, torch.float32 if dtype == torch.float32
                                         else dtype), q[:1], k[:1], v[:1], do[:1])
        worst = []
        for which, g, r, lo in zip("qkv", got, ref, low):
            g, r, lo = g[:1].double(), r, lo.double()
            err, torch_err = (g - r).abs().max().item(), (lo - r).abs().max().item()
            bound = 2 * torch_err + ATOL[dtype] * max(1.0, r.abs().max().item())
            worst.append((which, err, bound))
        ok = all(err <= bound for _, err, bound in worst)  # NaN fails
        detail = ", ".join(f"d{w} {e:.2e}/{b:.2e}" for w, e, b in worst)
    except Exception as exc:  # noqa: BLE001 - a design that fails is reported, the probe goes on
        ok, detail = False, f"raised {type(exc).__name__}\n{tail(exc)}"
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    RESULTS["correctness"].append({"design": design, "case": name, "ok": ok, "detail": detail})
    save()


def visible_pairs(n: int, causal: bool, window) -> float:
    """(query, key) pairs per head, as flashrun bench counts them: causal N²/2, a window's allowed pairs."""
    if causal:
        return n * n / 2
    if window != (-1, -1):
        left = window[0]
        return sum(min(i, left) + 1 for i in range(n)) if window[1] == 0 else float(n * n)
    return float(n * n)


def flex_fn(h: int, h_kv: int, n: int, causal: bool, window, softcap: float, slopes):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _flex
    if "_flex" not in globals():
        _flex = torch.compile(flex_attention, dynamic=False)
    left = window[0]

    def mask_mod(b, hh, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        return keep & (kv_idx >= q_idx - left) if left >= 0 else keep

    masked = causal or window != (-1, -1)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=DEVICE) if masked else None

    def score_mod(score, b, hh, q_idx, kv_idx):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[hh] * (q_idx - kv_idx).abs()
        return score

    kwargs = {"enable_gqa": True} if h != h_kv else {}
    mod = score_mod if softcap or slopes is not None else None
    return lambda q, k, v: _flex(q, k, v, score_mod=mod, block_mask=block_mask, **kwargs)


def cudnn_fn(h: int, h_kv: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v, causal):
        if h != h_kv:  # cuDNN's SDPA takes expanded k/v (as flashrun bench gives it)
            k, v = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def time_backward(fn, q, k, v, do) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # compile/tune outside the timing
    if DRY_RUN:  # the interpreter: one call's wall time (do_bench needs CUDA events)
        start = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                   warmup=10, rep=40, return_mode="median")


def time_shape(row: tuple, designs: list[str], with_flex: bool, budget_s: float) -> None:
    name, dtype, b, h, h_kv, n, d, causal, window, softcap, alibi, flex_too = row
    if elapsed() > budget_s:
        print(f"  skipped (budget): {name}", flush=True)
        return
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(b, h, n, d, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, h_kv, n, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    slopes = alibi_slopes(h, DEVICE) if alibi else None
    flop = 2.5 * 4 * b * h * visible_pairs(n, causal, window) * d
    providers = {design: flash_fn(design, d, dtype, causal, window, softcap, slopes) for design in designs}
    if window == (-1, -1) and not softcap and not alibi:
        providers["cudnn"] = lambda q, k, v: cudnn_fn(h, h_kv)(q, k, v, causal)
    if with_flex and flex_too:
        providers["flex"] = flex_fn(h, h_kv, n, causal, window, softcap, slopes)
    entry = {"shape": name, "tflops": {}, "ms": {}}
    for provider, fn in providers.items():
        try:
            ms = time_backward(fn, q, k, v, do)
            entry["ms"][provider], entry["tflops"][provider] = ms, flop / ms / 1e9
        except Exception as exc:  # noqa: BLE001 - e.g. an OOM: the row says so, the probe goes on
            entry["ms"][provider] = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    cells = " ".join(f"{p} {t:.0f}" for p, t in entry["tflops"].items())
    print(f"  {name}: {cells} TFLOP/s ({elapsed():.0f}s)", flush=True)
    RESULTS["timing"].append(entry)
    save()


def kernel_facts() -> None:
    """n_regs / n_spills of every backward kernel this process compiled, with its constexprs."""
    from compile_bwd import ctas_per_sm, resources

    for fn in (flash_bwd._attn_bwd_dkdv, flash_bwd._attn_bwd_dq):
        for cache in getattr(fn, "device_caches", {}).values():
            for ck in cache[0].values():
                try:
                    ck._init_handles()  # n_regs / n_spills come from loading the binary
                    names = ck.src.fn.arg_names
                    const = {names[key[0]]: value for key, value in ck.src.constants.items()}
                    facts = resources(ck.asm["ptx"])
                except Exception as exc:  # noqa: BLE001 - facts are a bonus; a kernel without them is listed
                    const, facts = {}, {"error": f"{type(exc).__name__}: {exc}"}
                row = {"kernel": fn.__name__, "n_regs": getattr(ck, "n_regs", None),
                       "n_spills": getattr(ck, "n_spills", None), "num_warps": ck.metadata.num_warps,
                       "num_stages": ck.metadata.num_stages, "shared": ck.metadata.shared, **facts,
                       **{k: const.get(k) for k in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL", "WINDOW", "SOFTCAP",
                                                    "ALIBI", "GROUP", "ATOMIC_DQ", "DQ_TMA")}}
                RESULTS["kernels"].append(row)
                print(f"  {row['kernel']:15} D{row['HEAD_DIM']} {row['BLOCK_M']}x{row['BLOCK_N']} w{row['num_warps']} "
                      f"s{row['num_stages']} causal={row['CAUSAL']} window={row['WINDOW']} softcap={row['SOFTCAP']} "
                      f"alibi={row['ALIBI']} g{row['GROUP']} atomic={row['ATOMIC_DQ']}: n_regs {row['n_regs']} "
                      f"n_spills {row['n_spills']} smem {row['shared']} "
                      f"({ctas_per_sm(row['n_regs'], row['num_warps'], row['shared']) if row['n_regs'] else '?'}/SM) "
                      f"loop spill ops {facts.get('loop_spill_ops')} serialized {facts.get('serialized')}", flush=True)
    save()


def table(designs: list[str]) -> None:
    print("\nbackward TFLOP/s; flash / Flex and flash / cuDNN per design")
    for entry in RESULTS["timing"]:
        t = entry["tflops"]
        best = max((t[d] for d in designs if d in t), default=0.0)
        cells = []
        for d in designs:
            if d in t:
                vs = [f"{t[d] / t[base]:.2f}x {base}" for base in ("flex", "cudnn") if base in t]
                cells.append(f"{d} {t[d]:.0f} ({', '.join(vs)})")
        refs = " ".join(f"{b} {t[b]:.0f}" for b in ("flex", "cudnn") if b in t)
        print(f"{entry['shape']}\n    {refs} | best flash {best:.0f}\n    " + "\n    ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--designs", default=DEFAULT_DESIGNS, help=f"of {', '.join(DESIGNS)}")
    ap.add_argument("--budget-s", type=float, default=210.0, help="no new timed shape after this many seconds")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="the CPU and Triton's interpreter, a few small cases")
    ns = ap.parse_args()
    designs = ns.designs.split(",")
    RESULTS["env"] = {"gpu": "none (dry run)" if DRY_RUN else torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "python": platform.python_version(),
                      "designs": {d: str(DESIGNS[d]) for d in designs}}
    checks, shapes = check_cases(), timing_shapes()
    if DRY_RUN:  # the plumbing, not the numbers: two checks per design, one small timed shape, no peers
        checks, ns.no_flex, ns.budget_s = [checks[4], checks[5]], True, float("inf")
        shapes = [(label(torch.float16, 1, 4, 2, 256, 64, True, (-1, -1), 0.0, False), torch.float16, 1, 4, 2, 256, 64,
                   True, (-1, -1), 0.0, False, False)]
    print(f"{RESULTS['env']}", flush=True)
    if not ns.no_flex:
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):  # one compiled FlexAttention per shape
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False  # the timing re-runs one backward graph
    print("0. compiling every backward kernel the probe runs, in parallel", flush=True)
    if not DRY_RUN:
        precompile([(design, dtype, 2, 2 * group, 2, CHECK_NQ, CHECK_NK, d, causal, window, softcap, alibi)
                    for design in designs for dtype, d, causal, window, softcap, alibi, group in checks]
                   + [(design, dtype, b, h, h_kv, n, n, d, causal, window, softcap, alibi)
                      for design in designs for _, dtype, b, h, h_kv, n, d, causal, window, softcap, alibi, _ in shapes])
    print(f"1. correctness (dQ, dK, dV vs float64, Nq {CHECK_NQ} != Nk {CHECK_NK}; NaN in the neighbouring batch "
          "entry)", flush=True)
    for design in designs:
        for case in checks:
            check(design, *case)
    failed = [c for c in RESULTS["correctness"] if not c["ok"]]
    bad = {c["design"] for c in failed}
    timed = [d for d in designs if d not in bad]
    print(f"2. backward timing ({', '.join(timed)}; wrong designs are not timed: {sorted(bad) or 'none'})", flush=True)
    for row in shapes:
        time_shape(row, timed, not ns.no_flex, ns.budget_s)
    print("3. compiled backward kernels", flush=True)
    kernel_facts()
    table(timed)
    print(f"\n{len(failed)} correctness failures; {elapsed():.0f}s; results in {OUT / 'bwd_probe.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
