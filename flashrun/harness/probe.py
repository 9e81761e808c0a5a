"""``bench --metrics`` and ``--profile``: what a provider's timed call does on the GPU.

:meth:`Probe.gather` runs after a cell is timed, never inside the timed loop, on the very
callable that was timed (same inputs, same mode):

1. one call with :func:`launches` on: every Triton kernel it launches, as compiled (registers,
   local memory, shared memory, warps) and with its grid, read into
   :class:`~flashrun.harness.metrics.KernelLaunch` with the occupancy and waves on this GPU;
2. the wall time per call: calls back to back, synchronized once at each end;
3. the same calls under ``torch.profiler``: the GPU time of every kernel (cuDNN's and PyTorch's
   too), so GPU time against wall time is the host's share; with ``--profile DIR`` its
   Chrome/Perfetto trace is written there. Proton's per-kernel view of the same calls is not
   taken here but after the sweep, in a child process (:mod:`~flashrun.harness.proton_pass`):
   CUPTI takes one profiler per process, and torch.profiler keeps it.

Why the grid is read at ``CompiledKernel.launch_metadata``: Triton's launch hooks
(``triton.knobs.runtime.launch_enter_hook``, a hook chain in 3.6 and 3.9) are given the kernel's
name, function handle and stream, and the grid only when a kernel is decorated with its own
``launch_metadata`` callback. ``CompiledKernel.launch_metadata(grid, stream, *args)`` is the call
both versions make on every launch (``JITFunction.run``, ``CompiledKernel[grid]``, Inductor's
launchers) to build that hook's argument, so :func:`launches` wraps it for one call, then puts
it back.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from flashrun.harness.metrics import (
    CallMetrics,
    KernelLaunch,
    KernelTime,
    PtxasUsage,
    SMLimits,
    parse_ptxas,
    read_kernel,
    sm_limits,
)

WALL_MS = 50  # back-to-back calls for the wall time: about this long, ...
PROFILED_MS = 20  # ... and under the profiler about this long (a trace stays small)
MIN_CALLS, MAX_WALL_CALLS, MAX_PROFILED_CALLS = 3, 1000, 50


@contextmanager
def launches() -> Iterator[list[tuple[Any, tuple[int, ...]]]]:
    """Every Triton kernel launched inside the block: ``(CompiledKernel, grid)`` in launch order."""
    from triton.compiler.compiler import CompiledKernel

    seen: list[tuple[Any, tuple[int, ...]]] = []
    original = CompiledKernel.launch_metadata

    def recording(self: Any, grid: tuple[int, ...], stream: Any, *args: Any) -> Any:
        seen.append((self, tuple(grid)))
        return original(self, grid, stream, *args)

    CompiledKernel.launch_metadata = recording
    try:
        yield seen
    finally:
        CompiledKernel.launch_metadata = original


def kernel_launches(seen: list[tuple[Any, tuple[int, ...]]], limits: SMLimits) -> tuple[KernelLaunch, ...]:
    """One :class:`KernelLaunch` per (kernel, grid), with how often the call launched it."""
    counts = Counter((id(kernel), grid) for kernel, grid in seen)
    firsts = {(id(kernel), grid): kernel for kernel, grid in seen}
    return tuple(read_kernel(firsts[key], key[1], limits, launches=n) for key, n in counts.items())


def kernel_times(events: Iterable[Any], calls: int) -> tuple[KernelTime, ...]:
    """The profiler's GPU events (kernels, copies, memsets), per call, longest first."""
    time_us: dict[str, float] = {}
    count: Counter[str] = Counter()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            time_us[event.name] = time_us.get(event.name, 0.0) + event.device_time_total
            count[event.name] += 1
    return tuple(sorted((KernelTime(name, count[name] / calls, total / calls) for name, total in time_us.items()),
                        key=lambda k: -k.us))


def write_trace(prof: Any, path: Path) -> Path:
    """``prof``'s Chrome/Perfetto trace at ``path``, whole or not at all (exported next to it, then
    renamed: torch writes the file itself)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def file_stem(*parts: str) -> str:
    """A file name from labels and provider specs (which may hold spaces, slashes, colons, dots:
    Proton replaces what follows a dot with its own extension)."""
    return "-".join(re.sub(r"[^A-Za-z0-9_-]+", "_", part).strip("_") for part in parts if part)


@dataclass(frozen=True)
class Probe:
    """What ``--metrics``/``--profile`` read, on this process's GPU."""

    limits: SMLimits
    profile_dir: Path | None = None  # --profile: the traces go here
    prefix: str = ""  # the shape's part of the file names

    @classmethod
    def on(cls, device: torch.device, profile_dir: str | None, prefix: str = "") -> Probe:
        return cls(sm_limits(torch.cuda.get_device_properties(device)),
                   Path(profile_dir) if profile_dir is not None else None, prefix)

    def gather(self, fn: Callable[[], object], leaves: list[torch.Tensor] | None, name: str,
               ms: float) -> CallMetrics:
        """Steps 1-3 of the module doc for the timed callable ``fn`` (median ``ms``), resetting
        ``leaves``' gradients before each call as the timing did."""

        def call() -> None:
            for leaf in leaves or ():
                leaf.grad = None
            fn()

        torch.cuda.synchronize()
        with launches() as seen:
            call()
            torch.cuda.synchronize()
        kernels = kernel_launches(seen, self.limits)

        n_wall = _calls(WALL_MS, ms, MAX_WALL_CALLS)
        start = time.perf_counter()
        for _ in range(n_wall):
            call()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / n_wall * 1e6

        from torch.profiler import ProfilerActivity, profile

        n_profiled = profiled_calls(ms)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n_profiled):
                call()
            torch.cuda.synchronize()
        gpu_kernels = kernel_times(prof.events(), n_profiled)
        gpu_us = sum(k.us for k in gpu_kernels) if gpu_kernels else None
        if self.profile_dir is not None:
            write_trace(prof, self.profile_dir / f"{file_stem(self.prefix, name)}.trace.json")
        note = "" if gpu_kernels else "the profiler recorded no GPU activity"
        return CallMetrics(gpu_us, wall_us, kernels, gpu_kernels, note)


def profiled_calls(ms: float) -> int:
    """How many calls of median ``ms`` a profiler watches: about :data:`PROFILED_MS` of them (a
    trace stays small), the same number under torch.profiler here and under Proton
    (:mod:`~flashrun.harness.proton_pass`)."""
    return _calls(PROFILED_MS, ms, MAX_PROFILED_CALLS)


def _calls(budget_ms: float, ms: float, most: int) -> int:
    return max(MIN_CALLS, min(most, math.ceil(budget_ms / max(ms, 1e-3))))


# -- ptxas -v, to check the registers the driver reports -----------------------------------------------
def ptxas_log(ptx: str, metadata: Any = None) -> str:
    """``ptxas -v``'s log for ``ptx``, compiled again with the ptxas that Triton ships and as Triton
    compiled it (``-lineinfo``; ``--regAllocOptLevel=2`` where this Triton passes it; from the
    kernel's ``metadata``, ``--fmad=false`` without FP fusion and its ``ptx_options``), for the
    architecture the PTX targets."""
    import inspect

    from triton.backends.nvidia import compiler as nvidia

    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    if target is None:
        raise ValueError("no .target line in this PTX")
    arch = int(re.sub(r"\D", "", target.group(1)))
    extra = ["--regAllocOptLevel=2"] if "regAllocOptLevel" in inspect.getsource(nvidia.CUDABackend.make_cubin) else []
    if not getattr(metadata, "enable_fp_fusion", True):
        extra.append("--fmad=false")
    extra += (getattr(metadata, "ptx_options", None) or "").split()
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        argv = [nvidia.get_ptxas(arch).path, "-lineinfo", "-v", *extra,
                f"--gpu-name={target.group(1)}", str(source), "-o", str(Path(folder) / "kernel.cubin")]
        run = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return run.stdout + run.stderr


def ptxas_usage(ptx: str, metadata: Any = None) -> dict[str, PtxasUsage]:
    """Each entry function's registers and local memory, as ``ptxas -v`` reports them."""
    return parse_ptxas(ptxas_log(ptx, metadata))
