"""FlashAttention-2 forward and backward in Triton.

Maths (Dao, "FlashAttention-2", 2023). For one (batch, head):
    S = Q Kᵀ · sm_scale,   P = softmax(S) row-wise,   O = P V,   LSE_i = log Σ_j exp(S_ij)
Forward: one program owns BLOCK_M query rows and streams K/V in BLOCK_N blocks, keeping the
running row max ``m_i``, running sum ``l_i`` and the unnormalized output ``acc`` on chip
(online softmax); it never materializes S. Exponentials run in base 2: exp(x) = exp2(x·log2 e),
with ``sm_scale · log2 e`` folded into one multiplier ``qk_scale``.
Backward: ``delta_i = Σ_d dO_id O_id`` (a preprocess kernel), P is recomputed from LSE, then
    dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − delta),  dQ = dS K · sm_scale,  dK = dSᵀ Q · sm_scale
Per (query tile, key tile) pair that is 5 matmuls: S = Q Kᵀ, dV += Pᵀ dO, dP = dO Vᵀ, dK += dSᵀ Q,
dQ += dS K. dK/dV sum over query tiles, dQ over key tiles, so no one program order serves both:
  * ``deterministic=False`` (FlashAttention-2/3, cuDNN): one program per key block keeps K, V,
    dK, dV on chip, loops over the query blocks (and over the query heads of a GQA group,
    summing dK/dV in order), and adds each pair's dQ partial dS K · sm_scale into a zeroed
    float32 buffer (``ATOMIC_DQ``: on Hopper one TMA reduce-add per tile, ``DQ_TMA``, else an
    atomic per element); one cast to the output dtype follows. 5 matmuls. Float addition is
    not associative and the partials from different key blocks land in whatever order the
    programs reach them, so dQ may differ in its last bits from run to run (dK, dV do not);
  * ``deterministic=True``: the same dK/dV kernel without the atomics, then a dQ kernel per
    query block looping over key blocks in a fixed order - bitwise repeatable. It recomputes
    Q Kᵀ and dO Vᵀ (7 matmuls per pair), yet measured faster on the H200 through v5 (the
    atomic kernel's dQ partial and the transpose of dS it needs cost more than the two
    matmuls saved; NOTES). ``flashrun.limits.DETERMINISTIC_BACKWARD`` names the
    default, whichever measures faster.
Each backward kernel walks the blocks its tile sees whole first and the masked ones (causal
diagonal, window edges, ragged end) in one more loop, GQA heads folded into both loops: ptxas
serializes every wgmma of a loop that follows a masked loop over the same accumulators (NOTES v6).
Forward on Hopper (sm_90) with Triton 3.6: where :mod:`flashrun.kernels.flash.hopper` applies
(plain or causal fp16/bf16 at head_dim 128, or 64 with long keys), an FA3-style Gluon kernel
runs instead of ``_attn_fwd``, checked against it on its first use in the process. The deterministic
backward's dK/dV runs an FA3-layout Gluon kernel there (:mod:`flashrun.kernels.flash.hopper_bwd`:
plain, causal or windowed fp16/bf16 at head_dim 64, 80, 96, 128 and 192, checked on first use; ``FLASHRUN_HOPPER_BWD=0``
turns it off), dQ staying with ``_attn_bwd_dq``.
First calls: every launch goes through :func:`flashrun.kernels.tuning.launch`, so a call can be
made in compile-only mode; the first call of each kind in a process compiles the forward's and
backward's kernels at once (:func:`_compile_ahead`, :mod:`flashrun.kernels.warmup`).
Keys past N_K in a key block load as zeros, and their dS is zeroed before it reaches dQ: against
a very negative LSE their recomputed P would be exp2(0 − lse2) = inf, and inf · 0 is NaN.

Conventions (shared with ``flashrun.harness.reference``, which this module never imports):
  * layout (batch, heads, seq, head_dim), any strides; k/v may have fewer heads than q (GQA/MQA);
  * causal with Nq != Nk is aligned bottom-right (FlashAttention >= 2.1): query i sees keys
    j <= i + Nk - Nq; a query that sees no key outputs zeros and LSE = -inf, never NaN;
  * head_dim 16..256: Triton tiles are powers of two, so a head dim that is not one is split
    into two column blocks, BLOCK_D0 = the largest power of two <= head_dim and BLOCK_D1 =
    the rest rounded up to a power of two (>= 16): 192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16,
    40 = 32 + 16 (8 columns padded). Q Kᵀ and dO Vᵀ sum the two blocks' dots; O, dQ, dK, dV
    accumulate per block; the TMA forward reads each block through its own descriptor. Where
    two blocks would be no narrower than one padded tile (24 = 16 + 16, 112 = 64 + 64) and for
    powers of two, one tile of the next power of two (BLOCK_D1 = 0), its padding masked;
  * rows that are not whole 16-byte units (fp16/bf16 head dims not a multiple of 8) would load one
    element at a time: the API pads q, k and v with zero columns (:func:`_padded_width`) and cuts
    the outputs, as FlashAttention-2 does (flash-decoding's shapes excepted);
  * float16/bfloat16 use tensor cores with float32 accumulation; float32 inputs use IEEE fp32
    dots (``input_precision="ieee"``, no TF32), so float32 is exact enough to check against, not fast.
  * Causal work is split into the key blocks every query of the tile sees (no mask) and the few
    diagonal/edge blocks that need one, so only those pay for masking.

Variants (FlashAttention-2's arguments ``window``, ``softcap``, ``alibi_slopes``). Each is a
constexpr of the kernels (``WINDOW``, ``SOFTCAP``, ``ALIBI``), so plain and causal attention
compile as they did without them. With ``off = Nk - Nq``:
  * scores  s_ij = q_i·k_j · sm_scale;  softcap c > 0:  s = c · tanh(s / c);
    ALiBi:  s -= slope_h · |i + off - j|  (slopes (H,) or (B, H), float32);  then the mask;
  * mask    key j is allowed for query i iff  i + off - left <= j <= i + off + right, for
    ``window = (left, right)``; -1, or a side at least as wide as the keys, is unbounded;
    ``causal`` is right = 0. A query with no allowed key outputs zeros (LSE = -inf);
  * base 2  the tanh needs its argument in natural units, so with a softcap ``qk_scale`` is
    sm_scale / c and log2 e is folded in after the tanh (``softcap2 = c · log2 e``); ALiBi slopes
    are multiplied by log2 e once per program;
  * backward  through s' = c · tanh(s / c):  dS = P ∘ (dP − delta) ∘ (1 − tanh²(s / c)), the tanh
    recomputed from Q Kᵀ; the ALiBi bias is a constant (slopes get no gradient);
  * skipping  a window bounds the keys each query tile sees on both sides: blocks outside are
    never visited (loop bounds), blocks inside that every row of the tile sees whole run
    unmasked, and only the blocks on the window's two edges pay for the mask. The backward
    bounds its query loops (dK/dV, and the atomic dQ with them) and key loops (dQ) the same way;
  * paths   TMA loads support every variant as they are (masks and scores do not depend on how
    a tile was loaded); flash-decoding (:mod:`.decode`) too, its splits sharing out only the
    keys a window leaves its row tile.
Packed sequences (``flash_attention_varlen``, constexpr ``VARLEN``): q (total_q, H, D) and k, v
(total_k, H_kv, D) hold B sequences back to back, sequence b in rows cu_seqlens[b] ..
cu_seqlens[b+1] (int32). The grid spans the longest sequence; a program reads its sequence's
bounds, addresses it as a batch entry whose "batch stride" is the row stride (so ``off`` and the
window are per sequence), and returns at once when its tile lies past that sequence's end.
LSE is (H, total_q). Flash-decoding and TMA loads are bypassed for packed sequences (a head's
packed rows are not one block of rows; the KV-cache API, :func:`.decode.flash_attention_with_kvcache`,
is the decode path with per-sequence lengths).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from types import EllipsisType

import torch

from flashrun.errors import ArgumentError
from flashrun.kernels import warmup
from flashrun.kernels.flash import decode, hopper, hopper_bwd
from flashrun.kernels.flash.args import (
    Variant,
    _cu_seqlens_arg,
    _dq_tma_ok,
    _head_descriptors,
    _max_seqlen_arg,
    _rows_descriptors,
    _split_head_dim,
    _tma_ok,
    _variant,
    aligned_head_dim,
    across_heads,
    check_inputs,
    dot_options,
    plain_options,
    split_outputs,
    split_result,
)
from flashrun.kernels.flash.bwd import (
    _attn_bwd_dkdv,
    _attn_bwd_dq,
    _attn_bwd_preprocess,
)
from flashrun.kernels.flash.fwd import _attn_fwd
from flashrun.kernels.flash.launch import _current_stream, _hashable, _Launch, _meta, keep, rebased, template
from flashrun.kernels.tuning import (
    CHOSEN,
    INTERPRETED,
    Launch,
    LaunchConfig,
    cdiv,
    choose,
    compiling,
    next_power_of_2,
    tune_on_miss,
)
from flashrun.kernels.tuning import launch as launch_kernel
from flashrun.limits import DETERMINISTIC_BACKWARD

# -- launchers ----------------------------------------------------------------------------------


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """(batch, head, row, dim) strides as the kernels address ``t``. A packed (total, heads, dim)
    tensor's "batch" stride is its row stride: sequence z starts at row cu_seqlens[z] (_sequence)."""
    return tuple(t.stride()) if t.dim() == 4 else (t.stride(0), t.stride(1), t.stride(0), t.stride(2))


def _lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    """LSE and Delta, (batch, heads, Nq) or packed (heads, total_q), as (batch, head) strides."""
    return (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (lse.stride(1), lse.stride(0))


def _dims(q: torch.Tensor, k: torch.Tensor, variant: Variant) -> tuple[int, int, int, int, int, int]:
    """(Z, H, H_KV, N_Q, N_K, D); packed sequences give the longest lengths, the grid's extent."""
    if variant.varlen:
        return (variant.cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], variant.max_seqlen_q,
                variant.max_seqlen_k, q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _hopper_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
               sm_scale: float | None = None) -> bool | None:
    """Whether this forward takes the Gluon sm_90 path (:mod:`.hopper`): in its scope, not a
    flash-decoding shape, and its first-use check in this process passed; None while that check
    compiles in the background (with this call's own Gluon launch, given ``sm_scale``)."""
    if decode.applies(q, k, variant):
        return False  # few queries, many keys: flash-decoding fills the GPU better
    if hopper.eligible(q, k, v, variant) is not None:
        return False
    then = None if sm_scale is None else lambda: hopper.forward(q, k, v, sm_scale, variant.causal)
    return hopper.ensure_checked(q.device, q.dtype, q.shape[-1], _portable_check, then)


def _portable_check(q, k, v, sm_scale, causal):
    """The portable forward on the first-use check's small inputs (fixed config, no tuning; no
    route kept for them, which would take a model's place among the plans)."""
    with _paths_kept():
        return _attn_forward(q, k, v, sm_scale, Variant(causal=causal), "default", try_gluon=False, key=None)


@contextlib.contextmanager
def _paths_kept():
    """A first-use check's own calls leave ``LAST_PATH`` as the call being checked set it (bench
    reports it: a check's portable forward run between a call's forward and backward said
    ``triton`` for a forward the Gluon kernel ran)."""
    paths = hopper.LAST_PATH, hopper_bwd.LAST_PATH
    try:
        yield
    finally:
        hopper.LAST_PATH, hopper_bwd.LAST_PATH = paths


def forward_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, *,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None) -> str:
    """Which forward kernel flash runs for these inputs: ``"gluon-sm90"`` (the FA3-style Hopper
    kernel, :mod:`.hopper`) or ``"triton"`` (the portable ``_attn_fwd``, or flash-decoding). May
    run the Gluon path's one-time first-use check. ``hopper.LAST_PATH`` records the path
    the last forward took."""
    check_inputs(q, k, v)
    variant = _variant(q, q.shape[0], k.shape[2], causal, window, softcap, alibi_slopes)
    return hopper.GLUON_PATH if _hopper_ok(q, k, v, variant) else hopper.TRITON_PATH


def _attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
                  launch: Launch = None, try_gluon: bool = True,
                  key: tuple | None | EllipsisType = ..., want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: lse (B, H, Nq), or (H, total_q) for packed sequences, natural log, float32.
    ``try_gluon``: may take the Gluon sm_90 path (:mod:`.hopper`) where it applies; ``launch`` pins
    only the portable kernel's config (flash-decoding's is fixed). ``key``: the call's
    :func:`_route_key`, where the caller has it. A call whose key made a route before runs that
    route's plan at once (:data:`_forward_plans`). Without ``want_lse`` flash-decoding neither
    allocates nor writes the LSE (it returns None); the other paths return it anyway."""
    if key is ...:
        key = _route_key(q, k, v, sm_scale, variant, launch, try_gluon, want_lse)
    route = _forward_plans.get(key) if key is not None else None
    if route is not None:
        return route.run(q, k, v)
    if decode.applies(q, k, variant):  # few queries, many keys: :mod:`.decode`
        hopper.LAST_PATH = hopper.TRITON_PATH
        out = decode.forward(q, k, v, sm_scale, variant, want_lse)
        if key is not None:
            keep(_forward_plans, key, _DecodeRoute(decode.plan(q, k, v, sm_scale, variant, want_lse)))
        return out
    gluon = _hopper_ok(q, k, v, variant, sm_scale) if try_gluon else False
    if gluon is None:  # its first-use check is compiling: the portable kernel, and no route kept yet
        key = None
    if gluon:
        out = hopper.forward(q, k, v, sm_scale, variant.causal)
        hopper.LAST_PATH = hopper.GLUON_PATH
        plan = hopper.planned(q, k, v, sm_scale, variant.causal) if key is not None else None
        if plan is not None:
            keep(_forward_plans, key, _GluonRoute(plan))
        return out
    hopper.LAST_PATH = hopper.TRITON_PATH
    Z, H, H_KV, N_Q, N_K, D = _dims(q, k, variant)
    o = torch.empty_like(q)  # laid out like q: a model's (B, N, H, D) view comes back as one
    lse = torch.empty((H, q.shape[0]) if variant.varlen else (Z, H, N_Q), dtype=torch.float32, device=q.device)
    var = variant.kernel_args(sm_scale, q.dtype)
    d0, d1 = _split_head_dim(D)  # the head dim's column blocks (d1 = 0: one block)
    if N_Q == 0:  # packed sequences that are all empty
        return o, lse

    def arguments(cfg: LaunchConfig) -> tuple[tuple[int, int, int], tuple, dict, bool]:
        """The launch of ``cfg``: grid, positional and keyword arguments, and whether it reads TMA."""
        tma = bool(cfg.tma) and not variant.varlen and _tma_ok(q, k, v)  # packed: pointers only
        if tma:  # a descriptor per tensor and column block (the second None where the head dim is not split)
            (q0, q1), (k0, k1), (v0, v1) = (_head_descriptors(q, cfg.block_m), _head_descriptors(k, cfg.block_n),
                                            _head_descriptors(v, cfg.block_n))
        else:
            (q0, q1), (k0, k1), (v0, v1) = (q, None), (k, None), (v, None)
        args = (q0, k0, v0, q1, k1, v1, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                *_lse_strides(lse), H, N_Q, N_K, across_heads(Z * H, N_K, D, q.dtype, H_KV / H, "kv"))
        kwargs = dict(var, GROUP=H // H_KV, HEAD_DIM=D, BLOCK_D0=d0, BLOCK_D1=d1, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, TMA=tma, WS=tma and bool(cfg.ws), **dot_options(q.dtype))
        return (cdiv(N_Q, cfg.block_m), Z * H, 1), args, kwargs, tma

    def run(cfg: LaunchConfig) -> None:
        grid, args, kwargs, _ = arguments(cfg)
        launch_kernel(_attn_fwd, grid, *args, **kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = choose("fwd", q, k, variant.causal, launch, run, **variant.tuning(N_Q, N_K))
    run(cfg)
    if key is not None:
        keep(_forward_plans, key, _ForwardPlan.of(cfg, *arguments(cfg)))
    return o, lse


def _route_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
               launch: Launch, try_gluon: bool, want_lse: bool = True, metas: tuple | None = None) -> tuple | None:
    """Everything a forward's route depends on - the inputs' layouts, dtypes and alignment, the
    variant, the scale, the launch argument and tuning switch, the Gluon path's switches
    (:func:`.hopper.switches`), flash-decoding's launch kind (:data:`.decode.PDL`) and whether the
    LSE is wanted - or None where no route is kept:
    packed sequences and ALiBi (whose per-call tensors sit among a plan's fixed arguments) and
    compile-only calls. ``metas``: q's, k's and v's :func:`.launch._meta`, where the caller has them
    (:func:`_checked_call`)."""
    if variant.varlen or variant.alibi_slopes is not None or compiling():
        return None
    return (*(metas or (_meta(q), _meta(k), _meta(v))), variant.causal, variant.window, variant.softcap, sm_scale,
            _hashable(launch), tune_on_miss(), try_gluon and hopper.switches(), decode.PDL, want_lse)


# -- lean launches of the forward (:mod:`.launch`): a route per call key --------------------------------
#
# A forward's first call with a new key (:func:`_route_key`) decides its path - flash-decoding, the
# Gluon sm_90 kernel or the portable one - and keeps that path's plan in :data:`_forward_plans` as
# its route; later calls with the key run the route at once, skipping the path's checks, the
# tuning lookup and Triton's per-call specialization (inside a model each forward call's host time
# is spent while the GPU waits on short kernels, NOTES v16). Each route's ``run(q, k, v)`` returns
# ``(o, lse)`` and records the path taken.

PER_CALL = 8  # _attn_fwd's arguments that change from call to call: Q, K, V, Q1, K1, V1, O, LSE


@dataclass(frozen=True)
class _ForwardPlan:
    """The portable forward for one key of :func:`_attn_forward` (the inputs' shapes, strides,
    dtype and alignment, the variant, the scale, the launch argument): everything but its
    :data:`PER_CALL` arguments, taken from the call that made it, so that later calls skip the
    tuning lookup and Triton's per-call specialization. Packed sequences and ALiBi (whose
    per-call tensors sit among the fixed arguments) keep the full path."""

    launch: _Launch
    lse_shape: tuple[int, ...]
    descriptors: tuple | None  # with TMA: the first call's (Q, K, V, Q1, K1, V1) descriptors as templates
    chosen: tuple[LaunchConfig, str] | None  # what choose() reported for the call that made it

    @classmethod
    def of(cls, cfg: LaunchConfig, grid: tuple[int, int, int], args: tuple, kwargs: dict, tma: bool) -> _ForwardPlan:
        ordered = list(args) + [kwargs[name] for name in _attn_fwd.arg_names[len(args):]]
        return cls(_Launch(_attn_fwd, grid, tuple(ordered[PER_CALL:]), cfg), tuple(args[7].shape),
                   tuple(template(d) for d in args[:6]) if tma else None, CHOSEN.get("fwd"))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty_like(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.descriptors is not None:
            q0, k0, v0, q1, k1, v1 = (None if d is None else rebased(d, t)
                                      for d, t in zip(self.descriptors, (q, k, v, q, k, v)))
        else:
            q0, k0, v0, q1, k1, v1 = q, k, v, None, None, None
        self.launch(_current_stream(q.device), q0, k0, v0, q1, k1, v1, o, lse)
        hopper.LAST_PATH = hopper.TRITON_PATH
        if self.chosen is not None:
            CHOSEN["fwd"] = self.chosen
        return o, lse


@dataclass(frozen=True)
class _GluonRoute:
    plan: hopper._Plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hopper.LAST_PATH = hopper.GLUON_PATH
        return self.plan.run(q, k, v)


@dataclass(frozen=True)
class _DecodeRoute:
    plan: decode._Plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hopper.LAST_PATH = hopper.TRITON_PATH
        return self.plan.run(q, k, v, k.shape[2])


_forward_plans: dict[tuple, _ForwardPlan | _GluonRoute | _DecodeRoute] = {}  # the routes, by _route_key


def _attn_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, sm_scale: float, variant: Variant, launch: Launch = None,
                   deterministic: bool | None = DETERMINISTIC_BACKWARD,
                   try_gluon: bool = True, key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: one dK/dV kernel that also adds dQ into a float32 buffer with atomics
    (5 matmuls per tile pair), or with ``deterministic`` that kernel without the atomics and a
    dQ kernel (7 matmuls, bitwise repeatable); None: the first where the Gluon one applies, else
    the second. ``try_gluon``: the dK/dV kernel may be the Gluon sm_90 one where
    :mod:`.hopper_bwd` allows it (with dQ inside for the atomic backward, TMA reduce-adds).
    ``key``: the forward's :func:`_route_key`; a call whose key (with dO's layout and the
    switches) was seen skips deciding whether the Gluon kernel with dQ inside runs it."""
    Z, H, H_KV, N_Q, N_K, D = _dims(q, k, variant)
    route = None if key is None else (key, _meta(do), deterministic, hopper_bwd.switches())
    gluon_fused = _backward_routes.get(route) if route is not None else None
    if gluon_fused is None:
        gluon_fused = (deterministic is not True and N_K and try_gluon
                       and hopper_bwd.applies(q, k, v, do, variant, _portable_backward_check, fused=True,
                                              then=lambda: _gluon_fused(do, q, k, v, o, lse, sm_scale, variant, H)))
        if route is not None and gluon_fused is not None:  # None: its first-use check is compiling
            keep(_backward_routes, route, bool(gluon_fused))
    if gluon_fused:  # (before the portable path's arguments: this is the default backward on sm_90)
        return _gluon_fused(do, q, k, v, o, lse, sm_scale, variant, H)
    if deterministic is None:
        deterministic = True
    # atomic: every query row's partials land in a zeroed float32 buffer, so rows that no key
    # block visits (no key to see) come out as zeros too
    dq = (torch.empty(q.shape, dtype=q.dtype, device=q.device) if deterministic
          else torch.zeros(q.shape, dtype=torch.float32, device=q.device))
    delta = _delta(o, do, lse, H, variant.varlen)
    group = H // H_KV
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    d0, d1 = _split_head_dim(D)
    common = dict(HEAD_DIM=D, BLOCK_D0=d0, BLOCK_D1=d1, **variant.kernel_args(sm_scale, q.dtype), **dot_options(q.dtype))
    # Hopper: dQ's partials go out as one TMA reduce-add per tile instead of an atomic per element
    dq_tma = not deterministic and not variant.varlen and _dq_tma_ok(dq)

    def run_dkdv(cfg: LaunchConfig, atomic_dq: bool = False) -> None:
        dq_arg = (_rows_descriptors(dq, cfg.block_m)[0] if dq_tma else dq) if atomic_dq else None
        split = 1 if variant.varlen else _kv_split(cdiv(N_K, cfg.block_n) * Z * H_KV, group, q.device)
        # split: float32 buffers the parts add into, or partials summed below (args.split_outputs)
        dk_out, dv_out, adds = (dk, dv, False) if split == 1 else split_outputs(k, split, repeatable=not atomic_dq)
        launch_kernel(_attn_bwd_dkdv, (cdiv(N_K, cfg.block_n), Z * H_KV * split),
            q, k, v, do, lse, delta, dk_out, dv_out, dq_arg, *_strides(q), *_strides(k), *_strides(v),
            *_strides(do), *_strides(dk_out), *(_strides(dq) if atomic_dq else (0, 0, 0, 0)), *_lse_strides(lse),
            H, H_KV * split, N_Q, N_K, across_heads(Z * H_KV * split, N_Q, D, q.dtype, group // split, "qdo"),
            sm_scale, GROUP=group // split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            ATOMIC_DQ=atomic_dq, DQ_TMA=atomic_dq and dq_tma, KV_SPLIT=split, ADD_KV=adds, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common)
        if split > 1:
            split_result(dk_out, dk, split, adds)
            split_result(dv_out, dv, split, adds)

    def run_fused(cfg: LaunchConfig) -> None:
        dq.zero_()  # the tuner times this more than once: each run must start from zeros
        run_dkdv(cfg, atomic_dq=True)

    def run_dq(cfg: LaunchConfig) -> None:
        launch_kernel(_attn_bwd_dq, (cdiv(N_Q, cfg.block_m), Z * H),
            q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            *_strides(dq), *_lse_strides(lse), H, N_Q, N_K, across_heads(Z * H, N_K, D, q.dtype, H_KV / H, "kv"),
            sm_scale, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)

    tuning = variant.tuning(N_Q, N_K)
    if not deterministic:
        if N_K:  # packed: every key row belongs to a sequence of at most N_K keys; its program writes it
            run_fused(choose("bwd_fused", q, k, variant.causal, launch, run_fused, **tuning))
            hopper_bwd.LAST_PATH = hopper.TRITON_PATH
        return dq.to(q.dtype), dk, dv  # float32: the buffer itself
    gluon_dkdv = lambda: hopper_bwd.dkdv(q, k, v, do, lse, delta, sm_scale, variant.causal, _kv_split,
                                         variant.window, variant.softcap, variant.alibi_slopes)
    if N_K and try_gluon and hopper_bwd.applies(q, k, v, do, variant, _portable_backward_check, then=gluon_dkdv):
        dk, dv = gluon_dkdv()
        hopper_bwd.LAST_PATH = hopper.GLUON_PATH
    elif N_K:
        run_dkdv(choose("bwd_dkdv", q, k, variant.causal, launch, run_dkdv, **tuning))
        hopper_bwd.LAST_PATH = hopper.TRITON_PATH
    if N_Q and try_gluon and hopper_bwd.dq_applies(q, k, v, do, variant, _portable_backward_check):
        hopper_bwd.gluon_dq(q, k, v, do, lse, delta, dq, sm_scale, variant.causal, variant.softcap)
    elif N_Q:
        run_dq(choose("bwd_dq", q, k, variant.causal, launch, run_dq, **tuning))
    return dq, dk, dv


def _gluon_fused(do, q, k, v, o, lse, sm_scale: float, variant: Variant, heads: int):
    """(dq, dk, dv) through the Gluon kernel with dQ inside (:func:`.hopper_bwd.fused`)."""
    delta = _delta(o, do, lse, heads, variant.varlen)
    hopper_bwd.LAST_PATH = hopper_bwd.FUSED_PATH
    return hopper_bwd.fused(q, k, v, do, lse, delta, sm_scale, variant.causal, _kv_split, variant.window,
                            variant.softcap, variant.alibi_slopes)


# whether the Gluon kernel with dQ inside runs a backward, per (forward route key, dO's layout,
# deterministic argument, the Gluon backward's switches): _attn_backward's ``key``
_backward_routes: dict[tuple, bool] = {}

# one launch of _attn_bwd_preprocess per (layouts of O, dO and delta, packed or not): later calls
# skip Triton's per-call specialization (launch._Launch), as the forward's plans do
_delta_plans: dict[tuple, _Launch] = {}


def _delta(o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, H: int, varlen: bool) -> torch.Tensor:
    """delta = rowsum(dO * O), float32, laid out as LSE (packed rows are one (1, H, total_q)
    batch to it)."""
    delta = torch.empty_like(lse)
    rows = o.shape[0] if varlen else o.shape[2]
    if not rows:
        return delta
    # compile-only runs, and CPU tensors standing in for a GPU's (tests/compile_*.py), take Triton's path
    lean = (o.is_cuda or INTERPRETED) and not compiling()
    key = (_meta(o), _meta(do), _meta(delta), varlen)
    plan = _delta_plans.get(key) if lean else None
    if plan is not None:
        plan(_current_stream(o.device), o, do, delta)
        return delta
    d0, d1 = _split_head_dim(o.shape[-1])
    o_strides, do_strides = ((_strides(o), _strides(do)) if not varlen else
                             ((0, *_strides(o)[1:]), (0, *_strides(do)[1:])))
    pre_m = 64 if rows >= 64 else 16
    grid = (cdiv(rows, pre_m), (1 if varlen else o.shape[0]) * H)
    constexprs = dict(HEAD_DIM=o.shape[-1], BLOCK_D0=d0, BLOCK_D1=d1, BLOCK_M=pre_m)
    launch_kernel(_attn_bwd_preprocess, grid, o, do, delta, *o_strides, *do_strides, H, rows, **constexprs)
    if lean:
        tail = (*o_strides, *do_strides, H, rows)
        tail += tuple(constexprs[name] for name in _attn_bwd_preprocess.arg_names[3 + len(tail):])
        keep(_delta_plans, key, _Launch(_attn_bwd_preprocess, grid, tail, {}))
    return delta


def _portable_backward_check(q, k, v, do, sm_scale, causal, window=None, softcap=0.0, alibi_slopes=None):
    """The portable forward and deterministic backward on the Gluon backward's first-use check's
    small inputs (fixed configs, no tuning, no route kept): (dk, dv, lse, delta, dq)."""
    variant = Variant(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    with _paths_kept():
        o, lse = _attn_forward(q, k, v, sm_scale, variant, "default", try_gluon=False, key=None)
        dq, dk, dv = _attn_backward(do, q, k, v, o, lse, sm_scale, variant, "default", deterministic=True,
                                    try_gluon=False)
    return dk, dv, lse, (o.float() * do.float()).sum(-1), dq


SPLIT_WAVES = 4  # dK/dV programs per SM below which a GQA group is split over more programs


def _kv_split(programs: int, group: int, device: torch.device, waves: int | None = None) -> int:
    """Over how many programs each k/v head's GQA group is spread in the dK/dV kernel: 1 when
    ``programs`` (key blocks x batch x k/v heads) already give every SM :data:`SPLIT_WAVES` of
    them, else the smallest divisor of the group that does (or the whole group). With few k/v
    heads (qwen2-1b: 2 of them, group 6) one program per k/v head left the H200 under two waves of
    dK/dV programs at 4 x 2048 tokens."""
    if group == 1 or (device.type != "cuda" and not INTERPRETED):  # (compiling for a GPU on a CPU: unsplit)
        return 1
    target = (SPLIT_WAVES if waves is None else waves) * decode._multiprocessors(device)
    if programs >= target:
        return 1
    return next((s for s in range(2, group) if group % s == 0 and programs * s >= target), group)


# -- first calls: the forward's and backward's kernels compile together --------------------------

_ahead: set[tuple] = set()  # the kinds of call compiled ahead in this process (_compile_ahead)
_ahead_calls: dict[tuple, bool] = {}  # (route key, deterministic, grad) of calls whose kind is in _ahead


def _compile_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
                   launch: Launch, deterministic: bool | None, grad: bool,
                   key: tuple | None = None) -> tuple[warmup.Batch | None, list]:
    """On the first call of its kind in this process (dtype, head_dim, GQA group, length buckets,
    variants, alignment, backward or not), compile the forward's kernels and, when gradients are
    wanted, the backward's, all at once in the compile pool (:mod:`flashrun.kernels.warmup`),
    and wait for the forward's: a cold first call then waits for its slowest compile instead of
    the sum of them. Returns the batch and the backward's kernels, which the backward waits for.
    The kind is coarser than Triton's key: a launch whose specialization still differs compiles
    on its own, as it would without this. Nothing happens through the interpreter or while a
    run's own compile-ahead (:mod:`flashrun.harness.precompile`) is collecting launches. ``key``:
    the call's :func:`_route_key`, by which a repeat call skips working out its kind."""
    if not warmup.available() or compiling():
        return None, []
    call = (key, deterministic, grad) if key is not None else None
    if call in _ahead_calls:
        return None, []
    Z, H, H_KV, N_Q, N_K, D = _dims(q, k, variant)
    kind = (q.device, q.dtype, q.dim(), D, H // H_KV, next_power_of_2(N_Q), next_power_of_2(N_K),
            N_Q % 16 == 0, N_K % 16 == 0, variant.causal, variant.tuning(N_Q, N_K)["variants"],
            tuple(t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1]) for t in (q, k, v)),
            repr(launch), deterministic, grad)
    if call is not None:
        keep(_ahead_calls, call, True)
    if kind in _ahead:
        return None, []
    _ahead.add(kind)
    batch = warmup.Batch()
    outputs: list[torch.Tensor] = []
    forward = batch.collect(lambda: outputs.extend(_attn_forward(q, k, v, sm_scale, variant, launch)))
    backward = []
    if grad and outputs:
        o, lse = outputs
        backward = batch.collect(lambda: _attn_backward(o, q, k, v, o, lse, sm_scale, variant, launch, deterministic))
    batch.wait(forward)
    return batch, backward


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sm_scale, variant, launch, deterministic):
        key = _route_key(q, k, v, sm_scale, variant, launch, True)
        ctx.ahead = _compile_ahead(q, k, v, sm_scale, variant, launch, deterministic, any(ctx.needs_input_grad[:3]),
                                   key)
        o, lse = _attn_forward(q, k, v, sm_scale, variant, launch, key=key)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sm_scale, ctx.variant, ctx.launch, ctx.deterministic, ctx.key = sm_scale, variant, launch, deterministic, key
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        batch, kernels = ctx.ahead
        if batch is not None:
            batch.wait(kernels)
        dq, dk, dv = _attn_backward(do, q, k, v, o, lse, ctx.sm_scale, ctx.variant, ctx.launch, ctx.deterministic,
                                    key=ctx.key)
        return dq, dk, dv, None, None, None, None  # no gradient for ALiBi slopes (FlashAttention-2 has none either)


def _scale(q: torch.Tensor, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


class _CheckedCall:
    """A call's arguments, checked (:func:`_checked_call`): its variant and scale, q's, k's and v's
    :func:`.launch._meta` where the call is plain (else None), ``width``: the head dim its inputs are
    padded to (:func:`_padded_width`; None: none), and ``decoding``: for a plain call of
    flash-decoding's shapes (:func:`.decode.applies`), its plans for calls without autograd by
    :data:`.decode.PDL`, kept by the first such call (else None). Flash-decoding's route reads no
    switch (neither tuning nor the Gluon path's), so those calls skip :func:`_route_key`: on the
    H200's host a decode call's Python outlasted its ~16-25 µs of kernels (NOTES v22, v23)."""

    __slots__ = ("variant", "scale", "metas", "width", "decoding")

    def __init__(self, variant: Variant, scale: float, metas: tuple | None, width: int | None, decodes: bool) -> None:
        self.variant, self.scale, self.metas, self.width = variant, scale, metas, width
        self.decoding: dict[bool, decode._Plan] | None = {} if decodes else None


def _padded_width(q: torch.Tensor, k: torch.Tensor, variant: Variant) -> int | None:
    """The head dim a call's inputs are zero-padded to where their rows are not whole 16-byte units
    (:func:`.args.aligned_head_dim`), else None. The zero columns add nothing to Q Kᵀ, and O's, dQ's,
    dK's and dV's come out zero and are cut off. Flash-decoding's shapes keep their rows: its kernel
    reads each key once, so a padded copy would triple its traffic, where the other kernels read
    K and V once per query tile."""
    width = aligned_head_dim(q.shape[-1], q.dtype)
    return None if width == q.shape[-1] or decode.applies(q, k, variant) else width


def _pad_head_dim(width: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors)


# the plain calls whose arguments passed the checks, by everything those read (:func:`_checked_call`)
_checked_calls: dict[tuple, _CheckedCall] = {}


def _checked_call(q, k, v, causal, sm_scale, window, softcap, alibi_slopes) -> _CheckedCall:
    """The call's arguments checked (:func:`check_inputs`, :func:`_variant`).
    A call whose tensors have the layouts, dtype, device and alignment of one checked before, with
    the same plain-typed arguments (bool, a tuple of two ints, a number, no ALiBi), skips the checks
    (10.7 µs of Python against 4.7 for the lookup on a 2-core CPU, where a B1 decode call's kernels
    take ~17 µs on the H200; NOTES v20). Anything else is checked every time."""
    plain = (alibi_slopes is None and plain_options(causal, window, softcap, sm_scale)
             and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor)
    metas = (_meta(q), _meta(k), _meta(v)) if plain else None
    if plain:
        key = (*metas, causal, window, softcap, sm_scale)
        found = _checked_calls.get(key)
        if found is not None:
            return found
    check_inputs(q, k, v)
    variant = _variant(q, q.shape[0], k.shape[2], causal, window, softcap, alibi_slopes)
    call = _CheckedCall(variant, _scale(q, sm_scale), metas, _padded_width(q, k, variant),
                        plain and decode.applies(q, k, variant))
    if plain:
        keep(_checked_calls, key, call)
    return call


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      sm_scale: float | None = None, launch: Launch = None, *,
                      window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, no autograd: returns ``(o, lse)``, lse in natural log, float32, (B, H, Nq)."""
    call = _checked_call(q, k, v, causal, sm_scale, window, softcap, alibi_slopes)
    if call.width is not None:
        o, lse = attention_forward(*_pad_head_dim(call.width, q, k, v), causal, call.scale, launch, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes)
        return o[..., :q.shape[-1]], lse
    return _attn_forward(q, k, v, call.scale, call.variant, launch,
                         key=_route_key(q, k, v, call.scale, call.variant, launch, True, metas=call.metas))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, launch: Launch = None, *,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None,
                    deterministic: bool | None = DETERMINISTIC_BACKWARD) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale) v, differentiable. q: (B, H, Nq, D); k, v: (B, H_kv, Nk, D).

    FlashAttention-2's variants (see the module docstring): ``window=(left, right)`` (-1
    unbounded), ``softcap`` (> 0 caps the scores at ±softcap through a tanh), ``alibi_slopes``
    (float32 (H,) or (B, H); :func:`alibi_slopes` gives the standard ones; no gradient).
    ``deterministic``: True the bitwise-repeatable backward (two kernels, 7 matmuls per tile
    pair); False one kernel with 5 matmuls that sums dQ (and a split GQA group's dK, dV) with
    float32 atomics in whatever order they land; None (``flashrun.limits.DETERMINISTIC_BACKWARD``,
    the default) the faster per call: the 5-matmul Gluon sm_90 kernel where it applies, else the deterministic kernels
    (NOTES v10)."""
    call = _checked_call(q, k, v, causal, sm_scale, window, softcap, alibi_slopes)
    if call.width is not None:  # (autograd pads dO and cuts dQ, dK, dV)
        return flash_attention(*_pad_head_dim(call.width, q, k, v), causal, call.scale, launch, window=window,
                               softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)[..., :q.shape[-1]]
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # no graph to record: no autograd
        if call.decoding is not None:  # flash-decoding's plan, at once (_CheckedCall)
            plan = call.decoding.get(decode.PDL)
            if plan is None:
                plan = call.decoding[decode.PDL] = decode.plan(q, k, v, call.scale, call.variant, write_lse=False)
            hopper.LAST_PATH = hopper.TRITON_PATH
            return plan.run(q, k, v, k.shape[2])[0]
        key = _route_key(q, k, v, call.scale, call.variant, launch, True, want_lse=False, metas=call.metas)
        return _attn_forward(q, k, v, call.scale, call.variant, launch, key=key, want_lse=False)[0]
    return FlashAttention.apply(q, k, v, call.scale, call.variant, launch, deterministic)


def _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                    alibi_slopes) -> Variant:
    check_inputs(q, k, v, packed=True)
    starts_q = _cu_seqlens_arg(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q", q.device)
    starts_k = _cu_seqlens_arg(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k", q.device)
    if len(starts_q) != len(starts_k):
        raise ArgumentError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                            f"{len(starts_q) - 1} and {len(starts_k) - 1}")
    longest_q = max(b - a for a, b in itertools.pairwise(starts_q))
    longest_k = max(b - a for a, b in itertools.pairwise(starts_k))
    max_seqlen_q = _max_seqlen_arg(max_seqlen_q, "max_seqlen_q", longest_q)
    max_seqlen_k = _max_seqlen_arg(max_seqlen_k, "max_seqlen_k", longest_k)
    # a window side as wide as the longest keys is unbounded everywhere; narrower ones are
    # decided per sequence in the kernels
    variant = _variant(q, len(starts_q) - 1, longest_k, causal, window, softcap, alibi_slopes)
    return variant.with_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def attention_forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                             max_seqlen_k: int | None = None, causal: bool = False,
                             sm_scale: float | None = None, *, window: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                             launch: Launch = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, packed sequences: ``(o, lse)``, lse (H, total_q) in natural log, float32."""
    variant = _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                              softcap, alibi_slopes)
    width = _padded_width(q, k, variant)
    if width is not None:
        o, lse = _attn_forward(*_pad_head_dim(width, q, k, v), _scale(q, sm_scale), variant, launch)
        return o[..., :q.shape[-1]], lse
    return _attn_forward(q, k, v, _scale(q, sm_scale), variant, launch)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, causal: bool = False,
                           sm_scale: float | None = None, *, window: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                           launch: Launch = None, deterministic: bool | None = DETERMINISTIC_BACKWARD) -> torch.Tensor:
    """Packed sequences (FlashAttention-2's varlen): q (total_q, H, D), k, v (total_k, H_kv, D);
    sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, (B + 1,), a length may be 0) and
    attends on its own (bottom-right alignment per sequence). Returns (total_q, H, D),
    differentiable. ``max_seqlen_*``: the longest lengths if known (else read from cu_seqlens,
    which are checked on the host either way); ``alibi_slopes``: (H,) or (B, H);
    ``deterministic`` as in :func:`flash_attention`."""
    variant = _varlen_variant(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                              softcap, alibi_slopes)
    width = _padded_width(q, k, variant)
    if width is not None:
        return FlashAttention.apply(*_pad_head_dim(width, q, k, v), _scale(q, sm_scale), variant, launch,
                                    deterministic)[..., :q.shape[-1]]
    return FlashAttention.apply(q, k, v, _scale(q, sm_scale), variant, launch, deterministic)
