"""One-shot H200 probe of the Gluon sm_90 backward (flashrun/kernels/flash/hopper_bwd_jit.py, NOTES
v8-v10): is it right, and is the backward faster with it? For deciding hopper_bwd.DEFAULT_ON,
DEFAULT and FUSED. A kernel name with the suffix ``+dq`` (``d128-dqs+dq``) is that kernel with
dQ inside (the atomic backward's): its dQ is checked too, and it is timed through
``flash_attention(deterministic=False)``.

    OUT=DIR timeout 470 python benchmarks/probes/gluon_bwd_probe.py [--budget-s 400] [--kernels d128,d64]
                                                             [--workers 14] [--no-timing]
    python benchmarks/probes/gluon_bwd_probe.py --dry-run   # the plumbing on a CPU (see below)

0. Compile ahead: --workers spawned processes launch, on small inputs, every Gluon binary the
   checks and timings below run ((kernel, dtype, causal, GQA group per program, split): one
   binary each), and each timed shape's backward on both paths (portable: the shipped table or
   heuristic configs; Gluon: the product path, whose first-use check compiles its own), so this
   process finds them in Triton's on-disk cache.
1. Correctness of every kernel in hopper_bwd.KERNELS (or --kernels), called directly with dK/dV
   poisoned (NaN) so that an element it never writes shows: fp16 and bf16, causal and not,
   N = 1, 17, 97, 1025, 4096 (GQA 1:1), GQA 4:1 with the group folded in one program (split 1)
   and spread over 2 and 4 programs, qwen2-like 6:1 over 6, Nq != Nk both ways (bottom-right
   causal, rows that see no key), and the (group, split) each timed GQA shape will run. B = 2 with
   batch entry 1 all NaN (q, k, v, dO): entry 0 must not see it. LSE from the portable forward,
   delta = rowsum(dO ∘ O). Judged on entry 0 against float64 autograd on the GPU with flashrun's
   rule: max|err| <= 2 x (the same maths in the input dtype's error) + atol(dtype) x max(1, max|ref|);
   the portable deterministic backward's dK/dV is judged the same way and printed beside it, with
   max|Gluon − portable|. A kernel with any failed case is not timed.
2. Timing, bf16: the backward alone (torch.autograd.grad of a kept graph; do_bench medians) of
   flash's deterministic backward with the Gluon dK/dV (on by default since v9; each kernel through
   hopper_bwd.OVERRIDE, its first-use check included once, untimed) against the portable one and
   cuDNN's SDPA backward: D = 64 and 128, causal and full, N = 1024, 2048 and 8192 (hidden 2048, 32768
   tokens), llama-1b's B4 H32/8 N2048 D64 and qwen2-1b's B4 H12/2 N2048 D128 (causal). TFLOP/s =
   2.5 x 4·B·H·pairs·D. Before a Gluon provider is timed at a shape its dK/dV must match the portable
   path's there and the path must really have been taken (else: "not timed").
3. Kernel breakdown of the D = 128 and 64 causal N = 8192 backwards (torch.profiler, 3 calls per
   path): each kernel's GPU time, and for the dK/dV kernels TFLOP/s of matmul work (4 matmuls,
   8·B·H·pairs·D) - the number NOTES v8 predicted (520-620 for the Gluon one, 473 measured for the
   Triton one in v7).
4. A table: TFLOP/s and gluon/portable, gluon/cuDNN, portable/cuDNN per shape.

Results: $OUT/gluon_bwd_probe.json (rewritten after every section) and $OUT/gluon_bwd_probe.log (the
printed lines). No new case or shape starts after --budget-s; skipped ones say so.

--dry-run: on the CPU with Triton's interpreter, a few small cases and one tiny timed shape. Gluon
kernels cannot run there, so the portable dK/dV stands in for the Gluon kernel (printed as such) and
the gate is pretended on: it checks the probe's plumbing (cases, judge, path switching, table,
files), not the kernel.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels.flash import attention as flash, hopper as flash_hopper, hopper_bwd  # noqa: E402

os.environ.setdefault("FLASHRUN_FIRST_USE", "wait")  # a Gluon path's first use checks before the call, as commands do

OUT = Path(os.environ.get("OUT", "."))
DEVICE = "cpu" if DRY_RUN else "cuda"
ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # flashrun/harness/judge.py's table (as bwd_probe.py)
RESULTS: dict = {"env": {}, "compile": {}, "correctness": [], "timing": [], "breakdown": []}
LOG: list[str] = []
START = time.perf_counter()
F16, BF16 = torch.float16, torch.bfloat16


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def elapsed() -> float:
    return time.perf_counter() - START


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gluon_bwd_probe.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (OUT / "gluon_bwd_probe.log").write_text("\n".join(LOG) + "\n")


def tail(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join("    " + s for s in text[-lines:])


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


FUSED = "+dq"  # a kernel name with this suffix: that kernel with dQ inside (the non-deterministic backward)


def fused(name: str | None) -> bool:
    return bool(name) and name.endswith(FUSED)


def config(name: str) -> hopper_bwd.BwdConfig:
    return hopper_bwd.KERNELS[name.removesuffix(FUSED)]


def kernels(names: list[str], head_dim: int | None = None) -> dict[str, hopper_bwd.BwdConfig]:
    return {n: config(n) for n in names if head_dim is None or config(n).head_dim == head_dim}


# -- the kernel, the portable path, the reference ------------------------------------------------
# A case's mask: False (full), True (causal) or a window (left, right), query i seeing keys
# [i + shift - left, i + shift + right] (shift = Nk - Nq; sides given as numbers, not -1)


def variant(mask) -> flash.Variant:
    return flash.Variant(window=mask) if isinstance(mask, tuple) else flash.Variant(causal=mask)


def mask_label(mask) -> str:
    return f"w{mask[0]},{mask[1]}" if isinstance(mask, tuple) else "causal" if mask else "full  "


def gluon_dkdv(q, k, v, do, lse, delta, sm_scale, mask, cfg, split=1, dq=None):
    """The Gluon kernel itself, as hopper_bwd launches it, with dK/dV poisoned (NaN) first; ``dq``
    (a zeroed float32 buffer): with dQ inside, added there."""
    z, h_kv, n_k, d = k.shape
    out_dtype = k.dtype if split == 1 else torch.float32
    dk = torch.full((z, h_kv * split, n_k, d), float("nan"), dtype=out_dtype, device=k.device)
    dv = torch.full_like(dk, float("nan"))
    window = mask if isinstance(mask, tuple) else None
    grid, args, constexprs, options = hopper_bwd.launch_args(q, k, v, do, lse, delta, dk, dv, sm_scale,
                                                             window is None and mask, cfg, split, dq, window)
    cfg.kernel[grid](*args, **constexprs, **options)
    if split > 1:
        dk = dk.view(z, h_kv, split, n_k, d).sum(2).to(k.dtype)
        dv = dv.view(z, h_kv, split, n_k, d).sum(2).to(k.dtype)
    return dk, dv


def standin_dkdv(q, k, v, do, lse, delta, sm_scale, mask, cfg, split=1, dq=None):
    """--dry-run only: the portable backward standing in for the Gluon kernel (which needs sm_90)."""
    o, lse, _ = forward(q, k, v, do, sm_scale, mask)
    dk, dv, dq_p = portable_grads(q, k, v, do, o, lse, sm_scale, mask)
    if dq is not None:
        dq += dq_p.float()
    return dk, dv


def standin_run(q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None, window=None, kv_out=None):
    """--dry-run only: :func:`standin_dkdv` as the product path calls its kernel (hopper_bwd.RUN),
    leaving hopper_bwd.LAST_PATH as the path set it (the stand-in runs the portable backward)."""
    path = hopper_bwd.LAST_PATH
    dk, dv = standin_dkdv(q, k, v, do, lse, delta, sm_scale, causal if window is None else window, cfg, split, dq)
    hopper_bwd.LAST_PATH = path
    if kv_out is None:
        return dk, dv
    for out, grad in zip(kv_out, (dk, dv)):
        out += grad.float()
    return kv_out


RUN = standin_dkdv if DRY_RUN else gluon_dkdv


def forward(q, k, v, do, sm_scale, mask):
    """(o, lse, delta) from the portable forward (fixed config), delta = rowsum(dO ∘ O) in float32."""
    o, lse = flash._attn_forward(q, k, v, sm_scale, variant(mask), "default", try_gluon=False)
    return o, lse, (o.float() * do.float()).sum(-1)


def portable_grads(q, k, v, do, o, lse, sm_scale, mask):
    """(dK, dV, dQ) of the portable deterministic backward."""
    dq, dk, dv = flash._attn_backward(do, q, k, v, o, lse, sm_scale, variant(mask), "default",
                                      deterministic=True, try_gluon=False)
    return dk, dv, dq


def reference_dkdv(q, k, v, do, sm_scale, mask, dtype=torch.float64):
    """dK, dV, dQ of softmax(q kᵀ · scale) v by autograd in ``dtype`` (GQA by repeating k/v heads,
    bottom-right causal or window, a row that sees no key outputs 0)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * sm_scale
    if mask is not False:
        n_q, n_k = q.shape[2], k.shape[2]
        # key j - query i's diagonal key (i + shift)
        offset = torch.arange(n_k, device=q.device)[None, :] - (torch.arange(n_q, device=q.device)[:, None] + n_k - n_q)
        left, right = mask if isinstance(mask, tuple) else (n_k, 0)
        s = s.masked_fill((offset < -left) | (offset > right), float("-inf"))
    p = torch.softmax(s.float() if dtype != torch.float64 else s, -1).nan_to_num(0.0).to(dtype)
    out = p @ v.repeat_interleave(group, 1)
    return torch.autograd.grad(out, (k, v, q), do.to(dtype))


# -- 0. compile ahead ----------------------------------------------------------------------------


def _warm(job: tuple) -> tuple[tuple, str | None, float]:
    """Run one job's launches on small inputs (in a spawned worker): fills Triton's on-disk cache."""
    start = time.perf_counter()
    os.environ["FLASHRUN_COMPILE_PROCESSES"] = "0"  # this worker compiles in its own threads, no processes of its own
    try:
        kind, name, dtype, d, mask, group, split, n = job
        dtype = getattr(torch, dtype)
        if kind == "gluon":  # lengths and strides are not specialized on: one launch per binary
            h = 2 * group * split  # ``group``: query heads per program
            q, do = (torch.randn(1, h, 130, d, device=DEVICE, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(1, 2, 130, d, device=DEVICE, dtype=dtype) for _ in range(2))
            lse, delta = torch.zeros(1, h, 130, device=DEVICE), torch.zeros(1, h, 130, device=DEVICE)
            gluon_dkdv(q, k, v, do, lse, delta, d ** -0.5, mask, config(name), split,
                       torch.zeros(q.shape, device=DEVICE) if fused(name) else None)
        elif kind == "check":  # the correctness cases' portable forward and backward (fixed configs)
            n_q, n_k = n
            q, do = (torch.randn(2, 2 * group, n_q, d, device=DEVICE, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(2, 2, n_k, d, device=DEVICE, dtype=dtype) for _ in range(2))
            o, lse, _ = forward(q, k, v, do, d ** -0.5, mask)
            portable_grads(q, k, v, do, o, lse, d ** -0.5, mask)
        else:  # "path": a timed shape's backward (B = 1, its heads and length), portable or with a Gluon kernel
            causal, (h, h_kv, n_) = mask, n
            use_path(name)
            q = torch.randn(1, h, n_, d, device=DEVICE, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(1, h_kv, n_, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
            out = flash.flash_attention(q, k, v, causal=causal, deterministic=not fused(name))
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()
        return job, None, time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001
        return job, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300], \
            time.perf_counter() - start


def compile_ahead(jobs: set, workers: int) -> None:
    say(f"== 0. compile ahead: {len(jobs)} launches on {workers} processes ==")
    if DRY_RUN:
        say("(dry run: nothing compiled ahead; the interpreter compiles nothing)")
        RESULTS["compile"] = {str(j): "dry run" for j in sorted(jobs, key=str)}
        return
    with mp.get_context("spawn").Pool(workers) as pool:
        for job, error, seconds in pool.imap_unordered(_warm, sorted(jobs, key=str)):
            RESULTS["compile"][str(job)] = {"error": error, "s": round(seconds, 1)}
            if error:
                say(f"FAIL compile {job}: {error}")
    slowest = max((r["s"] for r in RESULTS["compile"].values()), default=0)
    say(f"compiled in {elapsed():.0f}s (slowest job {slowest:.0f}s)")
    save()


# -- 1. correctness ------------------------------------------------------------------------------


def check_cases(extra: list[tuple]) -> list[tuple]:
    """(dtype, mask, Nq, Nk, H, H_kv, split) per kernel; ``extra``: the timed GQA shapes' own."""
    if DRY_RUN:
        cases = [(F16, False, 1, 1, 2, 2, 1), (BF16, True, 17, 17, 2, 2, 1), (F16, True, 33, 33, 8, 2, 2),
                 (F16, False, 33, 33, 8, 2, 1), (BF16, True, 20, 36, 4, 2, 1), (F16, True, 36, 20, 4, 2, 2),
                 (F16, (7, 2), 33, 33, 8, 2, 2), (BF16, (5, 0), 20, 36, 4, 2, 1)]
        return cases + [c for c in extra if c not in cases]
    cases = [(dtype, causal, n, n, 2, 2, 1) for dtype in (F16, BF16) for causal in (False, True)
             for n in (1, 17, 97, 1025, 4096)]
    cases += [(F16, causal, 333, 333, 8, 2, split) for causal in (False, True) for split in (1, 4)]
    cases += [(BF16, True, 1025, 1025, 8, 2, 2), (BF16, True, 333, 333, 12, 2, 6),
              (BF16, True, 100, 300, 8, 2, 2), (BF16, True, 300, 100, 8, 2, 2),
              (F16, False, 97, 1025, 2, 2, 1), (F16, True, 1025, 17, 2, 2, 1)]
    # windows: sliding (causal side), two-sided, (0, 0), wider than the keys, Nq != Nk both ways
    # (rows that see no key), N = 1, GQA split
    cases += [(BF16, (100, 0), 1025, 1025, 2, 2, 1), (F16, (37, 5), 333, 333, 8, 2, 4), (BF16, (0, 0), 97, 97, 2, 2, 1),
              (BF16, (256, 0), 4096, 4096, 8, 2, 2), (F16, (64, 64), 300, 100, 8, 2, 2), (BF16, (37, 5), 100, 300, 8, 2, 1),
              (F16, (500, 3), 1025, 17, 2, 2, 1), (F16, (3, 0), 1, 1, 2, 2, 1), (BF16, (2000, 700), 1025, 1025, 2, 2, 1)]
    return cases + [c for c in extra if c not in cases]


def judge(got, ref, low, dtype) -> tuple[float, float]:
    """(max|got - ref|, bound) on float64; NaN anywhere gives inf."""
    got, ref, low = got.double(), ref.double(), low.double()
    err = (got - ref).abs().max().item() if torch.isfinite(got).all() else float("inf")
    bound = 2 * (low - ref).abs().max().item() + ATOL[dtype] * max(1.0, ref.abs().max().item())
    return err, bound


def check_case(name, cfg, dtype, mask, n_q, n_k, h, h_kv, split) -> dict:
    d = cfg.head_dim
    label = (f"{name:8s} {short(dtype):8s} D{d} {mask_label(mask)} Nq{n_q} Nk{n_k} "
             f"H{h}/{h_kv} split{split}")
    rec = {"kernel": name, "config": asdict(cfg), "dtype": short(dtype), "mask": mask, "n_q": n_q, "n_k": n_k,
           "h": h, "h_kv": h_kv, "split": split}
    try:
        gen = torch.Generator(device="cpu").manual_seed(n_q * 131 + n_k * 7 + h + split)
        q, do = (torch.randn(2, h, n_q, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
        k, v = (torch.randn(2, h_kv, n_k, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
        for t in (q, k, v, do):  # batch entry 1 all NaN: entry 0 must not see it
            t[1] = float("nan")
        scale = d ** -0.5
        o, lse, delta = forward(q, k, v, do, scale, mask)
        dq = torch.zeros(q.shape, device=DEVICE) if fused(name) else None
        dk, dv = RUN(q, k, v, do, lse, delta, scale, mask, cfg, split, dq)
        dk_p, dv_p, dq_p = portable_grads(q, k, v, do, o, lse, scale, mask)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        first = [t[:1] for t in (q, k, v, do)]
        ref = reference_dkdv(*first, scale, mask)
        low = reference_dkdv(*first, scale, mask, dtype)
        errs = {}
        grads = [("dK", dk, dk_p, ref[0], low[0]), ("dV", dv, dv_p, ref[1], low[1])]
        if dq is not None:
            grads.append(("dQ", dq.to(dtype), dq_p, ref[2], low[2]))
        for which, got, port, r, lo in grads:
            err, bound = judge(got[:1], r, lo, dtype)
            err_p, _ = judge(port[:1], r, lo, dtype)
            diff = (got[:1].double() - port[:1].double()).abs().max().item()
            errs[which] = {"err": err, "bound": bound, "portable_err": err_p, "vs_portable": diff}
        ok = all(e["err"] <= e["bound"] for e in errs.values())  # inf (NaN) fails
        rec.update(ok=ok, errors=errs)
        say(f"{'PASS' if ok else 'FAIL'} {label}  " + "  ".join(
            f"{w} {e['err']:.2e}/{e['bound']:.2e} (portable {e['portable_err']:.2e}, |gluon-portable| "
            f"{e['vs_portable']:.2e})" for w, e in errs.items()))
    except Exception as exc:  # noqa: BLE001 - one case never ends the probe
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        say(f"FAIL {label}  raised {type(exc).__name__}\n{tail(exc)}")
    return rec


def correctness(names: list[str], cases: list[tuple], budget_s: float) -> set[str]:
    """Check every kernel on every case; the names of the kernels that failed or skipped one."""
    standin = " [DRY RUN: the portable dK/dV stands in for the Gluon kernel]" if DRY_RUN else ""
    say(f"\n== 1. correctness: dK, dV (and dQ, +dq kernels) vs float64 on batch entry 0 (entry 1 is NaN){standin} ==")
    failed = set()
    for name, cfg in kernels(names).items():
        for case in cases:
            if elapsed() > budget_s:  # an unchecked kernel is not timed either
                say(f"skip {name} {short(case[0])} {mask_label(case[1])} {case[2:]}: correctness budget spent")
                RESULTS["correctness"].append({"kernel": name, "skipped": str(case)})
                failed.add(name)
                continue
            rec = check_case(name, cfg, *case)
            RESULTS["correctness"].append(rec)
            if not rec.get("ok"):
                failed.add(name)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        save()
    done = [r for r in RESULTS["correctness"] if "skipped" not in r]
    passed = sum(bool(r.get("ok")) for r in done)
    say(f"correctness: {passed} passed, {len(done) - passed} failed, {len(RESULTS['correctness']) - len(done)} "
        f"skipped ({elapsed():.0f}s); not timed (a case failed or was skipped): {sorted(failed) or 'none'}")
    return failed


# -- 2. timing -----------------------------------------------------------------------------------


def timed_shapes() -> list[tuple]:
    """(label, B, H, H_kv, N, D, causal), bf16; the most telling first (--budget-s skips from the end)."""
    if DRY_RUN:
        return [("D64 causal N64 B1xH4 gqa4/2", 1, 4, 2, 64, 64, True)]

    def plain(d, causal, n):
        return (f"D{d} {'causal' if causal else 'full'} N{n} B{32768 // n}xH{2048 // d}", 32768 // n, 2048 // d,
                2048 // d, n, d, causal)

    return [plain(128, True, 1024), plain(128, False, 1024), plain(64, True, 1024), plain(64, False, 1024),
            plain(128, True, 8192), plain(64, True, 8192),
            ("llama-1b D64 causal N2048 B4xH32 gqa32/8", 4, 32, 8, 2048, 64, True),
            ("qwen2-1b D128 causal N2048 B4xH12 gqa12/2", 4, 12, 2, 2048, 128, True),
            plain(128, False, 8192), plain(64, False, 8192), plain(128, True, 2048), plain(64, True, 2048),
            plain(128, False, 2048), plain(64, False, 2048),
            plain(96, True, 4096), plain(96, False, 4096), plain(80, True, 4096)]


def shape_of(spec: str) -> tuple:
    """--shape D,MASK,N,B,H,H_KV as a timed_shapes() row, its label with Q and dO's size."""
    d, mask, n, b, h, h_kv = spec.split(",")
    d, n, b, h, h_kv = int(d), int(n), int(b), int(h), int(h_kv)
    gqa = f" gqa{h}/{h_kv}" if h != h_kv else ""
    return (f"D{d} {mask} N{n} B{b}xH{h}{gqa} ({4 * b * h * n * d / 2**20:.0f} MiB Q+dO)", b, h, h_kv, n, d,
            mask == "causal")


def timed_split(b, h, h_kv, n, d) -> int:
    """The GQA split the product path's deterministic backward will use for this shape on this GPU
    (hopper_bwd.dkdv's rule)."""
    programs = hopper_bwd.cdiv(n, 128) * b * h_kv
    return flash._kv_split(programs, h // h_kv, torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu"),
                           hopper_bwd.SPLIT_WAVES)


def use_path(name: str | None) -> None:
    """The backward's dK/dV path for what follows: None the portable kernel, else that Gluon
    kernel through the product path (its first-use check runs on its first use)."""
    if name is None:
        os.environ[hopper_bwd.ENV] = "0"
        hopper_bwd.OVERRIDE = None
        return
    os.environ[hopper_bwd.ENV] = "1"
    if hopper_bwd.OVERRIDE != config(name):
        hopper_bwd.OVERRIDE = config(name)
        hopper_bwd.reset()  # each kernel gets its own first-use check


def flops(b, h, n, d, causal) -> float:
    return 2.5 * 4 * b * h * (n * n / 2 if causal else n * n) * d


def cudnn_fn(h: int, h_kv: int, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        if h != h_kv:  # cuDNN's SDPA takes expanded k/v (as flashrun bench and bwd_probe.py give it)
            k, v = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def graph(fn, q, k, v):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return fn(q, k, v), (q, k, v)


def run_backward(out, leaves, do):
    return torch.autograd.grad(out, leaves, do, retain_graph=True)


def bench(out, leaves, do) -> float:
    if DRY_RUN:  # the interpreter: one call's wall time (do_bench needs CUDA events)
        start = time.perf_counter()
        run_backward(out, leaves, do)
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(lambda: run_backward(out, leaves, do), warmup=10, rep=50, return_mode="median")


def time_shape(row: tuple, names: list[str], with_cudnn: bool, budget_s: float) -> None:
    label, b, h, h_kv, n, d, causal = row
    if elapsed() > budget_s:
        say(f"  skipped (budget): {label}")
        RESULTS["timing"].append({"shape": label, "skipped": "budget"})
        return
    dtype = BF16
    gen = torch.Generator(device=DEVICE).manual_seed(n + d)
    q = torch.randn(b, h, n, d, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, h_kv, n, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    work = flops(b, h, n, d, causal)
    entry = {"shape": label, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "causal": causal,
             "split": timed_split(b, h, h_kv, n, d), "ms": {}, "tflops": {}, "notes": {}}

    def flash_fn(q, k, v):
        return flash.flash_attention(q, k, v, causal=causal, deterministic=True)

    def fused_fn(q, k, v):
        return flash.flash_attention(q, k, v, causal=causal, deterministic=False)

    use_path(None)
    out, leaves = graph(flash_fn, q, k, v)
    portable = run_backward(out, leaves, do)  # compiles (if not ahead) outside the timing
    if hopper_bwd.LAST_PATH != flash_hopper.TRITON_PATH:
        raise RuntimeError(f"the portable run took the {hopper_bwd.LAST_PATH} path")
    entry["ms"]["portable"] = bench(out, leaves, do)
    del out, leaves
    for name in kernels(names, d):
        if elapsed() > budget_s:
            entry["notes"][name] = "skipped: budget"
            continue
        try:
            use_path(name)
            t0 = time.perf_counter()
            out, leaves = graph(fused_fn if fused(name) else flash_fn, q, k, v)
            got = run_backward(out, leaves, do)  # the first-use check runs here, once per kernel and dtype
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            if hopper_bwd.LAST_PATH != (hopper_bwd.FUSED_PATH if fused(name) else flash_hopper.GLUON_PATH):
                reason = hopper_bwd._checked.get((dtype, d, fused(name))) or hopper_bwd.eligible(
                    q, k, v, do, flash._variant(q, b, n, causal, (-1, -1), 0.0, None), fused(name))
                entry["notes"][name] = f"not timed: the path was not taken ({reason})"
                say(f"  {label} {name}: not timed, the path was not taken ({reason})")
                continue
            diffs = [((g - p).abs().max().item() if torch.isfinite(g).all() else float("inf"),
                      4 * ATOL[dtype] * max(1.0, p.abs().max().item())) for g, p in zip(got, portable)]
            if not all(diff <= bound for diff, bound in diffs):
                entry["notes"][name] = f"not timed: dQ/dK/dV differ from the portable path's here ({diffs})"
                say(f"  {label} {name}: not timed, dQ/dK/dV differ from the portable path's: {diffs}")
                continue
            entry["ms"][name] = bench(out, leaves, do)
            entry["notes"][name] = f"first call (with the first-use check if it ran) {first_s:.1f}s"
            del out, leaves, got
        except Exception as exc:  # noqa: BLE001 - e.g. an OOM: the row says so, the probe goes on
            entry["notes"][name] = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
            say(f"  {label} {name}: raised {type(exc).__name__}\n{tail(exc, 4)}")
        finally:
            use_path(None)
    if with_cudnn:
        try:
            out, leaves = graph(cudnn_fn(h, h_kv, causal), q, k, v)
            run_backward(out, leaves, do)
            entry["ms"]["cudnn"] = bench(out, leaves, do)
            del out, leaves
        except Exception as exc:  # noqa: BLE001
            entry["notes"]["cudnn"] = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    entry["tflops"] = {p: work / ms / 1e9 for p, ms in entry["ms"].items()}
    say(f"  {label} (split {entry['split']}): " + "  ".join(f"{p} {t:.0f}" for p, t in entry["tflops"].items())
        + f" TFLOP/s ({elapsed():.0f}s)")
    RESULTS["timing"].append(entry)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    save()


# -- 3. kernel breakdown -------------------------------------------------------------------------


def breakdown(row: tuple, names: list[str], budget_s: float) -> None:
    """GPU time per kernel of 3 backward calls per path (torch.profiler), and the dK/dV kernels'
    TFLOP/s of matmul work (4 matmuls: 8·B·H·pairs·D)."""
    from torch.profiler import ProfilerActivity, profile

    label, b, h, h_kv, n, d, causal = row
    if elapsed() > budget_s or DRY_RUN:
        say(f"  skipped ({'dry run' if DRY_RUN else 'budget'}): breakdown of {label}")
        return
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(b, h, n, d, device=DEVICE, dtype=BF16, generator=gen)
    k, v = (torch.randn(b, h_kv, n, d, device=DEVICE, dtype=BF16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    dkdv_work = 8 * b * h * (n * n / 2 if causal else n * n) * d
    timed = {r["shape"]: r for r in RESULTS["timing"] if "ms" in r}.get(label, {}).get("ms", {})
    for name in [None] + [n_ for n_ in kernels(names, d) if n_ in timed]:  # Gluon ones that were timed (so right)
        try:
            use_path(name)
            out, leaves = graph(lambda q, k, v: flash.flash_attention(q, k, v, causal=causal,
                                                                      deterministic=not fused(name)), q, k, v)
            run_backward(out, leaves, do)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run_backward(out, leaves, do)
                torch.cuda.synchronize()
            rows = []
            for evt in prof.key_averages():  # kernels (and copies) only: the ops' own device time
                us = getattr(evt, "self_device_time_total", None)
                us = getattr(evt, "self_cuda_time_total", 0) if us is None else us
                if us > 0:
                    rows.append((evt.key, us / 3))
            rows.sort(key=lambda r: -r[1])
            rec = {"shape": label, "path": name or "portable", "kernels_us": dict(rows)}
            say(f"  {label} [{name or 'portable'}]: " + ", ".join(f"{k_[:40]} {us:.0f} us" for k_, us in rows[:6]))
            for key, us in rows:
                if "dkdv" in key:  # with dQ inside: 5 matmuls
                    work = dkdv_work * (5 / 4 if fused(name) else 1)
                    rec["dkdv_tflops_of_work"] = work / us / 1e6
                    say(f"      {key}: {work / us / 1e6:.0f} TFLOP/s of matmul work "
                        f"({5 if fused(name) else 4} matmuls)")
            RESULTS["breakdown"].append(rec)
            del out, leaves
        except Exception as exc:  # noqa: BLE001 - the profile is a bonus
            say(f"  breakdown {label} [{name or 'portable'}] raised {type(exc).__name__}\n{tail(exc, 4)}")
        finally:
            use_path(None)
    save()


# -- 4. table ------------------------------------------------------------------------------------


def table(names: list[str]) -> None:
    say("\n== backward TFLOP/s (bf16) and ratios ==")
    for r in RESULTS["timing"]:
        if "tflops" not in r:
            say(f"{r['shape']}: skipped")
            continue
        t = r["tflops"]
        port, cud = t.get("portable"), t.get("cudnn")
        cells = [f"portable {port:.0f}" if port else "portable -"] + ([f"cudnn {cud:.0f}"] if cud else [])
        if port and cud:
            cells.append(f"portable/cudnn {port / cud:.2f}")
        for name in names:
            if name in t:
                cells.append(f"{name} {t[name]:.0f} (/portable {t[name] / port:.2f}"
                             + (f", /cudnn {t[name] / cud:.2f})" if cud else ")"))
            elif name in r["notes"]:
                cells.append(f"{name}: {r['notes'][name][:80]}")
        say(f"{r['shape']}: " + " | ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default=",".join(list(hopper_bwd.KERNELS) + [
        n + FUSED for n, c in hopper_bwd.KERNELS.items() if hopper_bwd.fusable(c)]),
        help=f"hopper_bwd.KERNELS names; NAME{FUSED}: that kernel with dQ inside")
    ap.add_argument("--budget-s", type=float, default=400.0, help="no new case or shape after this many seconds")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--no-timing", action="store_true", help="correctness only")
    ap.add_argument("--no-checks", action="store_true",
                    help="timing only (each timed Gluon path is still compared with the portable one first)")
    ap.add_argument("--only", default="", help="time only the shapes whose label holds one of these (comma list)")
    ap.add_argument("--shape", action="append", default=[], metavar="D,MASK,N,B,H,H_KV",
                    help="time this shape instead (MASK causal or full; repeatable)")
    ap.add_argument("--split-waves", default="",
                    help="time each shape once per GQA split threshold, both paths' (attention.SPLIT_WAVES, "
                         "hopper_bwd.SPLIT_WAVES; comma list; 0: never split)")
    ap.add_argument("--breakdown", type=int, default=2, help="profile the first this many timed shapes")
    ap.add_argument("--dry-run", action="store_true", help="the CPU and Triton's interpreter (see the docstring)")
    ns = ap.parse_args()
    names = [n for n in ns.kernels.split(",") if n]
    unknown = [n for n in names if n.removesuffix(FUSED) not in hopper_bwd.KERNELS
               or fused(n) and not hopper_bwd.fusable(config(n))]
    if unknown:
        print(f"unknown kernels {unknown}; known: {', '.join(hopper_bwd.KERNELS)}")
        return 2
    if not DRY_RUN and not torch.cuda.is_available():
        print("no GPU (use --dry-run for the plumbing)")
        return 2
    if DRY_RUN:  # as on an H200 with FLASHRUN_HOPPER_BWD=1: the real switch, then every call in scope
        hopper_bwd.eligible = lambda q, k, v, do, variant, fused=False: (
            None if hopper_bwd.enabled() else "off") or hopper_bwd._checked.get((q.dtype, q.shape[-1], fused))
        hopper_bwd.RUN = standin_run
        hopper_bwd.CHECK_SHAPE = (1, 4, 2, 24, 20)
    RESULTS["env"] = {"gpu": "none (dry run)" if DRY_RUN else torch.cuda.get_device_name(),
                      "sms": None if DRY_RUN else torch.cuda.get_device_properties(0).multi_processor_count,
                      "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                      "gluon_api": flash_hopper.gluon_api() or "ok", "kernels": {n: asdict(config(n))
                                                                               for n in names}}
    say(f"env: {RESULTS['env']}")
    if not DRY_RUN and flash_hopper.gluon_api():
        say(f"this Triton lacks the Gluon Hopper API: {flash_hopper.gluon_api()}")
        save()
        return 3

    shapes = [] if ns.no_timing else [shape_of(spec) for spec in ns.shape] or timed_shapes()
    if ns.only:
        shapes = [row for row in shapes if any(part in row[0] for part in ns.only.split(","))]
    waves = [int(w) for w in ns.split_waves.split(",") if w] or [None]
    # each timed GQA shape's (group, split), checked first at a small length
    n_extra = 33 if DRY_RUN else 333
    extra = [(BF16, causal, n_extra, n_extra, 2 * (h // h_kv), 2, timed_split(b, h, h_kv, n, d))
             for _, b, h, h_kv, n, d, causal in shapes if h != h_kv]
    cases = [] if ns.no_checks else check_cases(extra)
    jobs = set()
    _, check_h, check_h_kv, check_nq, check_nk = hopper_bwd.CHECK_SHAPE
    check_group = check_h // check_h_kv
    for name, cfg in kernels(names).items():
        for dtype, mask, _, _, h, h_kv, split in cases:
            jobs.add(("gluon", name, short(dtype), cfg.head_dim, mask, h // h_kv // split, split, 0))
        for dtype in (F16, BF16):  # the product path's first-use check: full unsplit, causal split 2
            jobs.add(("gluon", name, short(dtype), cfg.head_dim, False, check_group, 1, 0))
            jobs.add(("gluon", name, short(dtype), cfg.head_dim, True, check_group // 2, 2, 0))

    def length_class(n: int) -> int:  # Triton specializes integers on == 1 and divisibility by 16
        return 1 if n == 1 else 256 if n % 16 == 0 else 129

    for d in sorted({cfg.head_dim for cfg in kernels(names).values()}):
        for dtype, mask, n_q, n_k, h, h_kv, split in cases:
            jobs.add(("check", None, short(dtype), d, mask, h // h_kv, 1, (length_class(n_q), length_class(n_k))))
        for dtype in (F16, BF16):
            for causal in (False, True):  # the first-use check's portable side
                jobs.add(("check", None, short(dtype), d, causal, check_group, 1,
                          (length_class(check_nq), length_class(check_nk))))
    for _, b, h, h_kv, n, d, causal in shapes:
        for name in [None] + list(kernels(names, d)):
            jobs.add(("path", name, "bfloat16", d, causal, h // h_kv, 1, (h, h_kv, n)))
    compile_ahead(jobs, ns.workers)
    failed = correctness(names, cases, ns.budget_s * 0.45)
    timed = [n for n in names if n not in failed]
    if shapes:
        say(f"\n== 2. backward timing, bf16 (Gluon kernels timed: {', '.join(timed) or 'none'}; not timed, wrong: "
            f"{sorted(failed) or 'none'}) ==")
        for w in waves:
            if w is not None:
                flash.SPLIT_WAVES, hopper_bwd.SPLIT_WAVES = w, {True: w, False: w}
            for row in shapes:
                if len(waves) > 1:
                    row = (f"{row[0]} waves {w}", *row[1:])
                try:
                    time_shape(row, timed, not DRY_RUN, ns.budget_s)
                except Exception as exc:  # noqa: BLE001 - one shape never ends the probe
                    say(f"  {row[0]}: raised {type(exc).__name__}\n{tail(exc)}")
                    use_path(None)
            say("\n== 3. kernel breakdown (torch.profiler, GPU time per call) ==")
            for row in shapes[:ns.breakdown]:
                if len(waves) > 1:
                    row = (f"{row[0]} waves {w}", *row[1:])
                try:
                    breakdown(row, timed, ns.budget_s + 30)
                except Exception as exc:  # noqa: BLE001
                    say(f"  breakdown {row[0]}: raised {type(exc).__name__}\n{tail(exc)}")
        table(timed)
    save()
    say(f"\n{len([r for r in RESULTS['correctness'] if r.get('ok') is False])} correctness failures; "
        f"{elapsed():.0f}s; results in {OUT / 'gluon_bwd_probe.json'}")
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
