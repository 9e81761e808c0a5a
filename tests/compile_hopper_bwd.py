"""Compile the Gluon sm_90 dK/dV backward (flashrun/kernels/flash/hopper_bwd_jit.py) for a Hopper
GPU on a machine without one: every kernel in hopper_bwd.KERNELS, fp16 and bf16, full, causal, a window,
a softcap, ALiBi and both with a window (the transposed kernel: a softcap only),
plain (GQA 1:1, bf16/fp16 outputs) and the GQA split (float32 partial outputs); report what the PTX
holds (wgmma, TMA loads, mbarrier, setmaxnreg and its register counts), the threads launched,
shared memory, and what ptxas -v makes of it: registers, spill bytes, its warning C7515 ("wgmma
serialized"), which would cost more than any spill (NOTES v6), and the wgmma waits in the SASS
(the kernel's own are 2 per consumer; ptxas adds one, silently, before a wgmma whose accumulator
other instructions wrote while an earlier wgmma of the same stage was in flight).

    python tests/compile_hopper_bwd.py [--kernels d64,d128] [--pairs] [--jobs N] [--ptx DIR]
    python tests/compile_hopper_bwd.py --gluon-dq     # the Gluon dQ kernel (hopper_dq_jit) instead

The registers ptxas reports are the launch's cap (maxnreg); the partitions re-split them with
setmaxnreg (consumers 240, producer 24), and a partition that needs more than its share spills,
which the spill bytes show. Exit status 0: all compiled, none spills or serializes or waits more
than the kernel does, shared memory and threads as hopper_bwd says; 3: this Triton lacks the Gluon
Hopper API or cannot compile for sm_90 here (nothing was checked); 1: a compile failed or a check
above did not hold.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from compile_bwd import TARGET, compile_launch  # noqa: E402
from flashrun.kernels.flash import hopper as flash_hopper, hopper_bwd  # noqa: E402



# (causal, window, softcap, ALiBi); the variants where the kernel takes them (hopper_bwd.takes_variants)
MASKS = {"full": (False, None, 0.0, False), "causal": (True, None, 0.0, False), "window": (False, (256, 0), 0.0, False),
         "softcap": (True, None, 30.0, False), "alibi": (True, None, 0.0, True), "sc+ali": (False, (256, 0), 30.0, True)}
VARIANT_MASKS = ("softcap", "alibi", "sc+ali")


def compile_one(dtype, mask, cfg, group=1, split=1, fused=False, adds=False):
    """The kernel as hopper_bwd.launch_args launches it, compiled for sm_90 (``mask``: a MASKS key;
    ``fused``: with dQ; ``adds``: a split's parts add into one float32 head)."""
    z, h_kv, n, d = 1, 2, 256, cfg.head_dim
    q = torch.empty(z, h_kv * group, n, d, dtype=dtype)
    k = torch.empty(z, h_kv, n, d, dtype=dtype)
    lse = torch.empty(z, h_kv * group, n, dtype=torch.float32)
    out_dtype = dtype if split == 1 else torch.float32
    dk = torch.empty(z, h_kv if adds else h_kv * split, n, d, dtype=out_dtype)
    dq = torch.empty(q.shape, dtype=torch.float32) if fused else None
    causal, window, softcap, alibi = MASKS[mask]
    slopes = torch.empty(h_kv * group, dtype=torch.float32) if alibi else None
    _, args, constexprs, options = hopper_bwd.launch_args(q, k, k, q, lse, lse, dk, dk, 0.125, causal, cfg, split, dq,
                                                          window, adds, softcap, slopes)
    return compile_launch(cfg.kernel, *args, **constexprs, **options)


def ptxas(ptx: str) -> dict:
    """ptxas -v (sm_90a) with the ptxas this Triton compiles sm_90 with: registers, spills, C7515,
    and from the SASS (cuobjdump) how many wgmma waits (WARPGROUP.DEPBAR) the code holds."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        out = subprocess.run([get_ptxas(TARGET.arch).path, "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                             capture_output=True, text=True)
        sass = (subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
                if out.returncode == 0 and cuobjdump.exists() else "")
    info = out.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"rc": out.returncode, "regs": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None,
            "serialized": "C7515" in info or "serialized" in info,
            "waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass)) if sass else None,
            "warnings": [line for line in info.splitlines() if "warning" in line.lower()]}


def check_one(job) -> tuple[bool, str]:
    """Compile one (kernel name, config, dtype, mask, group, split, adds, fused) and describe it."""
    name, cfg, dtype, mask, group, split, adds, fused, ptx_dir = job
    label = (f"{name}{'+dq' if fused else ''} {str(dtype).removeprefix('torch.')} {mask:6} GQA {group}:1"
             + (f" split {split} {'adds' if adds else 'partials'}" if split > 1 else ""))
    start = time.perf_counter()
    try:
        kernel = compile_one(dtype, mask, cfg, group, split, fused, adds)
    except Exception as exc:  # noqa: BLE001
        return False, f"FAIL {label}: {type(exc).__name__}\n" + "".join(traceback.format_exception(exc)[-4:])
    ptx = kernel.asm["ptx"]
    counts = {n: len(re.findall(pat, ptx)) for n, pat in (
        ("wgmma", r"wgmma\.mma_async"), ("tma", r"cp\.async\.bulk\.tensor"), ("tma-add", r"cp\.reduce\.async\.bulk"),
        ("mbarrier", r"mbarrier\."), ("setmaxnreg", r"setmaxnreg"))}
    nregs = sorted({int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    threads = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx)
    info = ptxas(ptx)
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        stem = f"fa3_bwd_{name}{'_dq' if fused else ''}_{str(dtype)[6:]}_{mask}_g{group}s{split}{'a' if adds else ''}"
        Path(ptx_dir, f"{stem}.ptx").write_text(ptx)
    problems = []
    if threads and int(threads.group(1)) != hopper_bwd.launched_threads(cfg):
        problems.append(f"launches {threads.group(1)} threads, hopper_bwd says {hopper_bwd.launched_threads(cfg)}")
    if kernel.metadata.shared > hopper_bwd.SMEM_LIMIT:
        problems.append(f"shared memory {kernel.metadata.shared} B over {hopper_bwd.SMEM_LIMIT}")
    if info["rc"] != 0:
        problems.append(f"ptxas exited {info['rc']}")
    if info["spill_stores"] or info["spill_loads"]:
        problems.append("spills")
    if info["serialized"]:
        problems.append("wgmma serialized (C7515)")
    if counts["wgmma"] == 0 or counts["tma"] == 0 or counts["setmaxnreg"] == 0:
        problems.append("no wgmma, TMA load or setmaxnreg in the PTX")
    if fused and counts["tma-add"] == 0:
        problems.append("no TMA reduce-add in the PTX")
    # the kernel waits twice per step and consumer (Sᵀ and dPᵀ; dV and dK), and with dQ once more
    # per consumer's dQ step: a wait ptxas adds serializes wgmmas the kernel meant to overlap (as
    # an accumulator written mid-stage made it)
    # (the transposed kernel: once per dQ tile of its dQ steps, hopper_bwd.DQ_COLS columns each)
    waits = (2 + (cfg.head_dim // hopper_bwd.DQ_COLS if cfg.transposed else 1) * fused) * cfg.consumers
    if info["waits"] is not None and info["waits"] > waits:
        problems.append(f"{info['waits']} wgmma waits in the SASS, the kernel has {waits}")
    spill = (f"{info['spill_stores']}/{info['spill_loads']}" if info["spill_stores"] is not None else "?")
    line = (f"{label}: {time.perf_counter() - start:4.1f}s  threads {threads.group(1) if threads else '?'}  "
            f"shared {kernel.metadata.shared} B  " + " ".join(f"{k} {v}" for k, v in counts.items())
            + f" (to {nregs})  ptxas: {info['regs']} regs (launch cap), spill stores/loads {spill} B, "
            + ("C7515 SERIALIZED" if info["serialized"] else "no C7515") + f", wgmma waits {info['waits']}")
    if problems:
        return False, f"FAIL {line}\n     " + "; ".join(problems) + "".join("\n     " + w for w in info["warnings"])
    return True, f"ok   {line}"


def check_dq(job) -> tuple[bool, str]:
    """Compile the Gluon dQ kernel (hopper_bwd.DQ_KERNELS[head_dim]) for one (dtype, causal, GQA
    group, softcap) as hopper_bwd.gluon_dq launches it, and describe it: (ok, the report line)."""
    head_dim, dtype, causal, group, softcap = job
    cfg = hopper_bwd.DQ_KERNELS[head_dim]
    label = (f"dq d{head_dim} {str(dtype).removeprefix('torch.')} {'causal' if causal else 'full'} GQA {group}:1"
             + (f" softcap {softcap:g}" if softcap else ""))
    q = torch.empty(1, 2 * group, 256, head_dim, dtype=dtype)
    k = torch.empty(1, 2, 256, head_dim, dtype=dtype)
    lse = torch.empty(1, 2 * group, 256, dtype=torch.float32)
    try:
        _, args, constexprs, options = hopper_bwd.dq_launch_args(q, k, k, q, lse, lse, q, 0.0625, causal, cfg, softcap)
        kernel = compile_launch(cfg.kernel, *args, **constexprs, **options)
    except Exception as exc:  # noqa: BLE001
        return False, f"FAIL {label}: {type(exc).__name__}\n" + "".join(traceback.format_exception(exc)[-4:])
    ptx = kernel.asm["ptx"]
    info = ptxas(ptx)
    problems = [what for what, bad in (
        (f"shared memory {kernel.metadata.shared} B over {hopper_bwd.SMEM_LIMIT}", kernel.metadata.shared > hopper_bwd.SMEM_LIMIT),
        (f"ptxas exited {info['rc']}", info["rc"] != 0), ("spills", bool(info["spill_stores"] or info["spill_loads"])),
        ("wgmma serialized (C7515)", info["serialized"]),
        # the kernel waits twice per key block and consumer: S and dP, then dQ
        (f"{info['waits']} wgmma waits in the SASS, the kernel has {2 * cfg.consumers}",
         info["waits"] is not None and info["waits"] > 2 * cfg.consumers)) if bad]
    line = (f"{label}: shared {kernel.metadata.shared} B, wgmma {len(re.findall(r'wgmma[.]mma_async', ptx))}, "
            f"ptxas: {info['regs']} regs (launch cap), spill stores/loads {info['spill_stores']}/{info['spill_loads']} B, "
            f"{'C7515 SERIALIZED' if info['serialized'] else 'no C7515'}, wgmma waits {info['waits']}")
    return (False, f"FAIL {line}\n     " + "; ".join(problems)) if problems else (True, f"ok   {line}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gluon-dq", action="store_true", help="the Gluon dQ kernel (hopper_dq_jit) instead")
    ap.add_argument("--kernels", help="comma-separated hopper_bwd.KERNELS names (default: all)")
    ap.add_argument("--pairs", action="store_true",
                    help="per kernel only fp16 full, bf16 causal GQA split and fp16 window (each dtype, mask and "
                         "output once)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile in this many processes")
    ap.add_argument("--ptx", help="write each PTX here")
    ap.add_argument("--dq", choices=("both", "fused", "separate"), default="both",
                    help="the kernel with dQ inside (the non-deterministic backward), without, or both")
    ap.add_argument("--masks", help=f"comma-separated masks of {', '.join(MASKS)} (default: all)")
    ns = ap.parse_args()
    missing = flash_hopper.gluon_api()
    if missing:
        print(f"Triton {triton.__version__}: {missing}; nothing compiled")
        return 3
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401 - the CUDA backend is here
    except Exception as exc:  # noqa: BLE001
        print(f"Triton {triton.__version__}: no CUDA backend to compile sm_90 with ({exc}); nothing compiled")
        return 3
    if ns.gluon_dq:
        dq_jobs = [(d, dtype, causal, group, softcap) for d in hopper_bwd.DQ_KERNELS for dtype in hopper_bwd.DTYPES
                   for causal in (False, True) for group in (1, 4) for softcap in (0.0, 50.0)]
        results = [check_dq(job) for job in dq_jobs]
        print(f"Triton {triton.__version__}, sm_90, {len(dq_jobs)} compiles", flush=True)
        for _, report in results:
            print(report, flush=True)
        return 0 if all(ok for ok, _ in results) else 1
    names = ns.kernels.split(",") if ns.kernels else list(hopper_bwd.KERNELS)
    # (dtype, mask, GQA group, split, adds): the plain launch and the split GQA ones (float32
    # partials, or float32 heads the parts add into)
    masks = ns.masks.split(",") if ns.masks else list(MASKS)
    cases = ([(torch.float16, "full", 1, 1, False), (torch.bfloat16, "causal", 4, 2, False),
              (torch.bfloat16, "causal", 6, 3, True), (torch.float16, "window", 1, 1, False),
              (torch.bfloat16, "sc+ali", 4, 2, False)]
             if ns.pairs else [(dtype, mask, *split) for dtype in hopper_bwd.DTYPES for mask in masks
                               for split in ((1, 1, False), (4, 2, False), (6, 3, True))])
    fused = {"both": (False, True), "fused": (True,), "separate": (False,)}[ns.dq]
    jobs = [(name, hopper_bwd.KERNELS[name], *case, f, ns.ptx) for name in names for case in cases for f in fused
            if (not f or hopper_bwd.fusable(hopper_bwd.KERNELS[name]))
            and not (case[1] in VARIANT_MASKS
                     and not hopper_bwd.takes_variants(hopper_bwd.KERNELS[name], alibi=MASKS[case[1]][3],
                                                     window=MASKS[case[1]][1] is not None))]
    print(f"Triton {triton.__version__}, sm_90, {len(jobs)} compiles", flush=True)
    with concurrent.futures.ProcessPoolExecutor(max(1, ns.jobs),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(check_one, jobs))
    for _, report in results:
        print(report, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
