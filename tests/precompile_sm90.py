"""Compile a verify plan's kernels ahead, for a Hopper GPU (sm_90), on a machine without one.

flashrun.harness.precompile lists what each check will launch by calling the kernel as the
check will, in compile-only mode, and hands every launch to Triton (``kernel.warmup`` under
``AsyncCompileMode``), which compiles each distinct specialization once. On a GPU that is all
real; here Triton's driver is replaced by one that names an sm_90 target (nothing is ever
launched, and loading a compiled kernel fails quietly, as it may), so the same code compiles
real sm_90 kernels - the count and the sharing between cases are Triton's own. Used by
tests/test_precompile.py; run it by hand as

    python tests/precompile_sm90.py

Prints one JSON object (what compiled, which check needs which kernels, which they share) for
the test to judge. Exit status 0: it ran; 3: this Triton cannot compile for sm_90 here.
"""

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (read when the kernels are imported)
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="flashrun-precompile-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class Sm90:
    """Just enough of Triton's CUDA driver for ``kernel.warmup``: device 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def main() -> int:
    if not hasattr(triton, "AsyncCompileMode"):
        print(json.dumps({"skip": f"triton {triton.__version__} has no AsyncCompileMode"}))
        return 3
    driver.set_active(Sm90())
    from flashrun.harness import precompile
    from flashrun.harness.check import Job
    from flashrun.harness.shapes import Shape
    from flashrun.kernels import tuning, warmup
    from flashrun.kernels.flash import args as flash_args, attention as flash

    from flashrun.kernels import minimal

    flash.check_inputs = minimal.check_inputs = lambda *args, **kwargs: None  # "tensors on the CPU": they are, here
    flash._tma_ok = lambda q, k, v: False  # pointer loads: TMA would ask the (absent) GPU
    flash._dq_tma_ok = lambda dq: False
    flash_args._multiprocessors = lambda device: 132  # an H100/H200's

    def tuned(*args, **kwargs):
        raise AssertionError("the tuner timed a kernel while compiling ahead")

    triton.testing.do_bench = tuned
    plain = Shape(1, 2, 1, 17, 17, 64, "float16", True)
    jobs = [Job(0, "flash", plain, 0, True, False, "cpu"),  # forward and backward
            Job(1, "flash", Shape(1, 2, 1, 97, 97, 64, "float16", True), 1, True, False, "cpu"),  # other lengths
            Job(2, "flash", plain, 2, False, False, "cpu"),  # forward only
            Job(3, "flash", Shape(1, 2, 1, 17, 17, 64, "float16", True, window=(8, 0)), 3, False, False, "cpu"),
            Job(4, "minimal", plain, 4, False, False, "cpu")]
    seen = []
    threads = []  # kernels the compile processes could not take (warmup logs each)

    class Threads(logging.Handler):
        def emit(self, record):
            if "not compiled in a process" in record.getMessage():
                threads.append(record.getMessage())

    logging.getLogger("flashrun.warmup").addHandler(Threads())
    logging.getLogger("flashrun.warmup").setLevel(logging.DEBUG)
    try:
        ahead = precompile._start([(job.index, precompile._verify_launches(job, "cpu")) for job in jobs],
                                  lambda done, total, workers: seen.append((done, total, workers)))
        ahead.wait()
    except Exception as exc:  # noqa: BLE001 - e.g. no ptxas in this Triton
        print(json.dumps({"skip": f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}"}))
        return 3
    compiled = ahead.close()

    def handles(index):
        return {c.name: id(c.handle) for c in ahead.needs.get(index, [])}

    fns = (flash._attn_fwd, flash._attn_bwd_preprocess, flash._attn_bwd_dkdv, flash._attn_bwd_dq, minimal._minimal_fwd)
    in_memory = sum(len(fn.device_caches[0][0]) for fn in fns)
    # the Python API's first call of a kind: job 0's shape again, forward and backward listed at once
    q = torch.randn(1, 2, 17, 64, dtype=torch.float16)
    k, v = torch.randn(1, 1, 17, 64, dtype=torch.float16), torch.randn(1, 1, 17, 64, dtype=torch.float16)
    api_batch, api_backward = flash._compile_ahead(q, k, v, 0.125, flash._variant(q, 1, 17, True, (-1, -1), 0.0, None),
                                                   "default", True, True)
    # the compile processes map libtorch only where a kernel's module imports torch (minimal's)
    processes = [warmup._processes._idle.get() for _ in range(warmup.workers())] if warmup._processes else []
    without_torch = sum("libtorch" not in Path(f"/proc/{p.pid}/maps").read_text() for p in processes)
    report = {
        "kernels": compiled.kernels if compiled else 0, "workers": compiled.workers if compiled else 0,
        "pool": compiled.pool if compiled else None, "processes": len(processes),
        "processes without torch": without_torch, "compiled in a thread": threads,
        "in Triton's memory caches": in_memory,
        "needs": {index: sorted(handles(index)) for index in ahead.needs},
        "job 1 shares with job 0": sorted(name for name, h in handles(1).items() if handles(0).get(name) == h),
        "job 2 shares with job 0": sorted(name for name, h in handles(2).items() if handles(0).get(name) == h),
        "job 3 shares with job 0": sorted(name for name, h in handles(3).items() if handles(0).get(name) == h),
        "last progress": seen[-1] if seen else None,
        "api first call, backward kernels": sorted(c.name for c in api_backward),
        "api first call, compiled": api_batch.submitted if api_batch else None,
        "chosen while compiling": tuning.chosen(),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
