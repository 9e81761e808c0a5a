"""The Hopper (sm_90) backward path: an FA3-layout Gluon kernel (:mod:`.hopper_bwd_jit`,
NOTES v6 "Design 2", v8, v10), used by :func:`flashrun.kernels.flash._attn_backward`
when it may be: in the deterministic backward for dK and dV (:data:`DEFAULT`; dQ stays with the
portable ``_attn_bwd_dq``), in the atomic and the default backward for dQ too (:data:`FUSED`:
each step's dQ tile added into a float32 buffer by a TMA reduce-add, 5 matmuls per tile pair;
on the H200 1.07-1.15x the deterministic Gluon path, NOTES v10).

**On by default on sm_90** since the H200 checked and timed it (NOTES v9: 93 cases
right against float64; dK/dV 1.3-1.5x faster than the portable kernel's GPU time, the backward
1.09-1.23x faster at 2k-8k tokens). ``FLASHRUN_HOPPER_BWD=0`` or ``FLASHRUN_HOPPER=0`` (both read
at each call; the second turns off both Gluon paths) keeps the portable dK/dV; ``=1`` forces it on
where :data:`DEFAULT_ON` is False.

When it runs (:func:`eligible`): turned on, compiling (not the interpreter), a CUDA device of
capability (9, 0), Triton's Gluon Hopper API (the forward's feature check,
:func:`flashrun.kernels.flash.hopper.gluon_api`), float16/bfloat16, head_dim 64 or 128 (or 80 and 96
as two column blocks, 64 + 16 and 64 + 32, as the Gluon forward runs 192; and 192 = 128 + 64 and
256 = 128 + 128, dK/dV only, on the transposed kernel below), dense
(B, H, N, D) inputs whose last dim is contiguous and whose other strides and base are 16-byte
aligned (TMA descriptors), plain, causal or a window (bottom-right aligned when Nq != Nk), any GQA
group; no packed sequences (those, float32 and other head dims keep the portable dK/dV kernel).
Softcap and ALiBi (each, both, with or without a window) run on the untransposed kernels (with dQ
inside: all but ALiBi with a window), a softcap alone on the transposed one (:func:`takes_variants`;
``FLASHRUN_HOPPER_BWD_VARIANTS=0`` turns them off).

The first eligible call per (dtype, head_dim, with dQ or not, with a window or not, with a softcap
or not, with ALiBi or not) in a process compares the kernel with the portable backward on small
inputs (:func:`_self_check`: causal and not, or two windows, GQA 2:1, a ragged tail, the variants
at a low cap and the standard slopes); if it raises or disagrees the path is off for that key in
this process and one warning says why.

Kernels (:data:`KERNELS`, fixed launches; :data:`DEFAULT` picks one per head_dim): 128-key blocks,
two consumer warpgroups of 64 keys at 240 registers and a producer warp at 24 (maxnreg 168 so that
12 warps fit the register file: 2 x 128 x 240 + 128 x 24 <= 65536), 64-row query blocks in a ring
of 2 (``d128-s3``: 3) stages. Shared memory, K + V (128 rows) + STAGES x (Q + dO) (64 rows) of
2-byte elements + STAGES x (LSE + delta) (64 float32):
  head_dim  64: 32 KB + 2 x 16 KB + 1 KB = 65 KB
  head_dim 128: 64 KB + 2 x 32 KB + 1 KB = 129 KB (3 stages: 161.5 KB)
  head_dim  96: 48 KB + 2 x 24 KB + 1 KB = 97 KB (each tile as a 64- and a 32-column box)
With dQ inside add 32 KB of dSᵀ stages and one float32 dQ tile per consumer (64 rows; at head_dim
96 consumer 0 adds dQ's first 64 columns, consumer 1 its last 32).
head_dim 192 (``d192``, :func:`hopper_bwd_jit._fa3_bwd_dkdv_t`): dK and dV transposed, two consumers of
32 keys (64-key blocks), dQ's steps in turns in 64-column tiles: K + V 48 KB, 2 x (Q + dO) 96 KB, P
and two dS stages 24 KB, 2 float32 dQ tiles 32 KB, LSE and delta 1 KB (202 KB; NOTES v25).
One program per SM either way (the registers), so the grid is cdiv(N_K, block_n) x H_KV x B programs
(x the GQA split, :func:`dkdv`: :data:`SPLIT_WAVES`; the parts add into one float32 head where the
backward need not be repeatable, ``args.split_outputs``). Causal or windowed, where all heads' Q
and dO are few enough (``args.across_heads``), the key blocks go on the grid's last axis, H_KV x B
x cdiv(N_K, block_n), so that every head's first key blocks, the heaviest, start first.
dK and dV, where they are the gradients themselves (:func:`tma_out`), leave through the consumers'
K and V tiles by the producer's TMA stores: stored from the wgmma accumulators they cost the kernel
14-23 % at 1024 keys (NOTES v25). With dQ inside, a split group's float32 adds go by TMA reduce-adds
through each consumer's dQ tile (one column block, keys as rows; NOTES v26); float32 partials, and
the adds of the deterministic backward and of the other kernels, keep the consumers' stores.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from flashrun.kernels.flash import hopper
from flashrun.kernels.flash.args import (
    across_heads,
    alibi_slopes,
    split_adds,
    split_outputs,
    split_result,
    tma_aligned,
)
from flashrun.kernels.flash.launch import _current_stream, _Launch, _meta, keep, rebased, template
from flashrun.kernels.tuning import INTERPRETED, cdiv, compiling, launch


DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)  # 80, 96, 192 and 256 as two column blocks, 64 + 16, 64 + 32, 128 + 64
# and 128 + 128 (:func:`BwdConfig.blocks`); 192 and 256 on the transposed kernel (:attr:`BwdConfig.transposed`);
# a head dim runs where DEFAULT (FUSED with dQ inside) names a kernel for it
DEFAULT_ON = True  # measured on the H200 (NOTES v9); FLASHRUN_HOPPER_BWD=0 or FLASHRUN_HOPPER=0 turns it off
ENV = "FLASHRUN_HOPPER_BWD"
# softcap and ALiBi on the Gluon kernel (the transposed one, 192 and 256: a softcap): on unless
# FLASHRUN_HOPPER_BWD_VARIANTS=0 (the first-use check guards each dtype, head dim and variant)
VARIANTS_ENV = "FLASHRUN_HOPPER_BWD_VARIANTS"
# ... and on the kernels with dQ inside that split its columns (80, 96, 128: the atomic backward's) as
# the H200 timed them (takes_variants); =0 keeps the variants off those kernels, =1 puts them all on
FUSED_VARIANTS_ENV = "FLASHRUN_HOPPER_BWD_FUSED_VARIANTS"
SOFTCAP_MAX = 256.0  # the portable kernels' fast tanh up to here (args.SOFTCAP_FAST_CAP): the one this kernel has
FUSED_PATH = hopper.GLUON_PATH + "+dq"  # the Gluon kernel with dQ inside (the non-deterministic backward)
LAST_PATH: str | None = None  # the last backward's dK/dV path: GLUON_PATH, FUSED_PATH or TRITON_PATH


@dataclass(frozen=True)
class BwdConfig:
    head_dim: int
    block_m: int = 64  # query rows per stage (wgmma's N for Sᵀ and dPᵀ)
    stages: int = 2  # Q/dO ring depth
    consumers: int = 2  # 64-key consumer warpgroups: the key block is 64 x consumers
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168  # launch cap: 12 warps x 32 x 168 <= 65536 (see the module docstring)
    dq_split: bool = False  # dQ inside (non-deterministic): each consumer half its columns every
    # step (a head dim of two column blocks: consumer c block c), else the consumers take whole
    # steps in turns
    keys: int = 64  # keys per consumer; below 64 the kernel is _fa3_bwd_dkdv_t (dK, dV transposed,
    # keys as wgmma's N), which takes the steps' dQ in turns, DQ_COLS columns at a time

    @property
    def transposed(self) -> bool:
        return self.keys < 64

    @property
    def blocks(self) -> tuple[int, int]:
        """(HEAD_D, HEAD_D1): the head dim's column blocks, a power of two and the rest (0: one
        block), as the Gluon forward splits 192 (``hopper.split_head_dim``): 96 = 64 + 32; 256 on the
        transposed kernel as 128 + 128 (its loops tile both blocks in 64-column dQ tiles)."""
        if self.transposed and self.head_dim == 256:
            return 128, 128
        return hopper.split_head_dim(self.head_dim)

    @property
    def dq_cols(self) -> tuple[int, ...]:
        """The widths of the dQ tiles the consumers add (one per consumer, or one both take in turns)."""
        d0, d1 = self.blocks
        if self.transposed:
            return (DQ_COLS,)
        if not self.dq_split:
            return (self.head_dim,)
        return (d0, d1) if d1 else (d0 // 2, d0 // 2)

    @property
    def block_n(self) -> int:
        return self.keys * self.consumers

    @property
    def kernel(self):
        """The Gluon kernel this config launches."""
        from flashrun.kernels.flash import hopper_bwd_jit

        return hopper_bwd_jit._fa3_bwd_dkdv_t if self.transposed else hopper_bwd_jit._fa3_bwd_dkdv


SMEM_LIMIT = hopper.SMEM_LIMIT
DQ_COLS = 64  # hopper_bwd_jit.DQ_COLS (kept here so that the configs need no Triton import)

KERNELS = {
    "d64": BwdConfig(64),
    "d128": BwdConfig(128),
    "d128-s3": BwdConfig(128, stages=3),
    "d64-dqs": BwdConfig(64, dq_split=True),
    "d128-dqs": BwdConfig(128, dq_split=True),
    "d80": BwdConfig(80),
    "d96": BwdConfig(96),
    "d80-dqs": BwdConfig(80, dq_split=True),
    "d96-dqs": BwdConfig(96, dq_split=True),
    "d192": BwdConfig(192, keys=32),
    # 256 = 128 + 128 as 192: K + V 64 KB, two stages of Q and dO 128 KB, P and dS 24 KB (217 KB; no room
    # for the dQ tiles, so dQ stays portable). Spill-free for sm_90 under Triton 3.9; under 3.6 the
    # GQA 1:1 launch (dK/dV handed to the producer's TMA stores) spills 16 B. Right on the H200
    # (gluon_bwd_probe.py --kernels d256: 39 cases against float64, N = 1 to 1025, GQA, windows).
    # A twin with 16 keys per consumer (room for dQ inside, 210 KB) ran slower on the H200, with dQ
    # inside or not (causal N4096: 191 and 207 TFLOP/s against 255; backward-d256 probe): dropped.
    "d256": BwdConfig(256, keys=32),
}
# what the path runs; benchmarks/probes/gluon_bwd_probe.py times the rest
DEFAULT = {64: "d64", 80: "d80", 96: "d96", 128: "d128", 192: "d192", 256: "d256"}
# with dQ inside (the non-deterministic backward's), NOTES v10: at head_dim 64 the consumers take
# whole steps' dQ in turns (d64 399 TFLOP/s against d64-dqs 359, causal N8192), at 128 each takes
# half the columns every step (whole-width tiles spill), at 80 and 96 each its column block (NOTES v19)
FUSED = {64: "d64", 80: "d80-dqs", 96: "d96-dqs", 128: "d128-dqs", 192: "d192"}
OVERRIDE: BwdConfig | None = None  # the probe runs its variants through the path with this


def kernel_for(head_dim: int, fused: bool = False) -> str | None:
    return (FUSED if fused else DEFAULT).get(head_dim)


def _config(head_dim: int, fused: bool) -> BwdConfig:
    return OVERRIDE if OVERRIDE is not None else KERNELS[kernel_for(head_dim, fused)]


def smem_bytes(cfg: BwdConfig, fused: bool = False) -> int:
    """K and V (block_n rows), STAGES x (Q + dO) (block_m rows) of 2-byte elements, and STAGES x
    (LSE + delta) (block_m float32 each); ``fused`` (dQ inside): 2 x 2 dSᵀ tiles (64 x block_m,
    2-byte) and the float32 dQ tiles (block_m x dq_cols); the barriers aside. Transposed
    (:attr:`BwdConfig.transposed`): a P and 2 dS tiles per consumer (block_m x keys) always, and
    with dQ each consumer's float32 dQ tile (block_m x DQ_COLS)."""
    base = 2 * cfg.head_dim * (2 * cfg.block_n + cfg.stages * 2 * cfg.block_m) + cfg.stages * 2 * cfg.block_m * 4
    if cfg.transposed:
        dq = cfg.block_m * DQ_COLS * 4 if fused else 0
        return base + cfg.consumers * (3 * cfg.block_m * cfg.keys * 2 + dq)
    tiles = cfg.dq_cols if cfg.dq_split else cfg.dq_cols * cfg.consumers  # (in turns: one each, whole width)
    return base + (4 * 64 * cfg.block_m * 2 + cfg.block_m * sum(tiles) * 4 if fused else 0)


def fusable(cfg: BwdConfig) -> bool:
    """Whether the kernel can take dQ inside: two consumers (dQ's steps are shared between them),
    dQ tiles of at most 64 columns (a 64 x 128 float32 accumulator, 64 registers a thread beside
    dK and dV, spilled 68-132 B: tests/compile_hopper_bwd.py), each consumer its own column block
    where the head dim has two (transposed: 64-column tiles in turns), and shared memory for them."""
    return (cfg.consumers == 2 and max(cfg.dq_cols) <= 64 and (cfg.dq_split or cfg.transposed or not cfg.blocks[1])
            and smem_bytes(cfg, fused=True) <= SMEM_LIMIT - 2048)


def variants_reason(head_dim: int, fused: bool, variant) -> str | None:
    """None when the call has no softcap or ALiBi, or the kernel for it takes them, else why not."""
    if variant.softcap == 0 and variant.alibi_slopes is None:
        return None
    if not variants_on():
        return f"softcap/ALiBi (turned off: {VARIANTS_ENV}=0)"
    if variant.softcap > SOFTCAP_MAX:
        return f"softcap {variant.softcap:g} > {SOFTCAP_MAX:g} (the precise tanh)"
    cfg = KERNELS.get(kernel_for(head_dim, fused) or "")
    alibi = variant.alibi_slopes is not None
    if cfg is None or not takes_variants(cfg, alibi, window=variant.window is not None):
        return f"{'ALiBi' if alibi else 'softcap'} at head_dim {head_dim}" + (" with dQ inside" if fused else "")
    return None


def takes_variants(cfg: BwdConfig, alibi: bool = True, window: bool = False) -> bool:
    """Whether the kernel runs the score variants (``alibi``: ALiBi too, else a softcap alone;
    ``window``: with a sliding window). The transposed kernel (192, 256) a softcap only (its
    scores are S, not Sᵀ: ALiBi's per-key split would be per query there). One whose consumers
    split dQ's columns every step (``dq_split``: 80, 96, 128 with dQ inside) a softcap, and ALiBi
    without a window: on the H200 (causal, N=8192, D=128, bf16; the ``variants-backward`` claim)
    it ran ALiBi, a softcap and both 1.13x, 1.23x and 1.27x faster than the deterministic dK/dV
    kernel with the portable dQ, a softcap with a window 1.21x, but ALiBi with a window 0.88x and
    with a softcap too 0.97x. ``FLASHRUN_HOPPER_BWD_FUSED_VARIANTS=0`` keeps the variants off those
    kernels, ``=1`` puts them all on. Other calls keep the deterministic Gluon dK/dV with the
    portable dQ, or the portable backward. Compiled for sm_90 without a spill under 3.9; under 3.6
    the head_dim 128 kernel spills 8 B with ALiBi and a split GQA group, 4-12 B with ALiBi and a
    window; the dq_split kernels are spill-free at 80 and 96 with a softcap or ALiBi (both at 96:
    32-52 B with one kv head a program), at 128 with a softcap under 3.9 but 44-88 B under 3.6,
    with ALiBi 20-104 B."""
    if cfg.transposed:
        return not alibi
    if not cfg.dq_split:
        return True
    asked = os.environ.get(FUSED_VARIANTS_ENV, "").strip().lower()
    if asked in ("0", "false", "off", "no"):
        return False
    return asked in ("1", "true", "on", "yes") or not (alibi and window)


def launched_threads(cfg: BwdConfig) -> int:
    """warp_specialize rounds the partitions (4 warps per consumer, 1 producer) up to warpgroups."""
    return 128 * (cfg.consumers + 1)


def enabled() -> bool:
    """FLASHRUN_HOPPER_BWD=1 turns it on, =0 off; FLASHRUN_HOPPER=0 (both Gluon paths) off; else
    :data:`DEFAULT_ON`."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("0", "false", "off", "no") or hopper._disabled_by_env():
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    return DEFAULT_ON


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, variant,
             fused: bool = False) -> str | None:
    """None when this backward's dK/dV (``fused``: and dQ) may take the Gluon path (before the
    first-use check), else why not."""
    if not enabled():
        return f"turned off ({ENV}=0 or FLASHRUN_HOPPER=0)" if DEFAULT_ON else f"off unless {ENV}=1"
    if INTERPRETED:
        return "Triton's interpreter"
    if q.device.type != "cuda" or hopper._capability(q.device.index or 0) != (9, 0):
        return "not an sm_90 GPU"
    return (scope(q, k, v, do, variant, fused) or hopper._api_reason()
            or _checked.get(_key(q.dtype, q.shape[-1], fused, variant)))


def _key(dtype, head_dim: int, fused: bool, variant) -> tuple:
    """A first-use check's key: dtype, head dim, with dQ or not, and the variants it runs with (a
    window, a softcap, ALiBi), each checked apart so that calls without one never pay for its compiles."""
    return dtype, head_dim, fused, variant.window is not None, variant.softcap > 0, variant.alibi_slopes is not None


def variants_on() -> bool:
    """On unless ``FLASHRUN_HOPPER_BWD_VARIANTS=0``."""
    return os.environ.get(VARIANTS_ENV, "").strip().lower() not in ("0", "false", "off", "no")


def scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, variant,
          fused: bool = False) -> str | None:
    """None when the inputs are in the kernel's scope (any device; ``fused``: the kernel with dQ
    inside), else why not."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}"
    if q.dim() != 4 or variant.varlen:
        return "packed sequences"
    if q.shape[0] > 65535:  # the grid's third dimension
        return f"batch {q.shape[0]} > 65535"
    cfg = OVERRIDE if OVERRIDE is not None else KERNELS.get(kernel_for(q.shape[-1], fused) or "")
    if q.shape[-1] not in HEAD_DIMS or cfg is None or (fused and not fusable(cfg)):
        return f"head_dim {q.shape[-1]}" + (" with dQ inside" if fused and q.shape[-1] in HEAD_DIMS else "")
    why = variants_reason(q.shape[-1], fused, variant)
    if why:
        return why
    if not all(tma_aligned(t) for t in (q, k, v, do)):
        return "strides or base not 16-byte aligned"
    return None


# -- launcher -------------------------------------------------------------------------------------


def rows_aligned(t: torch.Tensor) -> torch.Tensor:
    """LSE or delta (B, H, N_Q) float32 as a TMA descriptor can read it: last dim contiguous, the
    other strides and the base 16-byte aligned. The forward's LSE is contiguous, so that holds when
    N_Q % 4 == 0; otherwise a copy with each row padded to a multiple of 4 (the descriptor still
    ends rows at N_Q, and the copy engine zero-fills past it)."""
    if t.stride(2) == 1 and t.data_ptr() % 16 == 0 and all(s * 4 % 16 == 0 for s in t.stride()[:2]):
        return t
    padded = torch.empty((*t.shape[:2], cdiv(t.shape[2], 4) * 4), dtype=t.dtype, device=t.device)
    padded[..., :t.shape[2]] = t
    return padded[..., :t.shape[2]]


@functools.cache
def _row_layout():
    """LSE/delta's: one unswizzled row of float32 per box."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


# _fa3_bwd_dkdv's arguments that change from call to call: sixteen descriptors (dQ's, dK's and dV's,
# and the second column block's, or None), dK, dV
PER_CALL = 18


def tma_out(q, dk, dv, split: int, cfg: BwdConfig, fused: bool, window, adds: bool = False) -> bool:
    """Whether dK and dV leave the kernel by TMA (``TMA_OUT``) where a descriptor can take them:
    the gradients themselves (one part per GQA group, q's dtype), stored by the producer - not the
    head_dim 128 kernel with dQ inside and a window, which then spills 24-28 B
    (tests/compile_hopper_bwd.py) and keeps the consumers' stores; or, ``adds`` (a split group's
    parts adding into float32 dK and dV), reduce-adds by each consumer through its dQ tile, so
    with dQ inside, one column block and keys as rows (:func:`_out_cols`)."""
    aligned = tma_aligned(dk) and tma_aligned(dv)
    if adds:
        return fused and not cfg.transposed and not cfg.blocks[1] and aligned
    if window is not None and fused and cfg.blocks == (128, 0):
        return False
    return split == 1 and dk.dtype == dv.dtype == q.dtype and aligned


def _out_cols(cfg: BwdConfig, adds: bool) -> tuple[int, int]:
    """The columns of dK's and dV's TMA boxes per column block: K's, or where the consumers add
    through their dQ tiles, a dQ tile's."""
    return (cfg.dq_cols[0], 0) if adds else cfg.blocks


def _per_call(q, k, v, do, lse, delta, dk, dv, dq, cfg: BwdConfig, out: bool, adds: bool = False) -> tuple:
    """The launch's first PER_CALL arguments: descriptors over q, k, v, dO (boxes of BLOCK_M query
    rows or cfg.keys keys, HEAD_D columns), LSE and delta (rows of BLOCK_M; both :func:`rows_aligned`),
    dQ's float32 buffer (or None; the transposed kernel's: DQ_COLS columns), the same over q, k, v, dO
    and dQ (not the transposed kernel's) with the second column block's
    HEAD_D1 columns (the kernel loads them from column HEAD_D; None with one block), with ``out``
    (:func:`tma_out`) dK's and dV's as K's and the second block's (else None), and the dK, dV
    outputs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, rows, cols):
        if t is None or not cols:
            return None
        block = [1, 1, rows, cols]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, hopper._smem_layout(tuple(block), t.dtype))

    def row_desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, cfg.block_m], _row_layout())

    m, n, (d0, d1), dq_cols = cfg.block_m, cfg.keys, cfg.blocks, cfg.dq_cols
    dq1_cols = 0 if cfg.transposed else d1 and dq_cols[-1]
    outs = (dk, dv, dk, dv) if out else (None,) * 4
    o0, o1 = _out_cols(cfg, adds)
    return (desc(q, m, d0), desc(k, n, d0), desc(v, n, d0), desc(do, m, d0), row_desc(lse),
            row_desc(delta), desc(dq, m, dq_cols[0]), desc(q, m, d1), desc(k, n, d1), desc(v, n, d1),
            desc(do, m, d1), desc(dq, m, dq1_cols), *(desc(t, n, c) for t, c in zip(outs, (o0, o0, o1, o1))),
            dk, dv)


def launch_args(q, k, v, do, lse, delta, dk, dv, sm_scale: float, causal: bool, cfg: BwdConfig, split: int = 1,
                dq: torch.Tensor | None = None, window: tuple[int, int] | None = None, adds: bool = False,
                softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """(grid, positional args, constexprs, options) of one launch; ``split`` spreads each k/v
    head's GQA group over that many programs, dk/dv then float32 (B, H_KV x split, N_K, D)
    partials, or with ``adds`` float32 zeros (B, H_KV, N_K, D) the parts add into; ``dq``: a
    zeroed float32 (B, H, N_Q, D) buffer, contiguous, that the kernel adds dQ into (FUSED_DQ), or
    None; ``window``: (left, right) as ``Variant.window`` (not with ``causal``); ``softcap``,
    ``alibi_slopes`` ((H,) or (B, H) float32) as ``Variant``'s.
    The first PER_CALL positional arguments are the ones that change between calls of a plan.
    Shared by the launcher and tests/compile_hopper_bwd.py (which compiles for sm_90 without a GPU)."""
    from flashrun.kernels.flash.hopper_bwd_jit import LOG2E

    z, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if d != cfg.head_dim:
        raise ValueError(f"kernel laid out for head_dim {cfg.head_dim}, got {d}")
    if (h // h_kv) % split:
        raise ValueError(f"split {split} must divide the GQA group {h // h_kv}")
    left, right = window if window is not None else (0, 0)  # read only under WINDOW
    out = tma_out(q, dk, dv, split, cfg, dq is not None, window, adds)
    slopes = alibi_slopes
    qk_scale = sm_scale / softcap if softcap else sm_scale * LOG2E  # a softcap's tanh takes natural units
    args = (*_per_call(q, k, v, do, rows_aligned(lse), rows_aligned(delta), dk, dv, dq, cfg, out, adds),
            dk.stride(0), dk.stride(1), dk.stride(2), n_q, n_k, sm_scale, qk_scale, left, right, softcap * LOG2E,
            slopes, slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
            slopes.stride(-1) if slopes is not None else 0)
    constexprs = dict(GROUP=h // h_kv // split, KV_SPLIT=split, HEAD_D=cfg.blocks[0], HEAD_D1=cfg.blocks[1],
                      BLOCK_M=cfg.block_m, STAGES=cfg.stages,
                      CONSUMERS=cfg.consumers, CAUSAL=bool(causal), WINDOW=window is not None,
                      FUSED_DQ=dq is not None, KV_ADD=split if adds else 0, CONSUMER_REGS=cfg.consumer_regs,
                      PRODUCER_REGS=cfg.producer_regs, TMA_OUT=out, SOFTCAP=bool(softcap), ALIBI=slopes is not None)
    blocks = max(cdiv(n_k, cfg.block_n), 1)
    # causal or windowed, where all heads' Q and dO are few enough (args.across_heads): every
    # head's first key blocks (the heaviest) start first (_key_tile)
    last = bool((causal or window is not None) and blocks <= 65535  # (the grid's z)
                and across_heads(z * h_kv * split, n_q, d, q.dtype, h // h_kv // split, "qdo"))
    constexprs["BLOCKS_LAST"] = last
    grid = (h_kv * split, z, blocks) if last else (blocks, h_kv * split, z)
    return grid, args, constexprs, {"num_warps": 4, "maxnreg": cfg.maxnreg}


@dataclass(frozen=True)
class _Plan:
    """One launch per (layouts of q, k, v, dO, LSE, delta and dQ, scale, mask, kernel, split):
    everything but the per-call arguments, so that later calls skip Triton's per-call
    specialization (launch._Launch, NOTES v14) and the descriptors' checks (launch.rebased)."""

    launch: _Launch
    descriptors: tuple  # the first call's descriptors of q, k, v, dO, LSE, delta, dQ and the second
    # column block's of q, k, v, dO and dQ, then dK's, dV's and their second block's, as templates

    def __call__(self, stream, q, k, v, do, lse, delta, dq, dk, dv) -> None:
        self.launch(stream, *(None if d is None else rebased(d, t) for d, t in
                              zip(self.descriptors, (q, k, v, do, lse, delta, dq, q, k, v, do, dq, dk, dv, dk, dv))),
                    dk, dv)


_plans: dict[tuple, _Plan] = {}


def _run_gluon(q, k, v, do, lse, delta, sm_scale: float, causal: bool, cfg: BwdConfig, split: int = 1,
               dq: torch.Tensor | None = None, window: tuple[int, int] | None = None,
               kv_out: tuple[torch.Tensor, torch.Tensor] | None = None, softcap: float = 0.0,
               alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv), laid out like k (a model's layout: its backward reshapes them without a copy).
    ``kv_out``: float32 (dK, dV) buffers laid out like k and zeroed, that a split group's parts
    add into, returned as they are (:func:`fused` casts them with dQ); else made here. ALiBi calls
    keep no plan (their slopes would sit among its fixed arguments)."""
    if kv_out is not None:
        dk = dv = None
        dk_out, dv_out, adds = *kv_out, True
    else:
        dk = torch.empty_like(k)
        dv = torch.empty_like(dk)
        # split: float32 buffers the parts add into (dQ inside: not repeatable anyway), or partials
        dk_out, dv_out, adds = (dk, dv, False) if split == 1 else split_outputs(k, split, repeatable=dq is None)
    lse, delta = rows_aligned(lse), rows_aligned(delta)
    lean = not compiling() and alibi_slopes is None  # compile-only runs (and ALiBi) take Triton's path
    key = (*(_meta(t) for t in (q, k, v, do, lse, delta, dq)), sm_scale, causal, cfg, split, adds, window, softcap)
    plan = _plans.get(key) if lean else None
    if plan is not None:
        plan(_current_stream(q.device), q, k, v, do, lse, delta, dq, dk_out, dv_out)
    else:
        grid, args, constexprs, options = launch_args(q, k, v, do, lse, delta, dk_out, dv_out, sm_scale, causal,
                                                      cfg, split, dq, window, adds, softcap, alibi_slopes)
        if lean:
            ordered = list(args) + [constexprs[name] for name in cfg.kernel.arg_names[len(args):]]
            plan = keep(_plans, key, _Plan(_Launch(cfg.kernel, grid, tuple(ordered[PER_CALL:]), options),
                                           tuple(template(d) for d in args[:PER_CALL - 2])))
            plan.launch(_current_stream(q.device), *args[:PER_CALL])  # through Triton: compiles, keeps the kernel
        else:
            launch(cfg.kernel, grid, *args, **constexprs, **options)
    if kv_out is not None:
        return kv_out
    if split > 1:
        split_result(dk_out, dk, split, adds)
        split_result(dv_out, dv, split, adds)
    return dk, dv


RUN = _run_gluon  # the kernel the path calls; the tests swap in a failing one


# programs per SM below which a GQA group is split, in both backwards: the fewest parts that fill
# the SMs win (NOTES v26, :func:`dkdv`'s measurements: qwen2-1b best at split 2, llama-1b unsplit,
# with dQ inside or not), more parts cost their adds or partials and their programs' prologues
SPLIT_WAVES = 1.5


def dkdv(q, k, v, do, lse, delta, sm_scale: float, causal: bool, kv_split=None,
         window: tuple[int, int] | None = None, softcap: float = 0.0,
         alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) through the Gluon kernel without dQ (the deterministic backward's; :func:`fused`
    has dQ inside); call only where :func:`eligible` and :func:`ensure_checked` allow it.
    ``kv_split(programs, group, device, waves)``: over how many programs to spread a GQA group
    (``attention._kv_split``, here with :data:`SPLIT_WAVES`); None: one. On the H200 at 4 x 2048
    tokens, bf16 causal (GPU time of the whole backward), with dQ inside and the adds by TMA
    (NOTES v26): qwen2-1b's group of 6 over 2 k/v heads 0.518 ms unsplit, **0.326** split 2, 0.341
    split 3, 0.345 split 6 (partials: 0.367, 0.393, 0.447; cuDNN 0.347); llama-1b's 4 over 8
    heads **0.494** unsplit, 0.527 split 2, 0.621 split 4 (cuDNN 0.543). Deterministic: qwen2
    **0.373** split 2 (its two parts add: exact in either order), 0.415 split 3, 0.471 split 6
    (partials); llama **0.510** unsplit, 0.594 split 2."""
    cfg = _config(q.shape[-1], False)
    return RUN(q, k, v, do, lse, delta, sm_scale, causal, cfg, _split(q, k, cfg, kv_split), None, window,
               **_scores(softcap, alibi_slopes))


def _scores(softcap: float, alibi_slopes: torch.Tensor | None) -> dict:
    """RUN's variant arguments, only where a call has them (stand-in kernels need not take them)."""
    args = {}
    if softcap:
        args["softcap"] = softcap
    if alibi_slopes is not None:
        args["alibi_slopes"] = alibi_slopes
    return args


def _split(q, k, cfg: BwdConfig, kv_split) -> int:
    if kv_split is None:
        return 1
    programs = cdiv(k.shape[2], cfg.block_n) * k.shape[0] * k.shape[1]
    return kv_split(programs, q.shape[1] // k.shape[1], q.device, SPLIT_WAVES)


def fused(q, k, v, do, lse, delta, sm_scale: float, causal: bool, kv_split,
          window: tuple[int, int] | None = None, softcap: float = 0.0,
          alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's dtype through the :data:`FUSED` kernel (dQ inside), laid out like q and
    k. One zeroed float32 buffer holds dQ and, where the GQA group is split and its parts add
    (``args.split_outputs``), dK and dV; one cast turns it into the three gradients: two launches
    where separate buffers took six (three zero fills, three casts)."""
    cfg = _config(q.shape[-1], True)
    split = _split(q, k, cfg, kv_split)
    adds = split_adds(split, repeatable=False)  # (else one part, or float32 partials that RUN sums)
    like = (q, k, k) if adds else (q,)
    buffer, views = _carved(like, torch.float32)
    dk, dv = RUN(q, k, v, do, lse, delta, sm_scale, causal, cfg, split, views[0], window,
                 views[1:] if adds else None, **_scores(softcap, alibi_slopes))
    if not adds:
        return views[0].to(q.dtype), dk, dv
    grads = torch.empty_like(buffer, dtype=q.dtype).copy_(buffer)
    return tuple(grads.as_strided(view.shape, view.stride(), view.storage_offset()) for view in views)


def _carved(like: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed ``dtype`` buffer and a view of it per tensor of ``like``, laid out as that tensor
    (its dense layout: :func:`dense_strides`), each starting on a multiple of 32 elements (128
    bytes of float32: TMA wants 16)."""
    layouts, total = [], 0
    for t in like:
        layouts.append((t.shape, dense_strides(t.shape, t.stride()), total))
        total += -(-t.numel() // 32) * 32
    buffer = torch.zeros(total, dtype=dtype, device=like[0].device)
    return buffer, [buffer.as_strided(*layout) for layout in layouts]


@functools.lru_cache(maxsize=256)
def dense_strides(shape: torch.Size, stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of ``torch.empty_like`` of a tensor of this shape and stride: its own where it
    is dense, else dense with the dimensions in its memory order."""
    return torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride()


# -- first use: check against the portable kernel -------------------------------------------------

# _key(...) (dtype, head_dim, fused, windowed, softcap, ALiBi) -> why the path is off after its first-use
# check there (None: it passed)
_checked: dict[tuple, str | None] = {}

# Max-abs bounds on dK and dV (and dQ) against the portable kernel on the check's inputs (randn, N ~ 200):
# both accumulate in float32 and round P and dS to the input dtype before their matmuls, over
# blocks in another order; |dK|, |dV|, |dQ| stay below ~10 there, so a few units in the last place
# of fp16 (2^-11 relative) or bf16 (2^-8). A wrong mask, tile or head gives errors of order 1.
CHECK_ATOL = {torch.float16: 2e-2, torch.bfloat16: 1.5e-1}
CHECK_SHAPE = (1, 4, 2, 200, 190)  # (batch, query heads, k/v heads, N_Q, N_K): GQA 2:1, Nq != Nk, ragged
# (causal, window, GQA split) per check: without a window, full and causal; with one (the windowed
# calls' check), two windows. At CHECK_SHAPE (shift -10) the first rows see no key, a 128-key block
# skips query blocks on both sides, and blocks are masked on either edge of the window
CHECK_MASKS = {False: ((False, None, 1), (True, None, 2)), True: ((False, (37, 5), 1), (False, (60, 0), 2))}
# a softcap's check: a cap low enough that the scores (about N(0, 1) here) bend on it
CHECK_SOFTCAP = 2.0


def _check_inputs(gen: torch.Generator, device, dtype, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of :data:`CHECK_SHAPE` for a first-use check, drawn from ``gen`` (on the CPU, so
    that every device checks the same numbers)."""
    z, h, h_kv, n_q, n_k = CHECK_SHAPE
    q, do = (torch.randn(z, h, n_q, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(z, h_kv, n_k, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _raised(kernel: str, exc: Exception) -> str:
    """A first-use check's verdict on a kernel that raised: the exception's last line."""
    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return f"the Gluon {kernel} kernel raised {type(exc).__name__}: {last}"


def _self_check(device, dtype, head_dim, portable, fused: bool = False, windowed: bool = False,
                softcap: bool = False, alibi: bool = False) -> str | None:
    """None when the Gluon dK/dV (``fused``: and dQ) agrees with ``portable(q, k, v, do, sm_scale,
    causal, window, softcap, alibi_slopes) -> (dk, dv, lse, delta, dq)`` on small inputs of this
    dtype and head_dim, causal and not (``windowed``: two windows; ``softcap``: at
    :data:`CHECK_SOFTCAP`; ``alibi``: the heads' standard slopes), else what went wrong. While
    compiling ahead the launches only compile, so nothing is compared."""
    cfg = _config(head_dim, fused)
    gen = torch.Generator(device="cpu").manual_seed(0)
    z, h, h_kv, n_q, n_k = CHECK_SHAPE
    cap = CHECK_SOFTCAP if softcap else 0.0
    slopes = alibi_slopes(h, device) if alibi else None
    for causal, window, split in CHECK_MASKS[windowed]:
        q, k, v, do = _check_inputs(gen, device, dtype, head_dim)
        scale = head_dim ** -0.5
        try:
            dk_ref, dv_ref, lse, delta, dq_ref = portable(q, k, v, do, scale, causal, window, cap, slopes)
            split = split if (h // h_kv) % split == 0 else 1  # the split path (float32 partials) too
            dq = torch.zeros(q.shape, dtype=torch.float32, device=device) if fused else None
            dk, dv = RUN(q, k, v, do, lse, delta, scale, causal, cfg, split, dq, window, **_scores(cap, slopes))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure turns the path off
            return _raised("dK/dV", exc)
        if compiling():
            continue
        errs = {name: (got.float() - ref.float()).abs().max().item()
                for name, got, ref in (("dK", dk, dk_ref), ("dV", dv, dv_ref)) + ((("dQ", dq, dq_ref),) if fused else ())}
        label = (f"Nq={n_q} Nk={n_k} D={head_dim} GQA {h}/{h_kv} "
                 + (f"window {window}" if window is not None else "causal" if causal else "full")
                 + (f" softcap {cap:g}" if cap else "") + (" ALiBi" if alibi else ""))
        if not all(err <= CHECK_ATOL[dtype] for err in errs.values()):  # NaN fails too
            return (f"the Gluon {'dQ/' if fused else ''}dK/dV kernel disagrees with the portable one ({label}: "
                    + ", ".join(f"max |d{name}| {err:.3g}" for name, err in errs.items()) + ")")
    return None


def ensure_checked(device, dtype, head_dim, portable, fused: bool = False, windowed: bool = False,
                   then=None, softcap: bool = False, alibi: bool = False) -> bool | None:
    """Run the first-use check once per process, dtype, head_dim, kernel (``fused``: with dQ) and
    mask (``windowed``: the window's, checked apart so that calls without one never pay for its
    compiles); True when the path stays on, None while it is compiling in the background
    (:func:`.hopper.first_use`; ``then``: the call's own launches, compiled with it). While
    compiling ahead the check's kernels are compiled, nothing runs, and the path is taken as on:
    the check itself runs on the first real call."""
    key = (dtype, head_dim, fused, windowed, softcap, alibi)
    if key in _checked:
        return _checked[key] is None
    what = ("dQ/dK/dV backward" if fused else "dK/dV backward") + (" with a window" if windowed else "") + (
        " with a softcap" if softcap else "") + (" with ALiBi" if alibi else "")
    return hopper.first_use(_checked, key, lambda: _self_check(device, dtype, head_dim, portable, fused, windowed,
                                                               softcap, alibi), what, then)


def applies(q, k, v, do, variant, portable, fused: bool = False, then=None) -> bool | None:
    """Whether this backward's dK/dV (``fused``: and dQ) takes the Gluon path: eligible and its
    first-use check passed (None: not decided yet, see :func:`ensure_checked`)."""
    if eligible(q, k, v, do, variant, fused) is not None:
        return False
    _, _, _, windowed, softcap, alibi = _key(q.dtype, q.shape[-1], fused, variant)
    return ensure_checked(q.device, q.dtype, q.shape[-1], portable, fused, windowed, then, softcap, alibi)


EPOCH = 0  # counts reset(): a backward's route made before one is not reused after


# -- the Gluon dQ kernel (hopper_dq_jit) ------------------------------------------------------------
# Where the Gluon dK/dV kernel has no room for dQ inside (head_dim 256) the deterministic backward's
# dQ was the portable kernel's, 255 registers and one program per SM (on the H200 3.1 of the
# backward's 5.4 ms, causal N=4096: backward-d256 probe). This kernel runs there instead, plain or
# causal, with a softcap or not, after its own first-use check (dq_applies): on an H100 the d256
# backward went from 0.69-0.75x cuDNN to 0.98-1.10x (head-dims-d256-backward-h100);
# FLASHRUN_HOPPER_BWD_DQ=0 puts dQ back on the portable kernel
DQ_ENV = "FLASHRUN_HOPPER_BWD_DQ"


@dataclass(frozen=True)
class DqConfig:
    head_dim: int
    block_n: int = 32  # keys per stage: Q and dO (2 x 64 rows per consumer) and two stages of K and V fit 192 KB at 256
    stages: int = 2
    consumers: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24

    @property
    def kernel(self):
        from flashrun.kernels.flash.hopper_dq_jit import _fa3_bwd_dq

        return _fa3_bwd_dq


DQ_KERNELS = {256: DqConfig(256)}


def gluon_dq_reason(q, k, v, do, variant) -> str | None:
    """None when :func:`gluon_dq` takes this deterministic backward's dQ, else why not."""
    if os.environ.get(DQ_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return f"off ({DQ_ENV}=0)"
    if INTERPRETED or q.device.type != "cuda" or hopper._capability(q.device.index or 0) != (9, 0):
        return "not an sm_90 GPU"
    if q.dtype not in DTYPES or q.dim() != 4 or variant.varlen:
        return "dtype or packed sequences"
    if q.shape[-1] not in DQ_KERNELS:
        return f"head_dim {q.shape[-1]}"
    if q.shape[0] * q.shape[1] > 65535:  # the grid's second dimension
        return f"batch x heads {q.shape[0] * q.shape[1]} > 65535"
    if k.shape[2] == 0:
        return "no keys"
    if variant.window is not None or variant.alibi_slopes is not None:
        return "a window or ALiBi"
    if variant.softcap > SOFTCAP_MAX:
        return f"softcap {variant.softcap:g} > {SOFTCAP_MAX:g} (the precise tanh)"
    if not all(tma_aligned(t) for t in (q, k, v, do)):
        return "strides or base not 16-byte aligned"
    return hopper._api_reason()


def dq_launch_args(q, k, v, do, lse, delta, dq, sm_scale: float, causal: bool, cfg: DqConfig, softcap: float = 0.0):
    """(grid, positional args, constexprs, options) of one :func:`gluon_dq` launch; lse and delta
    (B, H, N_Q) float32 with rows contiguous, dq laid out as q with its last dim contiguous."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashrun.kernels.flash.hopper_bwd_jit import LOG2E

    z, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]

    def desc(t, rows):
        block = [1, 1, rows, d]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, hopper._smem_layout(tuple(block), t.dtype))

    grid = (cdiv(n_q, 64 * cfg.consumers), z * h)
    args = (desc(q, 64), desc(do, 64), desc(k, cfg.block_n), desc(v, cfg.block_n), lse, delta, dq,
            lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1), dq.stride(0), dq.stride(1), dq.stride(2),
            h, n_q, n_k, sm_scale / softcap if softcap else sm_scale * LOG2E, sm_scale, softcap * LOG2E)
    constexprs = dict(GROUP=h // h_kv, HEAD_D=d, BLOCK_N=cfg.block_n, STAGES=cfg.stages, CONSUMERS=cfg.consumers,
                      CAUSAL=bool(causal), SOFTCAP=softcap > 0, CONSUMER_REGS=cfg.consumer_regs,
                      PRODUCER_REGS=cfg.producer_regs)
    return grid, args, constexprs, {"num_warps": 4}


def dq_applies(q, k, v, do, variant, portable) -> bool | None:
    """Whether this deterministic backward's dQ takes :func:`gluon_dq`: in scope
    (:func:`gluon_dq_reason`) and its first-use check passed, once per process, dtype, head dim and
    softcap or not (:func:`_dq_self_check` against ``portable``, as :func:`_self_check` takes it;
    None: compiling in the background, :func:`.hopper.first_use`)."""
    if gluon_dq_reason(q, k, v, do, variant) is not None:
        return False
    softcap = variant.softcap > 0
    key = (q.dtype, q.shape[-1], "dq", softcap)
    if key in _checked:
        return _checked[key] is None
    return hopper.first_use(_checked, key, lambda: _dq_self_check(q.device, q.dtype, q.shape[-1], portable, softcap),
                            "dQ backward" + (" with a softcap" if softcap else ""))


def _dq_self_check(device, dtype, head_dim: int, portable, softcap: bool = False) -> str | None:
    """None when :func:`gluon_dq` agrees with the portable backward's dQ (``portable`` as
    :func:`_self_check` takes it) on :data:`CHECK_SHAPE`'s inputs of this dtype and head_dim, full
    and causal (``softcap``: at :data:`CHECK_SOFTCAP`), else what went wrong. While compiling ahead
    the launches only compile, so nothing is compared."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    z, h, h_kv, n_q, n_k = CHECK_SHAPE
    cap = CHECK_SOFTCAP if softcap else 0.0
    for causal in (False, True):
        q, k, v, do = _check_inputs(gen, device, dtype, head_dim)
        scale = head_dim ** -0.5
        try:
            _, _, lse, delta, dq_ref = portable(q, k, v, do, scale, causal, None, cap, None)
            dq = torch.empty(q.shape, dtype=dtype, device=device)
            gluon_dq(q, k, v, do, lse, delta, dq, scale, causal, cap)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure turns the path off
            return _raised("dQ", exc)
        if compiling():
            continue
        err = (dq.float() - dq_ref.float()).abs().max().item()
        if not err <= CHECK_ATOL[dtype]:  # NaN fails too
            return (f"the Gluon dQ kernel disagrees with the portable one (Nq={n_q} Nk={n_k} D={head_dim} GQA "
                    f"{h}/{h_kv} {'causal' if causal else 'full'}{f' softcap {cap:g}' if cap else ''}: "
                    f"max |dQ| {err:.3g})")
    return None


def gluon_dq(q, k, v, do, lse, delta, dq, sm_scale: float, causal: bool, softcap: float = 0.0) -> None:
    """dQ of the deterministic backward into ``dq`` (q's shape and dtype, last dim contiguous)
    through the Gluon dQ kernel (:func:`gluon_dq_reason`)."""
    lse, delta = (t if t.stride(-1) == 1 else t.contiguous() for t in (lse, delta))
    cfg = DQ_KERNELS[q.shape[-1]]
    grid, args, constexprs, options = dq_launch_args(q, k, v, do, lse, delta, dq, sm_scale, causal, cfg, softcap)
    launch(cfg.kernel, grid, *args, **constexprs, **options)


def switches() -> tuple:
    """What turns the path on or off between calls: :func:`enabled` and :func:`reset` (part of a
    backward's route key, ``attention._attn_backward``)."""
    return enabled(), EPOCH


def reset() -> None:
    """Forget the first-use checks and the last path (tests)."""
    global LAST_PATH, EPOCH
    _checked.clear()
    LAST_PATH = None
    EPOCH += 1
