"""Why a kernel runs as fast as it does: occupancy, waves and the roofline (``bench --metrics``).

Pure arithmetic on numbers read elsewhere (:mod:`~flashrun.harness.probe` reads them off the GPU,
the tests off a fixture); no torch, no triton.

**Occupancy** (theoretical, the CUDA occupancy calculator's rules): an SM holds as many
programs (CTAs) of a kernel as its scarcest resource allows -

* registers: each warp gets ``regs x 32`` rounded up to 256, from one of the SM's 4 register
  sub-partitions (65536 / 4 registers each);
* shared memory: each program takes its shared bytes plus 1 KiB the driver reserves (sm_80+),
  rounded up to 128 bytes, from the SM's shared memory (228 KiB on sm_90);
* threads (2048 per SM on sm_80/sm_90) and a cap on resident programs (32 on sm_80/sm_90).

Occupancy is the resident warps over the SM's maximum; **waves** are the programs of a launch
over the programs all SMs hold at once (1.02 waves: a second wave with almost nothing in it).

**Roofline**: a call moves at least :func:`bytes_moved` bytes of HBM (each input read once, each
output written once; the softmax statistics not counted) and does ``flops`` work, so its
arithmetic intensity is ``flops / bytes`` FLOP/B. With the GPU's measured matmul TFLOP/s and
copy GB/s (:class:`Ceilings`), no call can beat ``min(TFLOP/s, intensity x GB/s)``: below the
ridge point ``TFLOP/s / GB/s`` a call is memory-bound (judge it by GB/s: decode), above it
compute-bound (judge it by TFLOP/s). ``% roof`` is the achieved TFLOP/s over that bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from flashrun.harness.shapes import Shape

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
SUB_PARTITIONS = 4  # register file quarters, one per warp scheduler (sm_70+)
REGISTER_UNIT = 256  # registers are given to a warp in blocks of 256
SHARED_UNIT = 128  # bytes: shared memory is given to a program in blocks of 128


@dataclass(frozen=True)
class SMLimits:
    """What one SM holds at once, and how many SMs there are."""

    sms: int
    max_threads: int = 2048
    max_programs: int = 32
    registers: int = 65536
    shared_bytes: int = 233472  # usable by programs, per SM (228 KiB on sm_90)
    reserved_shared: int = 1024  # kept by the driver per program (sm_80+)
    warp_size: int = 32

    @property
    def max_warps(self) -> int:
        return self.max_threads // self.warp_size


# Resident programs per SM where it is not 32, and shared memory per SM, for a torch that does not
# report it (CUDA C Programming Guide, compute capabilities).
MAX_PROGRAMS = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}
SHARED_PER_SM = {(7, 0): 98304, (8, 0): 167936, (8, 7): 167936, (9, 0): 233472, (10, 0): 233472}


def sm_limits(props: Any) -> SMLimits:
    """:class:`SMLimits` from ``torch.cuda.get_device_properties``' answer."""
    capability = (props.major, props.minor)
    return SMLimits(
        sms=props.multi_processor_count, max_threads=props.max_threads_per_multi_processor,
        max_programs=MAX_PROGRAMS.get(capability, 32),
        registers=getattr(props, "regs_per_multiprocessor", None) or 65536,
        shared_bytes=getattr(props, "shared_memory_per_multiprocessor", None) or SHARED_PER_SM.get(capability, 102400),
        reserved_shared=1024 if props.major >= 8 else 0, warp_size=props.warp_size,
    )


@dataclass(frozen=True)
class Occupancy:
    programs_per_sm: int
    pct: float  # resident warps over the SM's maximum, in %
    limiter: str  # registers | shared | threads | programs: the resource that ran out first


def occupancy(limits: SMLimits, num_warps: int, regs: int, shared: int) -> Occupancy:
    """Programs of a kernel one SM holds at once (``num_warps`` warps, ``regs`` registers per
    thread, ``shared`` bytes of shared memory per program), and what limits them."""
    regs_per_warp = math.ceil(max(regs, 1) * limits.warp_size / REGISTER_UNIT) * REGISTER_UNIT
    warps_by_regs = (limits.registers // SUB_PARTITIONS // regs_per_warp) * SUB_PARTITIONS
    per_program = math.ceil((shared + limits.reserved_shared) / SHARED_UNIT) * SHARED_UNIT
    bounds = {  # dict order breaks ties: the scarcer resource first
        "registers": warps_by_regs // num_warps,
        "shared": limits.shared_bytes // per_program if per_program else limits.max_programs,
        "threads": limits.max_warps // num_warps,
        "programs": limits.max_programs,
    }
    limiter = min(bounds, key=lambda name: bounds[name])
    programs = bounds[limiter]
    return Occupancy(programs, 100.0 * programs * num_warps / limits.max_warps, limiter)


def waves(programs: int, limits: SMLimits, per_sm: int) -> float | None:
    """Launches' programs over what all SMs hold at once; None when none fits (the launch fails)."""
    return programs / (limits.sms * per_sm) if per_sm else None


@dataclass(frozen=True)
class KernelLaunch:
    """One Triton kernel that a provider's call launched, as compiled: what ``--metrics`` shows."""

    name: str
    launches: int  # per call of the provider, with this grid
    grid: tuple[int, int, int]
    num_warps: int
    regs: int  # per thread
    spill_bytes: int  # local memory per thread: where spills go (ptxas -v's "bytes stack frame")
    shared: int  # bytes of shared memory per program
    programs_per_sm: int
    occupancy_pct: float
    limiter: str
    waves: float | None
    num_ctas: int = 1
    hash: str = ""  # Triton's hash of the compiled kernel: its folder in Triton's cache


def read_kernel(compiled: Any, grid: tuple[int, ...], limits: SMLimits, launches: int = 1) -> KernelLaunch:
    """A :class:`KernelLaunch` from a launched ``triton.compiler.CompiledKernel`` (``n_regs`` and
    ``n_spills``, set once it is loaded on the GPU, and its ``metadata``: name, num_warps,
    num_ctas, shared) and the grid it was launched with. Triton's ``n_spills`` is the kernel's
    local memory per thread in 4-byte words (the driver's ``LOCAL_SIZE_BYTES / 4``)."""
    meta = compiled.metadata
    grid = (tuple(int(g) for g in grid) + (1, 1))[:3]
    num_ctas = getattr(meta, "num_ctas", 1) or 1
    occ = occupancy(limits, meta.num_warps, compiled.n_regs, meta.shared)
    return KernelLaunch(
        name=meta.name, launches=launches, grid=grid, num_warps=meta.num_warps, regs=compiled.n_regs,
        spill_bytes=4 * compiled.n_spills, shared=meta.shared, programs_per_sm=occ.programs_per_sm,
        occupancy_pct=occ.pct, limiter=occ.limiter,
        waves=waves(grid[0] * grid[1] * grid[2] * num_ctas, limits, occ.programs_per_sm),
        num_ctas=num_ctas, hash=str(getattr(compiled, "hash", "")),
    )


@dataclass(frozen=True)
class KernelTime:
    """One GPU kernel (any: Triton's, cuDNN's, PyTorch's) in the profiler's view of a call."""

    name: str
    launches: float  # per call
    us: float  # GPU time per call, microseconds


@dataclass(frozen=True)
class CallMetrics:
    """What ``--metrics`` measured of one provider in one mode on one shape, after its timing."""

    gpu_us: float | None  # kernels' GPU time per call (torch.profiler)
    wall_us: float  # wall time per call, calls back to back, synchronized once at each end
    kernels: tuple[KernelLaunch, ...]  # the Triton kernels, as compiled and launched
    gpu_kernels: tuple[KernelTime, ...]  # every GPU kernel, as profiled
    note: str = ""  # what could not be measured, and why


# -- the roofline -------------------------------------------------------------------------------------
def bytes_moved(shape: Shape, mode: str, fp8: bool = False) -> float:
    """Bytes one call must move to or from HBM at least: forward reads q, k, v and writes o;
    backward reads q, k, v, o, do and writes dq, dk, dv; fwd_bwd both. Under GQA k and v have
    the kv heads; packed sequences count their tokens; an fp8 KV cache one byte an element (its
    scales not counted); ``fp8`` (a forward in e4m3, flash-fp8): q, k, v one byte an element."""
    size = DTYPE_BYTES[shape.dtype] * shape.head_dim
    tokens_q = sum(shape.seqlens) if shape.seqlens is not None else shape.batch_size * shape.seq_len
    tokens_k = sum(shape.key_lengths) if shape.seqlens is not None else shape.batch_size * shape.seq_len_k
    q = size * tokens_q * shape.num_heads  # q, o, do, dq each
    kv = (shape.head_dim if shape.kv_scale or fp8 else size) * tokens_k * shape.num_kv_heads  # k, v, dk, dv each
    forward, backward = (q * (1 + 1 / DTYPE_BYTES[shape.dtype]) if fp8 else 2 * q) + 2 * kv, 4 * q + 4 * kv
    return {"fwd": forward, "bwd": backward, "fwd_bwd": forward + backward}[mode]



@dataclass(frozen=True)
class Ceilings:
    """This GPU's two roofs, measured in the run: a bf16 matmul's TFLOP/s and a device-to-device
    copy's GB/s; and an e4m3 matmul's TFLOP/s, the compute roof of a provider that computes in
    fp8 (:meth:`in_fp8`). Any may be unknown (a CPU run; no fp8 tensor cores)."""

    tflops: float | None
    gbps: float | None
    fp8_tflops: float | None = None

    def in_fp8(self) -> Ceilings:
        """The roofs of a call whose products run in e4m3."""
        return Ceilings(self.fp8_tflops, self.gbps)

    @property
    def ridge(self) -> float | None:
        """FLOP/B where the two roofs meet: below it a call is memory-bound."""
        return self.tflops * 1e3 / self.gbps if self.tflops and self.gbps else None

    def roof(self, intensity: float) -> float | None:
        """The most TFLOP/s a call of this intensity can reach here."""
        if not (self.tflops and self.gbps):
            return None
        return min(self.tflops, intensity * self.gbps / 1e3)  # FLOP/B x GB/s = GFLOP/s

    def bound(self, intensity: float) -> str | None:
        """memory or compute: the roof that caps a call of this intensity."""
        ridge = self.ridge
        return None if ridge is None else "memory" if intensity < ridge else "compute"


# -- ptxas -v -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PtxasUsage:
    regs: int
    stack_bytes: int  # the local memory per thread; the driver reports the same (Triton's n_spills x 4)
    spill_stores: int
    spill_loads: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict[str, PtxasUsage]:
    """Each entry function's registers and local memory from ``ptxas -v``'s log."""
    found: dict[str, PtxasUsage] = {}
    name, frame = None, None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            name, frame = match.group(1), None
        elif (match := _FRAME.search(line)) and name:
            frame = tuple(int(x) for x in match.groups())
        elif (match := _REGS.search(line)) and name:
            stack, stores, loads = frame or (0, 0, 0)
            found[name] = PtxasUsage(int(match.group(1)), stack, stores, loads)
            name = None
    return found
