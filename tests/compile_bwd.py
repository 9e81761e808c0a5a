"""Compile flash's backward kernels for a Hopper GPU (sm_90) on a machine without one, every launch
config the tuner may pick, and report what ptxas makes of each: registers, spill bytes, spill
instructions inside the kernel's loops, and whether ptxas serialized the loop's wgmmas (its
warning C7515, "wgmma.mma_async instructions are serialized"), which costs more than any spill.

    python tests/compile_bwd.py [--dims 64,128] [--kinds bwd_dkdv,bwd_dq] [--masks causal] [--defaults]
                                [--variants] [--json FILE]

Each kernel is compiled as a launch specializes it (16-byte aligned pointers, integers divisible
by 16 marked so - ``triton.compile`` without those attributes vectorizes no load, pipelines none,
and reports spills a real launch does not have). The registers are those of the ptxas this Triton
compiles sm_90 with (ptxas -v). Toolchains differ: the H200 image's triton 3.6 serialized what
triton 3.9 (this repository's CPU venv) does not, so only a 3.6 run checks what the H200 runs
(tests/test_gpu.py runs this there; on the CPU, install the 3.6.0 wheel in a side venv).

Exit status 0: every config compiled and none has its wgmmas serialized; 1: a compile failed or
one is serialized; 3: this Triton cannot compile for sm_90 here (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (read when the kernels are imported)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from flashrun.kernels import tuning  # noqa: E402
from flashrun.kernels.flash import args as flash_args, attention as flash  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100/H200
BACKEND = make_backend(TARGET)
KERNELS = {name: getattr(flash, name) for name in ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")}
KINDS = ("bwd_fused", "bwd_dkdv", "bwd_dq")
# the kernel each tuning kind launches (bwd_fused: dK/dV with the atomic dQ)
KERNEL = {"bwd_fused": "_attn_bwd_dkdv", "bwd_dkdv": "_attn_bwd_dkdv", "bwd_dq": "_attn_bwd_dq"}


def compile_launch(fn, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``'s compilation for TARGET, specialized as a launch would be
    (a @triton.jit or a @gluon.jit kernel)."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, options)
    source = ASTSource
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def can_compile() -> bool:
    """Whether this Triton compiles for TARGET here (a CUDA backend, ptxas); says why not."""
    try:
        compile_launch(flash._attn_bwd_preprocess, torch.empty(16, 64, dtype=torch.float16),
                       torch.empty(16, 64, dtype=torch.float16), torch.empty(16), *([64, 1] * 4), 1, 16,
                       HEAD_DIM=64, BLOCK_D0=64, BLOCK_D1=0, BLOCK_M=16)
    except Exception as exc:  # noqa: BLE001 - no CUDA backend/ptxas in this Triton: nothing to check
        print(f"cannot compile for {TARGET} here: {type(exc).__name__}: {exc}")
        return False
    return True


def _tool(name: str) -> str:
    """The CUDA tool this Triton itself uses for sm_90 (3.9 bundles two ptxas and picks the newer)."""
    if name == "ptxas":
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(TARGET.arch).path
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(ptx: str) -> dict:
    """ptxas -v on ``ptx`` (sm_90a) and the SASS's loops: registers, spill bytes, STL/LDL inside
    loops (a loop: a backward branch and its target), wgmma count inside loops, C7515."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(ptx)
        info = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f"{tmp}/k.cubin"],
                              capture_output=True, text=True, check=True).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(b.group(1), 16), addr) for addr, text in code
             if (b := re.search(r"BRA\s+0x([0-9a-f]+)", text)) and int(b.group(1), 16) < addr]
    inside = [text for addr, text in code if any(lo <= addr <= hi for lo, hi in loops)]
    return {"regs": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
            "loop_spill_ops": sum(("STL" in t) or ("LDL" in t) for t in inside),
            "loop_wgmma": sum("HGMMA" in t for t in inside),
            "serialized": "C7515" in info}


SM_REGISTERS = 65536  # per H100/H200 SM
SM_SHARED = 228 * 1024  # per SM; a block may use 227 KB of it, plus 1 KB the runtime reserves per block


def ctas_per_sm(regs: int, num_warps: int, shared: int) -> int:
    """Programs of this kernel one SM holds at once: its register file (registers are given out
    per warp in units of 256) and its shared memory. Below 2, nothing on the SM overlaps one
    program's softmax with another's matmuls."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(SM_REGISTERS // (per_warp * num_warps), SM_SHARED // (shared + 1024))


class CompileOnly:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args)`` compiles for TARGET and records."""

    def __init__(self, fn, rows: list):
        self.fn, self.rows = fn, rows

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            start = time.perf_counter()
            row = {"kernel": self.fn.__name__, **{k: kwargs.get(k) for k in (
                "HEAD_DIM", "CAUSAL", "WINDOW", "SOFTCAP", "ALIBI", "GROUP", "ATOMIC_DQ", "BLOCK_M", "BLOCK_N")},
                "num_warps": kwargs.get("num_warps"), "num_stages": kwargs.get("num_stages")}
            try:
                compiled = compile_launch(self.fn, *args, **kwargs)
                row.update(resources(compiled.asm["ptx"]))
                row["shared"] = compiled.metadata.shared
                row["ctas_per_sm"] = ctas_per_sm(row["regs"], row["num_warps"] or 4, row["shared"])
            except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            row["seconds"] = round(time.perf_counter() - start, 1)
            self.rows.append(row)
        return launch


class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def backward(rows: list, head_dim: int, causal: bool, kind: str, cfg: tuning.LaunchConfig, group: int = 1,
             **variants) -> None:
    """Run flash's backward launcher for one (kind, config): that kind's kernel compiles (a row in
    ``rows``), the others launch nothing."""
    for name in set(KERNEL.values()) | {"_attn_bwd_preprocess"}:
        setattr(flash, name, CompileOnly(KERNELS[name], rows) if name == KERNEL[kind] else NoLaunch())
    z, h, n = 2, 8, 1024  # the bench convention's alignment: every length and stride a multiple of 16
    q = torch.empty(z, h, n, head_dim, dtype=torch.bfloat16)
    k = torch.empty(z, h // group, n, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(z, h, n, dtype=torch.float32)
    variant = flash._variant(q, z, n, causal, variants.get("window", (-1, -1)), variants.get("softcap", 0.0),
                             variants.get("alibi_slopes"))
    pins = {other: cfg if other == kind else tuning.LaunchConfig(64, 64, 4, 2) for other in KERNEL}
    flash._attn_backward(q, q, k, k, q, lse, 0.125, variant, pins, deterministic=kind != "bwd_fused")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,96,192,256", help="head dims (each stands for its tuning class)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--defaults", action="store_true", help="only each kind's default (first) candidate")
    ap.add_argument("--masks", default="full,causal", help="full, causal or both")
    ap.add_argument("--variants", action="store_true", help="also window, softcap + ALiBi, GQA 4:1 (causal)")
    ap.add_argument("--json", help="write the rows here")
    ns = ap.parse_args()
    if not can_compile():
        return 3
    rows: list[dict] = []
    flash._dq_tma_ok = lambda dq: flash_args._split_head_dim(dq.shape[-1])[1] == 0  # as on Hopper
    print(f"triton {triton.__version__}, {_tool('ptxas')}")
    cases = [(mask == "causal", {}, 1) for mask in ns.masks.split(",")]
    if ns.variants:
        cases += [(False, {"window": (256, 0)}, 1), (True, {"softcap": 30.0, "alibi_slopes": torch.ones(8)}, 1),
                  (True, {}, 4)]
    for head_dim in map(int, ns.dims.split(",")):
        for kind in ns.kinds.split(","):
            configs = tuning.candidates(kind, head_dim, torch.bfloat16)
            for cfg in configs[:1] if ns.defaults else configs:
                for causal, variants, group in cases:
                    backward(rows, head_dim, causal, kind, cfg, group, **variants)
    failed = 0
    for row in rows:
        tags = "+".join(t for t in ("CAUSAL", "WINDOW", "SOFTCAP", "ALIBI") if row[t]) or "full"
        cfg = f"{row['BLOCK_M']}x{row['BLOCK_N']} w{row['num_warps']} s{row['num_stages']}"
        what = (f"ERROR {row['error']}" if "error" in row else
                f"{row['regs']} regs, {row['shared'] // 1024} KB smem, {row['ctas_per_sm']}/SM, spills "
                f"{row['spill_bytes']} B ({row['loop_spill_ops']} in loops), {row['loop_wgmma']} wgmma in loops"
                f"{', SERIALIZED (C7515)' if row['serialized'] else ''}")
        print(f"{row['kernel']:15} D={row['HEAD_DIM']:<3} {tags:20} g{row['GROUP']} "
              f"{'atomic ' if row['ATOMIC_DQ'] else ''}{cfg:16} {what}", flush=True)
        failed += "error" in row or bool(row.get("serialized"))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
