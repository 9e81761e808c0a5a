"""Compile the Gluon sm_90 forward (flashrun/kernels/flash/hopper_jit.py) for a Hopper GPU on a
machine without one, for every (dtype, head_dim, causal) it claims, and report what the PTX
holds (wgmma, TMA, mbarrier, setmaxnreg) and the registers/spills ptxas reports.

    python tests/compile_hopper.py [--overlap] [--ptx DIR]

Exit status 0: all compiled; 3: this Triton lacks the Gluon Hopper API the kernel uses or cannot
compile for sm_90 here (nothing was checked); 1: a compile failed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from flashrun.kernels.flash import hopper as flash_hopper  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(dtype, d, causal, cfg, group=1):
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashrun.kernels.flash.hopper_jit import _fa3_fwd

    z, h, n = 1, 4, 256
    q = torch.empty(z, h, n, d, dtype=dtype)
    k = torch.empty(z, h // group, n, d, dtype=dtype)
    o = torch.empty_like(q)
    lse = torch.empty(z, h, n, dtype=torch.float32)
    _, args, constexprs, options = flash_hopper.launch_args(q, k, k, o, lse, 0.125, causal, cfg)
    signature, constants = {}, {}
    params = [p for p in _fa3_fwd.params]
    for p, value in zip(params, list(args) + [None] * len(params)):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[(params.index(p),)] = constexprs[p.name]
        else:
            signature[p.name] = mangle_type(value, specialize=True)
    src = GluonASTSource(_fa3_fwd, signature, constants)
    return triton.compile(src, target=TARGET, options=options)


def ptxas_info(ptx: str) -> str:
    """Registers and spills as ptxas -v reports them (the ptxas bundled with Triton)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return "(no bundled ptxas)"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp, "k.cubin"))],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (f"ptxas: {regs.group(1) if regs else '?'} regs (launch cap; partitions re-split with setmaxnreg), "
            f"spill stores/loads {spills.group(1) + '/' + spills.group(2) if spills else '?'} B")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overlap", action="store_true", help="compile the OVERLAP variant")
    ap.add_argument("--pingpong", action="store_true", help="compile the OVERLAP + PINGPONG variant")
    ap.add_argument("--ptx", help="write each PTX here")
    ns = ap.parse_args()
    missing = flash_hopper.gluon_api()
    if missing:
        print(f"Triton {triton.__version__}: {missing}; nothing compiled")
        return 3
    failed = 0
    for d in flash_hopper.CONFIGS:
        for dtype in flash_hopper.DTYPES:
            for causal in (False, True):
                cfg = flash_hopper.CONFIGS[d]
                cfg = replace(cfg, overlap=cfg.overlap or ns.overlap or ns.pingpong, pingpong=ns.pingpong)
                label = f"D={d} {str(dtype).removeprefix('torch.')} {'causal' if causal else 'full'}"
                start = time.perf_counter()
                try:
                    kernel = compile_one(dtype, d, causal, cfg, group=2 if causal else 1)
                except Exception as exc:  # noqa: BLE001
                    failed += 1
                    print(f"FAIL {label}: {type(exc).__name__}")
                    print("".join(traceback.format_exception(exc)[-3:]))
                    continue
                ptx = kernel.asm["ptx"]
                counts = {name: len(re.findall(pat, ptx)) for name, pat in (
                    ("wgmma", r"wgmma\.mma_async"), ("tma", r"cp\.async\.bulk\.tensor"),
                    ("mbarrier", r"mbarrier\."), ("setmaxnreg", r"setmaxnreg"))}
                regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
                print(f"ok   {label}: {time.perf_counter() - start:.1f}s  shared {kernel.metadata.shared} B  "
                      + " ".join(f"{k} {v}" for k, v in counts.items()) + f" (to {regs})  {ptxas_info(ptx)}",
                      flush=True)
                if ns.ptx:
                    Path(ns.ptx).mkdir(parents=True, exist_ok=True)
                    Path(ns.ptx, f"fa3_d{d}_{str(dtype)[6:]}_{int(causal)}.ptx").write_text(ptx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
