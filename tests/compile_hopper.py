"""Compile the Gluon sm_90 forward (flashrun/kernels/flash/hopper_jit.py) for a Hopper GPU on a
machine without one: every kernel in flash_hopper.KERNELS (a persistent one is the same binary as
its one-program-per-tile twin, compiled once), fp16 and bf16, causal and not; report what the PTX
holds (wgmma, those of them with A from registers - "rs" -, TMA, mbarrier, setmaxnreg), the threads launched, shared memory and the registers
and spills ptxas reports.

    python tests/compile_hopper.py [--kernels d128,d192] [--pairs] [--jobs N] [--ptx DIR] [--sass-count OPS]

Exit status 0: all compiled; 3: this Triton lacks the Gluon Hopper API the kernel uses or cannot
compile for sm_90 here (nothing was checked); 1: a compile failed.
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
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from compile_bwd import compile_launch  # noqa: E402
from flashrun.kernels.flash import hopper as flash_hopper  # noqa: E402



def compile_one(dtype, causal, cfg, group=1):
    from flashrun.kernels.flash.hopper_jit import _fa3_fwd

    z, h, n, d = 1, 4, 256, cfg.head_dim
    q = torch.empty(z, h, n, d, dtype=dtype)
    k = torch.empty(z, h // group, n, d, dtype=dtype)
    lse = torch.empty(z, h, n, dtype=torch.float32)
    if dtype == torch.float8_e4m3fn:  # e4m3 in, bf16 out; v seq-contiguous (quantize_qkv's), descales per kv head
        v = torch.empty(z, h // group, d, n, dtype=dtype).transpose(2, 3)
        o = torch.empty(q.shape, dtype=torch.bfloat16)
        descales = (torch.ones(z, h // group),) * 3
    else:
        v, o, descales = k, torch.empty_like(q), None
    _, args, constexprs, options = flash_hopper.launch_args(q, k, v, o, lse, 0.125, causal, cfg, sms=132,
                                                            descales=descales)
    return compile_launch(_fa3_fwd, *args, **constexprs, **options)


def ptxas_info(ptx: str) -> str:
    """Registers and spills as ptxas -v reports them (a ptxas bundled with Triton that reads this
    PTX version: 3.9 writes PTX 9.x, which only its newer ptxas-blackwell reads)."""
    out = ""
    for name in ("ptxas", "ptxas-blackwell"):
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if not ptxas.exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp, "k.ptx")
            src.write_text(ptx)
            out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp, "k.cubin"))],
                                 capture_output=True, text=True).stderr
        if "Unsupported .version" not in out:
            break
    if not out:
        return "(no bundled ptxas)"
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (f"ptxas: {regs.group(1) if regs else '?'} regs (launch cap; partitions re-split with setmaxnreg), "
            f"spill stores/loads {spills.group(1) + '/' + spills.group(2) if spills else '?'} B"
            + ("  wgmma serialized (ptxas C7515)" if "C7515" in out or "serialized" in out else ""))


def sass_counts(cubin: bytes, opcodes: list[str]) -> str:
    """How many instructions of each SASS opcode (``MUFU.EX2``: that opcode with those modifiers
    first) the cubin holds, as the cuobjdump bundled with Triton disassembles it."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not opcodes or not tool.exists():
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.cubin").write_bytes(cubin)
        sass = subprocess.run([str(tool), "-sass", str(Path(tmp, "k.cubin"))], capture_output=True, text=True).stdout
    found = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass, re.M)
    return "  SASS " + " ".join(f"{op} {sum(f == op or f.startswith(op + '.') for f in found)}" for op in opcodes)


def check_one(job) -> tuple[bool, str]:
    """Compile one (kernel names, config, dtype, causal) and describe it: (ok, the report lines)."""
    same, cfg, dtype, causal, ptx_dir, opcodes = job
    label = f"{'/'.join(same)} {str(dtype).removeprefix('torch.')} {'causal' if causal else 'full'}"
    start = time.perf_counter()
    try:
        kernel = compile_one(dtype, causal, cfg, group=2 if causal else 1)
    except Exception as exc:  # noqa: BLE001
        return False, f"FAIL {label}: {type(exc).__name__}\n" + "".join(traceback.format_exception(exc)[-3:])
    ptx = kernel.asm["ptx"]
    counts = {name: len(re.findall(pat, ptx)) for name, pat in (
        ("wgmma", r"wgmma\.mma_async"), ("rs", r"wgmma\.mma_async[^;{]*\{[^}]*\},\s*\{"), ("tma", r"cp\.async\.bulk\.tensor"),
        ("mbarrier", r"mbarrier\."), ("setmaxnreg", r"setmaxnreg"))}
    regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    threads = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx)
    if threads and int(threads.group(1)) != flash_hopper.launched_threads(cfg):  # what programs_per_sm assumes
        return False, (f"FAIL {label}: launches {threads.group(1)} threads, flash_hopper.launched_threads says "
                       f"{flash_hopper.launched_threads(cfg)}")
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        Path(ptx_dir, f"fa3_{same[0]}_{str(dtype)[6:]}_{int(causal)}.ptx").write_text(ptx)
    return True, (f"ok   {label}: {time.perf_counter() - start:.1f}s  threads {threads.group(1) if threads else '?'}  "
                  f"shared {kernel.metadata.shared} B  " + " ".join(f"{k} {v}" for k, v in counts.items())
                  + f" (to {regs})  {ptxas_info(ptx)}" + sass_counts(kernel.asm["cubin"], opcodes))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", help="comma-separated flash_hopper.KERNELS names, with --fp8 FP8_KERNELS too (default: all)")
    ap.add_argument("--pairs", action="store_true",
                    help="per kernel only fp16 full and bf16 causal (each dtype and mask once; the CPU suite)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile in this many processes")
    ap.add_argument("--ptx", help="write each PTX here")
    ap.add_argument("--fp8", action="store_true", help="the e4m3 kernels (one column block), full and causal, instead")
    ap.add_argument("--sass-count", default="", help="comma-separated SASS opcodes to count, e.g. MUFU.EX2")
    ns = ap.parse_args()
    missing = flash_hopper.gluon_api()
    if missing:
        print(f"Triton {triton.__version__}: {missing}; nothing compiled")
        return 3
    names = ns.kernels.split(",") if ns.kernels else [*flash_hopper.KERNELS, *(flash_hopper.FP8_KERNELS if ns.fp8 else ())]
    binaries = {}  # the compiled kernel ignores `persistent` (a grid size): one compile per twin pair
    for name in names:
        cfg = flash_hopper.fp8_kernel(name) if ns.fp8 else flash_hopper.KERNELS[name]
        binaries.setdefault(replace(cfg, persistent=False), []).append(name)
    pairs = ((torch.float16, False), (torch.bfloat16, True)) if ns.pairs else \
        [(dtype, causal) for dtype in flash_hopper.DTYPES for causal in (False, True)]
    if ns.fp8:
        pairs = [(torch.float8_e4m3fn, causal) for causal in (False, True)]
        binaries = {cfg: same for cfg, same in binaries.items() if not flash_hopper.split_head_dim(cfg.head_dim)[1]}
    opcodes = [op for op in ns.sass_count.split(",") if op]
    jobs = [(same, cfg, dtype, causal, ns.ptx, opcodes) for cfg, same in binaries.items() for dtype, causal in pairs]
    with concurrent.futures.ProcessPoolExecutor(max(1, ns.jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(check_one, jobs))
    for _, report in results:
        print(report, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
