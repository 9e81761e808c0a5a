"""The Hopper (sm_90) forward path: an FA3-style Gluon kernel (:mod:`.hopper_jit`), used by
:func:`flashrun.kernels.flash._attn_forward` when it can be, the portable ``_attn_fwd`` otherwise.

When it runs (:func:`eligible`): compiling (not the interpreter), a CUDA device of capability
(9, 0), Triton's Gluon Hopper API with the names and ``warp_specialize`` signature the kernel uses
(checked by feature, :func:`gluon_api`), float16/bfloat16, a (head_dim, causal, key count) that
:data:`GATE` gives a kernel (today head_dim 128 from 2048 keys, or from 512 with 1024 query tiles
of 128 rows, causal from 2048, or 512 with 4096 tiles; 64 from 2048, or 1024 with 1024 tiles,
causal from 2048 with 8192 tiles, from 8192 at any count; 192 and 256 at any length), dense (B, H, N, D) inputs whose last dim is contiguous and whose other strides and
base are 16-byte aligned, plain or causal (bottom-right aligned when Nq != Nk), any GQA group, and
not a flash-decoding shape (few queries, many keys); no window, softcap, ALiBi or packed sequences
(those, and float32, go to the portable kernel).

The first eligible call per (dtype, head_dim) in a process checks every kernel :data:`GATE` uses
at that head_dim against ``_attn_fwd`` on small inputs (:func:`_self_check`, causal and not, a
persistent kernel on two programs so that each loops over several tiles); if one raises or
disagrees the path is off for that (dtype, head_dim) in this process and one warning says why. A check
that passed is remembered on disk (``<FLASHRUN_CACHE_DIR>/hopper-checks.json``) under a key of
everything its verdict depends on - GPU name and capability, driver version, Triton and torch
versions, dtype, head_dim, the gated kernels' configs and a hash of the kernels' sources
(:func:`_verdict_key`) - so later processes skip it (its compiles and runs cost seconds) until
any of those changes; a failed check is not remembered (it runs again in the next process).
``FLASHRUN_HOPPER=0`` (read at each call) or ``ENABLED = False`` forces the portable kernel.
:func:`flashrun.kernels.flash.forward_path` says which path a call would take; :data:`LAST_PATH`
records the path the last forward took.

Kernels (:data:`KERNELS`, fixed launches, not tuned): 64-row query tiles per consumer warpgroup,
two consumers (128-row tiles, 4 + 4 + 1 warps, maxnreg 168 so that setmaxnreg gives the consumers
240 registers and the producer 24) or one (64-row tiles, 4 + 1 warps, maxnreg 200, half the shared
memory so that two programs share an SM); FA3's intra-warpgroup overlap (``overlap``); one program
per tile, or ``persistent``: as many programs as fit on the SMs at once, looping over the tiles
with the next tile's loads prefetched. Shared memory, Q (consumers x 64 rows) + STAGES x (K + V):
  head_dim  64: BLOCK_N 128, 4 stages: 16 KB + 4 x 32 KB = 144 KB
  head_dim 128: BLOCK_N 128, 3 stages: 32 KB + 3 x 64 KB = 224 KB; one consumer, BLOCK_N 64:
                16 KB + 3 x 32 KB = 112 KB (two per SM)
  head_dim 192: two column blocks (128 + 64), BLOCK_N 64, 3 stages: 48 KB + 3 x 48 KB = 192 KB
  head_dim 256: BLOCK_N 64, 2 stages: 64 KB + 2 x 64 KB = 192 KB; BLOCK_N 32, 4 stages: the same
Where it runs was decided by v5's H200 probe (NOTES v5; its script is in git history): at
head_dim 128 the overlapped 3-stage kernel beat the portable one at every length timed (1024 to
16384) but causal 512/1024; at 64 only from 4096 keys (8192 causal: at 1024 the portable
kernel's smaller tiles, several per SM, win: 367 vs 358 TFLOP/s, causal 289 vs 240). Later
probes moved :data:`GATE` to the persistent and one-consumer kernels and to head_dim 192 and 256
(the comments at :data:`GATE`; docs/design/forward.md).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from flashrun.kernels import tuning, warmup
from flashrun.kernels.flash.args import across_heads, tma_aligned
from flashrun.kernels.flash.launch import _current_stream, _Launch, _meta, keep, rebased, template
from flashrun.kernels.tuning import INTERPRETED, cdiv, compiling, launch

log = logging.getLogger("flashrun.hopper")

GLUON_PATH = "gluon-sm90"
TRITON_PATH = "triton"
ENABLED = True  # False: always the portable kernel (FLASHRUN_HOPPER=0 does the same per call)
LAST_PATH: str | None = None  # the path the last forward took (GLUON_PATH or TRITON_PATH)
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class HopperConfig:
    head_dim: int  # the one head_dim the kernel is laid out for
    block_n: int
    stages: int
    overlap: bool = True  # FA3's intra-warpgroup pipelining (QKᵀ of j+1 before softmax of j)
    consumers: int = 2  # 64-row consumer warpgroups per tile: 2 (128-row tiles) or 1 (64-row tiles)
    persistent: bool = False  # programs = what fits on the SMs at once, each looping over tiles
    consumer_regs: int = 240  # with one consumer the compiler gives it what the producer leaves
    producer_regs: int = 24
    # launch cap, registers per thread: 12 warps x 32 x 168 <= 65536 (the consumers take 2 x 128 x 240,
    # the producer's warpgroup 128 x 24); one consumer: 8 warps x 32 x 128 x 2 programs <= 65536
    # (128 x 232 + 128 x 24 = 256 x 128)
    maxnreg: int = 168
    q_regs: bool = False  # Q as QKᵀ's register operand (RS wgmma): S reads only K from shared memory

    @property
    def block_m(self) -> int:
        return 64 * self.consumers


SMEM_LIMIT = 227 * 1024  # an H100/H200 block's dynamic shared memory
SMEM_PER_SM = 228 * 1024  # what the blocks on one SM share (each also reserves 1 KB)


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(HEAD_D0, HEAD_D1): the column blocks the kernel runs head_dim as; HEAD_D1 = 0: one block.
    Register tensors and TMA boxes are powers of two: 192 = 128 + 64."""
    d0 = 1 << (head_dim.bit_length() - 1)
    return (head_dim, 0) if d0 == head_dim else (d0, head_dim - d0)


def smem_bytes(cfg: HopperConfig) -> int:
    """Q's consumer halves and STAGES K and V blocks, 2-byte elements (barriers aside)."""
    return 2 * cfg.head_dim * (cfg.consumers * 64 + cfg.stages * 2 * cfg.block_n)


def launched_threads(cfg: HopperConfig) -> int:
    """Threads a program launches: warp_specialize rounds the partitions (4 warps per consumer, 1
    producer) up to whole warpgroups, as setmaxnreg works per warpgroup."""
    return 128 * (cfg.consumers + 1)


def programs_per_sm(cfg: HopperConfig) -> int:
    """How many programs of this kernel an SM holds at once (shared memory and registers)."""
    by_smem = SMEM_PER_SM // (smem_bytes(cfg) + 2048)
    by_regs = 65536 // (launched_threads(cfg) * cfg.maxnreg)
    return max(1, min(by_smem, by_regs))


# The kernels, by name. H200 probe (NOTES v5), fp16, TFLOP/s at N = 1024 / 4096 / 16384 (full):
# head_dim 128 without overlap (2 stages) 436 / 521 / 544, overlap (2 stages) 374 / 453 / 467,
# overlap with 3 stages 502 / 573 / 615, portable 453 / 513 / 543; head_dim 64 overlap (3 or 4
# stages) 356-358 / 427-430 / 448, portable 367 / 409 / 433. The full sweep (NOTES v5): causal at
# 512/1024 keys the "d128" kernel was 0.76-0.92x of the portable one (a grid of short causal tiles
# exposes each tile's prologue and 3-stage fill), and "d64" slower up to 4096 causal keys. The
# persistent and one-consumer kernels ("-m64"), 192 and 256 are gluon_probe.py's candidates.
KERNELS = {
    "d64": HopperConfig(64, block_n=128, stages=4),
    # Q in registers (NOTES v28): 1.03-1.07x at 1024-16384 keys, full mask; 1.02-1.05x causal to 4096
    "d64-persistent": HopperConfig(64, block_n=128, stages=4, persistent=True, q_regs=True),
    "d64-m64": HopperConfig(64, block_n=128, stages=3, consumers=1, consumer_regs=232, maxnreg=128),
    "d128": HopperConfig(128, block_n=128, stages=3),
    "d128-persistent": HopperConfig(128, block_n=128, stages=3, persistent=True),
    "d128-m64": HopperConfig(128, block_n=64, stages=3, consumers=1, consumer_regs=232, maxnreg=128),
    "d128-m64-persistent": HopperConfig(128, block_n=64, stages=3, consumers=1, consumer_regs=232, maxnreg=128,
                                        persistent=True),
    # 192's 64-key blocks make S's wgmma m64n64k16: from shared memory A and B would take every
    # byte per clock the SM's shared memory gives; Q in registers halves that (NOTES v28)
    "d192": HopperConfig(192, block_n=64, stages=3, q_regs=True),
    "d192-persistent": HopperConfig(192, block_n=64, stages=3, persistent=True, q_regs=True),
    # 96 as 64 + 32 columns, as 192 runs (with Q in registers the persistent one spilled 8-20 B under 3.9)
    "d96": HopperConfig(96, block_n=128, stages=3),
    "d96-persistent": HopperConfig(96, block_n=128, stages=3, persistent=True),
    # 256: two 64-key stages. Overlapped, they lost to the plain loop (d256-base) while a stage's K
    # and V went back together (the producer starved); with K back once S has read it they win
    # (an H100: 1.07-1.23x d256-base). Dropped after that probe: d256-base's persistent twin and a
    # 32-key, 4-stage kernel (slower than d256-base in every cell)
    "d256": HopperConfig(256, block_n=64, stages=2),
    "d256-persistent": HopperConfig(256, block_n=64, stages=2, persistent=True),
    "d256-base": HopperConfig(256, block_n=64, stages=2, overlap=False),
}

# e4m3-only kernels (run_fp8): an e4m3 stage holds twice a bf16 one's keys in the same bytes, which
# no bf16 kernel could fit. An H100 (short_forward_probe.py --cells fp8, two runs, against the
# kernels above with FP8): at 128, 256-key blocks without the overlap (which, holding two S tiles
# of 256 columns, spills) 0.96-1.08x "d128-persistent" from 4096 keys, 0.87-1.04x at 1024 (fp8.py
# keeps 128-key blocks for short causal cells); at 256, 128-key blocks 1.09-1.25x "d256".
# FlashAttention-3 runs 128 x 224 and 128 x 128 tiles there (hopper/tile_size.h).
FP8_KERNELS = {
    "d128-n256-base": HopperConfig(128, block_n=256, stages=2, overlap=False, persistent=True),
    "d256-n128": HopperConfig(256, block_n=128, stages=2),
}

# Where the Gluon forward runs: (head_dim, causal) -> rows (fewest keys, fewest query tiles of
# TILE_ROWS rows over all batch entries and heads, kernel name or None) in increasing key order;
# the last row whose fewest keys <= N_K and fewest tiles <= the call's tiles decides, None or no
# row is the portable kernel. Rows only where the H200 measured the kernel faster than the
# portable one.
GATE: dict[tuple[int, bool], tuple[tuple[int, int, str | None], ...]] = {
    # round 6's H200 probe (NOTES v6; fp16 at 64/128, bf16 at 192/256):
    # where a Gluon kernel beat the portable one; 64 causal keeps v5's row (not re-timed past 4096).
    # Round 14's (benchmarks/probes/short_forward_probe.py, NOTES v14): the persistent kernels also from
    # 1024 keys at 64 (1.03-1.05x the portable kernel) and from 512 at 128 (1.09-1.12x) - with
    # 1024 tiles or more: with 512 or fewer the portable kernel was faster at those lengths
    (64, False): ((1024, 1024, "d64-persistent"), (2048, 0, "d64-persistent")),
    # Round 22's (short_forward_probe.py --cells causal, NOTES v22): the persistent kernels' causal
    # tiles in a serpentine order: causal at 64 from 2048 keys with 8192 tiles (1.00-1.03x the
    # portable at 2048 keys, 1.04-1.07x at 4096; llama-1b's 2048 tiles: 0.96x; 8192 keys keep "d64",
    # not re-timed); at 128 from 1024 keys with 4096 tiles (1.03-1.06x the portable) and from 2048
    # keys with 768 (1.07x "d128"; qwen2-1b's prefill, 768 tiles: 1.11x). Round 26's (--cells causal,
    # NOTES v26, with O stored by TMA): at 128 from 512 keys with 4096 tiles the one-consumer
    # persistent kernel (0.92-0.94x cuDNN, the portable kernel 0.80)
    # Round 28's (--cells causal, NOTES v28, d64-persistent with Q in registers): at 64 also from 1024
    # keys with 8192 tiles (1.07-1.08x the portable kernel) and from 2048 with 2048 (llama-1b's
    # prefill: 1.04x)
    (64, True): ((1024, 8192, "d64-persistent"), (2048, 2048, "d64-persistent"), (8192, 0, "d64")),
    (128, False): ((512, 1024, "d128-persistent"), (2048, 0, "d128-persistent"), (4096, 0, "d128")),
    (128, True): ((512, 4096, "d128-m64-persistent"), (1024, 4096, "d128-persistent"), (2048, 0, "d128"),
                  (2048, 768, "d128-persistent")),
    # Round 27's (short_forward_probe.py --cells d192, NOTES v27, O stored by TMA): 192 causal on the
    # persistent kernel below 8192 keys (1.10x "d192" at 1024 keys, 1.04-1.07x at 2048, 1.01-1.04x at
    # 4096; 0.98x at 8192)
    (192, False): ((0, 0, "d192-persistent"),),
    (192, True): ((0, 0, "d192-persistent"), (8192, 0, "d192")),
    # short_forward_probe.py --cells d96 (5376 tiles, 1024-8192 keys): 96 as 64 + 32 columns,
    # 1.05-1.15x cuDNN on the persistent kernel where the portable one ran 0.83-0.93x; causal from 8192
    # keys on "d96" (1.14-1.16x cuDNN against 1.08-1.10x); shorter than 1024 keys not timed
    (96, False): ((1024, 0, "d96-persistent"),),
    (96, True): ((1024, 0, "d96-persistent"), (8192, 0, "d96")),
    # short_forward_probe.py --cells d256 (2048 tiles, 1024-8192 keys; an H100, once K and V went
    # back to the producer apart): the overlapped kernels 1.07-1.23x "d256-base"; the persistent
    # one below 4096 keys full (1.00-1.04x "d256" at 1024 and 2048) and below 8192 causal
    # (1.04-1.11x; 8192: "d256" 1.01x)
    (256, False): ((0, 0, "d256"), (0, 2048, "d256-persistent"), (4096, 0, "d256")),
    (256, True): ((0, 0, "d256"), (0, 2048, "d256-persistent"), (8192, 0, "d256")),
}
TILE_ROWS = 128
OVERRIDE: HopperConfig | None = None  # benchmarks/probes/short_forward_probe.py forces a kernel through this


def query_tiles(q: torch.Tensor) -> int:
    """The call's query tiles of :data:`TILE_ROWS` rows, over every batch entry and head."""
    return q.shape[0] * q.shape[1] * cdiv(q.shape[2], TILE_ROWS)


def kernel_for(head_dim: int, causal: bool, n_k: int, tiles: int) -> str | None:
    """The :data:`KERNELS` name :data:`GATE` picks, None for the portable kernel."""
    name = None
    for least_keys, least_tiles, kernel in GATE.get((head_dim, causal), ()):
        if n_k >= least_keys and tiles >= least_tiles:
            name = kernel
    return name


def gluon_api() -> str | None:
    """None when this Triton has the Gluon Hopper API the kernel uses, else what is missing."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no Gluon
        return f"no Gluon Hopper API ({type(exc).__name__}: {exc})"
    for owner, names in ((gl, ("warp_specialize", "NVMMADistributedLayout", "DotOperandLayout", "NVMMASharedLayout",
                               "SliceLayout", "allocate_shared_memory", "convert_layout")),
                         (hopper, ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma")),
                         (hopper.mbarrier, ("init", "expect", "wait", "arrive", "MBarrierLayout"))):
        missing = [n for n in names if not hasattr(owner, n)]
        if missing:
            return f"Gluon lacks {', '.join(missing)}"
    # the kernel loads through tma.async_load (later releases) or 3.6's async_copy_global_to_shared,
    # which 3.9 keeps only as a stub that raises
    if not hasattr(hopper.tma, "async_load") and "tensor_desc" not in _params(
            getattr(hopper.tma, "async_copy_global_to_shared", None)):
        return "Gluon has no TMA load (tma.async_load / async_copy_global_to_shared)"
    params = _params(gl.warp_specialize)
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return f"gl.warp_specialize has another signature ({', '.join(params)})"
    return None


def _params(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _disabled_by_env() -> bool:
    return os.environ.get("FLASHRUN_HOPPER", "1").strip().lower() in ("0", "false", "off", "no")


EPOCH = 0  # counts reset(): a forward's route (attention._route_key) made before one is not reused after


def switches() -> tuple:
    """What turns the path on or off or changes its kernel without the inputs changing: part of
    the key under which a forward keeps its route (attention._route_key)."""
    return ENABLED, _disabled_by_env(), OVERRIDE, EPOCH


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant) -> str | None:
    """None when this call may take the Gluon path (before the first-use check), else why not."""
    if not ENABLED or _disabled_by_env():
        return "turned off (FLASHRUN_HOPPER=0 or hopper.ENABLED = False)"
    if INTERPRETED:
        return "Triton's interpreter"
    if q.device.type != "cuda" or _capability(q.device.index or 0) != (9, 0):
        return "not an sm_90 GPU"
    return scope(q, k, v, variant) or _api_reason() or _checked.get((q.dtype, q.shape[-1]))


def scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant) -> str | None:
    """None when the inputs are in the Gluon kernel's scope (any device), else why not."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}"
    if q.dim() != 4 or variant.varlen:
        return "packed sequences"
    if OVERRIDE is None and kernel_for(q.shape[-1], variant.causal, k.shape[2], query_tiles(q)) is None:
        what = f"head_dim {q.shape[-1]}{' causal' if variant.causal else ''}"
        rows = [(keys, tiles) for keys, tiles, name in GATE.get((q.shape[-1], variant.causal), ()) if name]
        reached = [tiles for keys, tiles in rows if keys <= k.shape[2]]
        if reached:
            return f"{what} with fewer than {min(reached)} query tiles of {TILE_ROWS} rows at {k.shape[2]} keys"
        return f"{what} with fewer than {min(keys for keys, _ in rows)} keys" if rows else what
    if variant.window is not None or variant.softcap > 0 or variant.alibi_slopes is not None:
        return "window/softcap/ALiBi"
    if not all(tma_aligned(t) for t in (q, k, v)):
        return "strides or base not 16-byte aligned"
    return None


_api_cache: list = []


def _api_reason() -> str | None:
    if not _api_cache:
        _api_cache.append(gluon_api())
    return _api_cache[0]


# -- launcher -------------------------------------------------------------------------------------


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _smem_layout(box: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA box of shape ``box`` and ``dtype`` (made once: ~13 us
    each in Python, six per forward launch, seven per backward one)."""
    from triton.experimental.gluon import language as gl

    gdtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
              torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gdtype)


def _descriptors(t: torch.Tensor, rows: int, d0: int, d1: int) -> tuple:
    """A 4-D descriptor per column block of ``t`` (boxes of ``rows`` rows); with one block, the
    first stands in for the second."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides = list(t.shape), list(t.stride())
    first = TensorDescriptor(t, shape, strides, [1, 1, rows, d0], _smem_layout((1, 1, rows, d0), t.dtype))
    return first, (TensorDescriptor(t, shape, strides, [1, 1, rows, d1],
                                    _smem_layout((1, 1, rows, d1), t.dtype))
                   if d1 else first)


def launch_args(q, k, v, o, lse, sm_scale: float, causal: bool, cfg: HopperConfig, sms: int,
                programs: int | None = None, descales: tuple | None = None):
    """(grid, positional args, constexprs, options) of one launch on a GPU of ``sms`` SMs;
    ``programs`` caps a persistent grid (the first-use check: several tiles per program). Shared
    by the launcher and tests/compile_hopper.py (which compiles them for sm_90 without a GPU).
    The first PER_CALL positional arguments are the ones that change between calls of a plan.
    ``descales``: e4m3 q, k, v (k in 16-key groups, v seq-contiguous, as ``quantize_qkv`` writes them)
    and their float32 descales (per batch and kv head, or scalars), into a bf16 ``o`` (FP8)."""
    from flashrun.kernels.flash.hopper_jit import HALF_M, LOG2E

    z, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    d0, d1 = split_head_dim(d)
    fp8 = descales is not None
    out = not fp8 and tma_out(o, cfg, n_q, n_k, causal)
    v_descs = _descriptors(v, cfg.block_n, d0, d1) if not fp8 else (_transposed_descriptor(v, d0, cfg.block_n),) * 2
    scales = ((*descales, descales[0].stride(0), descales[0].stride(1)) if fp8 and descales[0].dim() == 2 else
              (*descales, 0, 0) if fp8 else (None, None, None, 0, 0))
    # (the kernel's P_REGS: an fp8 loop without the overlap reads K in 16-key groups)
    k_groups = fp8 and not cfg.overlap
    k_descs = (_key_group_descriptor(k, cfg.block_n),) * 2 if k_groups else _descriptors(k, cfg.block_n, d0, d1)
    args = (*_descriptors(q, HALF_M, d0, d1), *k_descs,
            *v_descs, o, lse, *(_descriptors(o, HALF_M, d0, d1) if out else (None, None)),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1), z, h, n_q, n_k, sm_scale * LOG2E, *scales)
    constexprs = dict(GROUP=h // h_kv, HEAD_D0=d0, HEAD_D1=d1, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      CONSUMERS=cfg.consumers, CAUSAL=bool(causal), OVERLAP=cfg.overlap,
                      CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                      # (a constexpr: one more runtime value spilled head_dim 256's consumers on Triton 3.9)
                      ACROSS=bool(causal and across_heads(z * h, n_k, d, q.dtype, h_kv / h, "kv")), TMA_O=out,
                      Q_REGS=cfg.q_regs and not fp8, FP8=fp8)
    tiles = cdiv(n_q, cfg.block_m) * z * h
    if cfg.persistent:
        tiles = min(tiles, programs or sms * programs_per_sm(cfg))
    return (max(tiles, 1),), args, constexprs, {"num_warps": 4, "maxnreg": cfg.maxnreg}


def _key_group_descriptor(k: torch.Tensor, block_n: int):
    """A descriptor over e4m3 ``k`` (B, H_KV, N, D) laid out as :func:`~flashrun.kernels.flash.fp8.key_groups`
    writes it (each head's rows padded to a multiple of 16, heads and batches contiguous) as the 5-D
    (B H_KV N' / 16, 2, 4, 2, D) tensor of 16-key groups with key 4i + 2g + j of a group at [., g, i,
    j]: a box of block_n keys lands in shared memory with key 16a + 4i + 2g + j in row 16a + 8g + 2i
    + j, the order ``hopper_jit._key_columns`` reads S's columns in."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = k.shape[3]
    if k.stride(3) != 1 or k.stride(2) != d or k.stride(1) % (16 * d) or k.stride(0) != k.shape[1] * k.stride(1):
        raise ValueError(f"k (strides {k.stride()}) is not laid out in 16-key groups: pass it through fp8.key_groups")
    groups = k.shape[0] * k.shape[1] * (k.stride(1) // d) // 16
    box = (block_n // 16, 2, 4, 2, d)
    return TensorDescriptor(k, [groups, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], list(box),
                            _smem_layout(box, k.dtype))


def _transposed_descriptor(v: torch.Tensor, d0: int, block_n: int):
    """A descriptor over seq-contiguous ``v`` (B, H_KV, N, D) as the (B, H_KV, D, N) tensor it is in
    memory, boxes [1, 1, d0, block_n]: Vᵀ tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    vt = v.transpose(2, 3)
    return TensorDescriptor(vt, list(vt.shape), list(vt.stride()), [1, 1, d0, block_n],
                            _smem_layout((1, 1, d0, block_n), v.dtype))


def fp8_kernel(name: str) -> HopperConfig:
    """The e4m3 forward's kernel ``name``: one of :data:`FP8_KERNELS` or of :data:`KERNELS`."""
    return FP8_KERNELS.get(name) or KERNELS[name]


def run_fp8(q8, k8, v8, q_descale, k_descale, v_descale, sm_scale: float, causal: bool,
            cfg: HopperConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): the e4m3 forward through ``cfg``'s Gluon kernel (``FP8``): q8, k8 e4m3 (B, H, N, D),
    k8 in 16-key groups and v8 seq-contiguous as :func:`~flashrun.kernels.flash.fp8.quantize_qkv` writes them, float32
    descales per (batch, kv head) or scalars; O bf16. Head dims of one column block; not yet in
    :func:`flashrun.kernels.flash_attention_fp8`'s route (``short_forward_probe.py --cells fp8``
    times it on a GPU first)."""
    from flashrun.kernels.flash.hopper_jit import _fa3_fwd

    o = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(q8.shape[:3], dtype=torch.float32, device=q8.device)
    descales = tuple(torch.as_tensor(d, dtype=torch.float32, device=q8.device) for d in
                     (q_descale, k_descale, v_descale))
    grid, args, constexprs, options = launch_args(q8, k8, v8, o, lse, sm_scale, causal, cfg,
                                                  _sm_count(q8.device.index or 0), descales=descales)
    launch(_fa3_fwd, grid, *args, **constexprs, **options)
    return o, lse


PER_CALL = 10  # _fa3_fwd's arguments that change from call to call: six descriptors, O, LSE, O's two


def tma_out(o: torch.Tensor, cfg: HopperConfig, n_q: int, n_k: int, causal: bool) -> bool:
    """Whether the kernel stores O by TMA through the tile's last stage (``TMA_O``,
    ``hopper_jit._store_through``): the overlapped loop, key blocks of at least a consumer's 64
    rows, a descriptor can take O, and every tile sees a key (a stage to store through: some
    key, and causal no fewer keys than queries). A consumer's rows go through the K tile, or
    where it holds fewer than the tile's rows (head_dim 192 and 256: 64 keys, two consumers),
    the second's through the V tile. H200, every one-block Gluon kernel at every causal cell of
    short_forward_probe.py, 2-16 % faster than stores from the accumulator (NOTES v26)."""
    return cfg.overlap and cfg.block_n >= 64 and tma_aligned(o) and n_k >= (n_q if causal else 1)


@dataclass(frozen=True)
class _Plan:
    """One (shapes, strides, dtype, alignment, scale, causal, kernel) of :func:`_run_gluon`:
    everything but the descriptors' tensors and the outputs, so that later calls skip Triton's
    per-call specialization (:class:`~flashrun.kernels.flash.launch._Launch`) and the descriptors'
    checks (:func:`~flashrun.kernels.flash.launch.rebased`). On the H200 a call through
    Triton's path cost ~160 us of host time, more than the kernel at 4 x 2048 (0.124 ms):
    back-to-back calls ran at the host's pace (NOTES v12)."""

    launch: _Launch
    descriptors: tuple  # the first call's (first, second) column-block descriptors of q, k and v, as templates
    out: tuple | None  # O's (first, second) descriptors (tma_out), as templates, or None

    def run(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _outputs(q)
        args = [d for t, pair in zip((q, k, v), self.descriptors) for d in _rebased_pair(pair, t)]
        out = (None, None) if self.out is None else _rebased_pair(self.out, o)
        self.launch(_current_stream(q.device), *args, o, lse, *out)
        return o, lse


def _rebased_pair(pair: tuple, t: torch.Tensor) -> tuple:
    """A plan's (first, second) column-block descriptor templates over ``t`` (one column block:
    the first twice)."""
    first, second = pair
    d0 = rebased(first, t)
    return d0, d0 if second is first else rebased(second, t)


_plans: dict[tuple, _Plan] = {}


def _outputs(q) -> tuple[torch.Tensor, torch.Tensor]:
    """O laid out like q (a model's (B, N, H, D) view comes back as one; the kernel stores
    through O's strides) and the float32 (B, H, N) LSE."""
    return (torch.empty_like(q), torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32,
                                             device=q.device))


def _run_gluon(q, k, v, sm_scale: float, causal: bool, cfg: HopperConfig,
               programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from flashrun.kernels.flash.hopper_jit import _fa3_fwd

    lean = programs is None and not compiling()  # a capped grid (the check) and compile-only runs: Triton's path
    key = (_meta(q), _meta(k), _meta(v), sm_scale, causal, cfg)
    plan = _plans.get(key) if lean else None
    if plan is not None:
        return plan.run(q, k, v)
    o, lse = _outputs(q)
    grid, args, constexprs, options = launch_args(q, k, v, o, lse, sm_scale, causal, cfg,
                                                  _sm_count(q.device.index or 0), programs)
    if not lean:
        launch(_fa3_fwd, grid, *args, **constexprs, **options)
        return o, lse
    ordered = list(args) + [constexprs[name] for name in _fa3_fwd.arg_names[len(args):]]
    kept = {id(d): template(d) for d in (*args[:6], *args[8:10])}  # (a descriptor given twice stays one template)
    plan = _Plan(_Launch(_fa3_fwd, grid, tuple(ordered[PER_CALL:]), options),
                 tuple((kept[id(args[i])], kept[id(args[i + 1])]) for i in (0, 2, 4)),
                 (kept[id(args[8])], kept[id(args[9])]) if args[8] is not None else None)
    plan.launch(_current_stream(q.device), *args[:PER_CALL])  # through Triton: compiles, keeps the kernel
    keep(_plans, key, plan)
    return o, lse


RUN = _run_gluon  # the kernel the path calls; the tests swap in a failing one


def planned(q, k, v, sm_scale: float, causal: bool) -> _Plan | None:
    """The plan :func:`forward` keeps for these inputs (None where it keeps none: before a lean
    call, or with another :data:`RUN`)."""
    return _plans.get((_meta(q), _meta(k), _meta(v), sm_scale, causal, _config(q, k, causal)))


def forward(q, k, v, sm_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` through the Gluon kernel :data:`GATE` picks (or :data:`OVERRIDE`); call only
    where :func:`eligible` and :func:`ensure_checked` allow it."""
    return RUN(q, k, v, sm_scale, causal, _config(q, k, causal))


def _config(q, k, causal: bool) -> HopperConfig:
    return OVERRIDE if OVERRIDE is not None else KERNELS[kernel_for(q.shape[-1], causal, k.shape[2], query_tiles(q))]


# -- first use: check against the portable kernel -------------------------------------------------


# (dtype, head_dim) -> why the path is off after its first-use check there (None: it passed)
_checked: dict[tuple[torch.dtype, int], str | None] = {}

# Max-abs bounds against the portable kernel on the check's inputs (randn, N = 200): both
# accumulate in float32 and round P to the input dtype before P·V, in different key orders and
# block sizes, so they differ by a few units in the last place of O (|O| < ~1): fp16's is 2^-11,
# bf16's 2^-8. The bounds are ~8-16 such units; a wrong mask or tile gives errors of order 0.1-1.
CHECK_ATOL = {torch.float16: 8e-3, torch.bfloat16: 3e-2}
CHECK_SHAPE = (1, 2, 200)  # (batch, heads, N): 2-4 query tiles per head, a ragged last tile and key block
CHECK_PROGRAMS = 2  # a persistent kernel's grid in the check: each program loops over several tiles


def gated_kernels(head_dim: int) -> list[str]:
    """The :data:`KERNELS` that :data:`GATE` uses at this head_dim (what the first-use check runs)."""
    names = [name for (d, _), rows in sorted(GATE.items()) if d == head_dim for _, _, name in rows if name]
    return list(dict.fromkeys(names))


def _self_check(device, dtype, head_dim, portable) -> str | None:
    """None when every gated Gluon kernel at this head_dim (or :data:`OVERRIDE`) agrees with
    ``portable(q, k, v, sm_scale, causal) -> (o, lse)`` on small inputs of this dtype and
    head_dim, causal and not, else what went wrong. While compiling ahead
    (:func:`~flashrun.kernels.tuning.compiling`) the launches only compile, so nothing is compared."""
    kernels = {"override": OVERRIDE} if OVERRIDE else {name: KERNELS[name] for name in gated_kernels(head_dim)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    z, h, n = CHECK_SHAPE
    for name, cfg in kernels.items():
        for causal in (False, True):
            q, k, v = (torch.randn(z, h, n, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
            scale = head_dim ** -0.5
            try:
                o, lse = RUN(q, k, v, scale, causal, cfg, CHECK_PROGRAMS if cfg.persistent else None)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001 - any failure turns the path off
                last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
                return f"the Gluon kernel {name} raised {type(exc).__name__}: {last}"
            o_ref, lse_ref = portable(q, k, v, scale, causal)
            if compiling():
                continue
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_l = (lse - lse_ref).abs().max().item()
            label = f"N={n} D={head_dim} {'causal' if causal else 'full'}"
            if not (err_o <= CHECK_ATOL[dtype] and err_l <= 1e-3):  # NaN fails too
                return (f"the Gluon kernel {name} disagrees with the portable one ({label}: max |dO| {err_o:.3g}, "
                        f"max |dLSE| {err_l:.3g})")
    return None


def ensure_checked(device, dtype, head_dim, portable, then=None) -> bool | None:
    """Run the first-use check once per process, dtype and head_dim - unless it passed before
    for the same :func:`_verdict_key`; True when the path stays on, None while the check is
    still compiling in the background (:func:`first_use`; ``then``: the call's own launches,
    compiled with it). While compiling ahead the check's kernels are compiled (its launches
    handed over like any other), nothing runs, and the path is taken as on: the check itself
    runs on the first real call."""
    key = (dtype, head_dim)
    if key in _checked:
        return _checked[key] is None
    verdict = _verdict_key(device, dtype, head_dim)
    if verdict is not None and verdict in _passed():
        _checked[key] = None
        log.info("forward path %s for %s, head_dim %d (its first-use check passed before on this GPU, driver, "
                 "Triton and kernel sources: %s)", GLUON_PATH, str(dtype).removeprefix("torch."), head_dim,
                 _verdicts_path())
        return True
    passed = first_use(_checked, key, lambda: _self_check(device, dtype, head_dim, portable), "forward", then)
    if passed and verdict is not None and not compiling():
        _remember_pass(verdict, device, dtype, head_dim)
    return passed


# key -> (the batch compiling a first-use check's kernels in the background, those kernels)
_background: dict[tuple, tuple[warmup.Batch, list[warmup.Compile]]] = {}


def background() -> bool:
    """Whether a first use with no verdict yet checks in the background (the library's default)
    rather than waiting: ``FLASHRUN_FIRST_USE=wait`` waits, as flashrun's commands do (they judge
    and time the fast path, and compile it ahead anyway: :func:`flashrun.device.select`)."""
    return os.environ.get("FLASHRUN_FIRST_USE", "background").strip().lower() != "wait" and warmup.available()


def first_use(checked: dict, key: tuple, check, what: str, then=None) -> bool | None:
    """A Gluon path's first-use check for ``key`` (dtype, head_dim, ...): ``check()`` says why the
    kernel disagrees with the portable one, or None; the verdict is kept in ``checked`` and said
    once (a warning when off, -v when on). True when the path stays on, False when off.

    In the background (:func:`background`) a first use does not wait for the Gluon compiles:
    the check's kernels, and ``then()``'s (the call's own launches), go to the compile pool, the
    call runs the portable kernel, and so do later calls (None: undecided, no route kept) until
    those kernels are ready; the first call after that runs the check (a few small launches)
    and decides. Waiting, the first use compiles and checks at once.

    While compiling ahead the check's kernels are only compiled, nothing is kept, and the path
    is taken as on - unless checks run in the background: then the portable kernel is what the
    call runs until the verdict (None). Under CUDA-graph capture nothing is started or run (None)."""
    if compiling():
        if background():
            return None
        check()
        return True
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None  # a check's launches and syncs would break the capture: the portable kernel is captured
    pending = _background.get(key)
    if pending is None and background():
        batch = warmup.Batch()
        try:
            pending = _background[key] = (batch, batch.collect(lambda: (check(), then and then())))
        except Exception as exc:  # noqa: BLE001 - listing failed: the check runs now and says what is wrong
            log.debug("first-use check of the %s not listed ahead: %s: %s", what, type(exc).__name__, exc)
        else:
            log.info("%s path %s for %s, head_dim %d: compiling its first-use check in the background; the portable "
                     "Triton kernel runs until it is decided", what, GLUON_PATH, str(key[0]).removeprefix("torch."),
                     key[1])
    if pending is not None:
        batch, kernels = pending
        if not all(c.ready.is_set() for c in kernels):
            return None
        batch.wait(kernels)
        del _background[key]
    reason = check()
    checked[key] = f"disabled after its first-use check: {reason}" if reason else None
    dtype, head_dim = str(key[0]).removeprefix("torch."), key[1]
    if reason:
        log.warning("flashrun: the Gluon sm_90 %s is off for %s, head_dim %d in this process (%s); the "
                    "portable Triton kernel is used", what, dtype, head_dim, reason)
    else:  # shown with -v
        log.info("%s path %s for %s, head_dim %d (agreed with the portable kernel on its first use)",
                 what, GLUON_PATH, dtype, head_dim)
    return reason is None


# -- the first-use check's verdicts, kept across processes ----------------------------------------


def _verdicts_path() -> Path:
    return tuning.cache_root() / "hopper-checks.json"


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``), else the CUDA
    version the driver supports (as torch reads it); None when neither can be read."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return " ".join(first.split())
    except (OSError, IndexError):
        pass
    read = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        return f"cuda driver api {read()}" if read is not None else None
    except Exception:  # noqa: BLE001 - no driver to ask: no verdict is kept
        return None


_sources: list[str] = []


def _sources_hash() -> str:
    """sha256 over the sources of every kernel the check runs or compares against (this folder:
    the Gluon kernel, the portable forward and their helpers; tuning.py: the portable config)."""
    if not _sources:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")) + [Path(tuning.__file__)]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        _sources.append(digest.hexdigest())
    return _sources[0]


def _verdict_key(device, dtype, head_dim) -> str | None:
    """What a first-use verdict depends on, hashed; None when it cannot be pinned down (no
    driver version): then the check runs in every process."""
    driver = _driver_version()
    if driver is None or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    parts = (props.name, f"sm{props.major}{props.minor}", driver, f"triton {triton.__version__}",
             f"torch {torch.__version__}", str(dtype), f"d{head_dim}", repr([KERNELS[name] for name in gated_kernels(head_dim)]), _sources_hash())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _passed() -> dict:
    try:
        data = json.loads(_verdicts_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember_pass(verdict: str, device, dtype, head_dim: int) -> None:
    from flashrun.records.files import atomic_write_json

    passed = _passed()
    passed[verdict] = {"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim,
                       "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                       "triton": triton.__version__,
                       "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        atomic_write_json(_verdicts_path(), passed)
    except OSError as exc:  # a read-only home must not break a run: the check runs again next time
        log.warning("could not save the first-use check's verdict in %s: %s", _verdicts_path(), exc)


def reset() -> None:
    """Forget the first-use checks and the last path (tests)."""
    global LAST_PATH, EPOCH
    _checked.clear()
    _background.clear()
    LAST_PATH = None
    EPOCH += 1
