"""Decode: a few queries against a long key cache (flash-decoding with GQA packing), the lean
launch path it runs through, and the KV-cache API (:func:`flash_attention_with_kvcache`).

Decode reads K and V once and does little arithmetic per byte, so it is bound by memory
bandwidth and, per call, by the host. The kernel:
  * **GQA packing.** One program per (batch, kv head, key split, row tile): its rows are the
    (query, query head) pairs of the kv head's group, query-major (row r is query r // GROUP of
    head r % GROUP), padded to at least 16 rows for ``tl.dot``. Each K/V tile is loaded once for
    the whole group, not once per query head.
  * **Splits.** B·H_kv programs cannot fill the GPU, so the keys are shared out over at most
    ``WAVES`` programs per SM. The share is computed in the kernel from the
    sequence's own length (a KV cache's lengths are device values), in whole key blocks, for
    shares of at least ``MIN_CHUNK_BLOCKS`` blocks; splits past the keys write an empty partial. :func:`_attn_decode_combine` merges the
    partials by log-sum-exp: O = Σ_s 2^(lse_s - lse) O_s, lse = log2 Σ_s 2^lse_s. One split: no
    partials, no combine, one launch.
  * **Masks and variants** as in :mod:`flashrun.kernels.flash.attention` (bottom-right causal
    with ``off = N_K - N_Q`` per sequence, windows, softcap, ALiBi), through the same loop bounds
    (``_key_range`` over the queries a row tile holds) and score helpers.
  * **The cache.** Contiguous (B, S, H_kv, D) - any strides, so ``flash_attention``'s (B, H_kv,
    N, D) is the same kernel - or paged: (num_pages, PAGE_SIZE, H_kv, D) with a block table
    (B, max_pages) int32; key j of sequence b is in page ``block_table[b, j // PAGE_SIZE]`` at
    slot ``j % PAGE_SIZE``. Any page size: each key's page is looked up (one int32 load per key
    per block, cached), so a block may span pages. New keys and values (``k``, ``v`` of the API,
    S_new per sequence) are copied into the cache at positions cache_seqlens[b] .. + S_new by
    the programs whose share holds them, before their attention loops (a barrier between):
    every program that copies a slot writes the same values, so whichever write a read sees
    is right, and the loops read the cache alone (a second source in the loop cost registers).
    Every new key lies in some share even where no query sees it.

The host path is built so that a call does no work that depends only on the shape: a
:class:`_Plan` per (shapes, strides, dtype, variant, alignment) holds the grid, split count,
every launch argument but the data pointers, and on a GPU the compiled kernels, which later
calls launch directly (:mod:`.launch`) instead of through Triton's per-call specialization. The partials live in a per-(device, stream) workspace allocated once (during
CUDA-graph capture: per call, from the graph's pool). A call is graph-capturable.

**Lengths past the cache never lose a key.** Device-side ``cache_seqlens`` (and a paged cache's
block table) are checked on the host before the launch (:func:`_check_in_cache`): a length with
no room for the new keys, or a page outside the cache, raises :class:`~flashrun.errors.ArgumentError`
and nothing is written. The check reads the tensor back (one sync), once per version of it: a
model's layers passing the same lengths in one step pay it once. While a CUDA graph is being
captured nothing can be read back; the kernel then refuses such a sequence itself: it writes no
slot and its output (and LSE) is NaN.
"""

from __future__ import annotations

import math
import numbers
import os
import weakref
from dataclasses import dataclass, replace

import torch

from flashrun.errors import ArgumentError, KernelError
from flashrun.kernels.flash.args import (
    SUPPORTED_DTYPES,
    Variant,
    _check_device,
    _split_head_dim,
    _variant,
    dot_options,
    plain_options,
)
from flashrun.kernels.flash.decode_jit import KV_FP8_F16, KV_FP8_WIDEN, _attn_decode, _attn_decode_combine
from flashrun.kernels.flash.launch import _current_stream, _hashable, _Launch, _meta, keep
from flashrun.kernels.tuning import INTERPRETED, LaunchConfig, cdiv, next_power_of_2
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM

# flash_attention takes this path for at most DECODE_MAX_QUERIES queries per head against at
# least DECODE_MIN_KEYS keys (a row tile then faces many key blocks); the KV-cache API always.
DECODE_MAX_QUERIES = 64
DECODE_MIN_KEYS = 256
WAVES = 2  # programs per SM the splits aim at (benchmarks/probes/decode_probe.py --waves times others)
MIN_CHUNK_BLOCKS = 4  # a split takes at least this many key blocks
# Fixed configs, not tuned: the work is bound by reading K and V once (NOTES v3).
# Past head_dim 128 (and for float32's IEEE dots) 32-key tiles: a 64-key one holds 158-212
# registers a thread at head_dim 192-256 (ptxas for sm_90, tests/compile_for_gpu.py; no spill),
# fewer programs per SM. (The spills once quoted here were a compile without the launch's
# 16-byte alignment, which vectorized no load.) 32 against 64 keys there is not yet timed.
DECODE = LaunchConfig(block_n=64, num_warps=4, num_stages=3)
DECODE_WIDE = LaunchConfig(block_n=32, num_warps=4, num_stages=3)
DECODE_FP8 = LaunchConfig(block_n=64, num_warps=4, num_stages=2)  # an fp8 cache at head_dim <= 128 (see _config)
DECODE_INTERPRETER = LaunchConfig(block_n=32, num_warps=4, num_stages=1)
# programmatic dependent launch (sm_90+; NOTES v21): the decode kernel may start while
# the kernel before it drains, and the combine while the decode grid's last programs run; each
# waits for its predecessor's writes in the kernel (griddepcontrol.wait). FLASHRUN_PDL=0 turns it
# off; a plan's key holds it, so that benchmarks/probes/decode_probe.py can compare the two in one process
PDL = os.environ.get("FLASHRUN_PDL", "").strip().lower() not in ("0", "false", "off", "no")
# An fp8 cache at head_dim <= 128: the kernel held to 128 registers a thread (no spill but 16 B
# paged with one scale and bf16 queries) and four programs per SM: on the H200 1.05-1.3x faster
# than two of ~180 registers, paged the most (decode_probe.py --fp8-sweep: GQA 32/8, 8k-128k keys)
FP8_REGISTERS = 128
FP8_WAVES = 4
# bfloat16 queries against an fp8 cache: the dots in float16 (decode_jit._queries_f16), not
# bfloat16: on the H200 1.2-1.3x faster (decode_probe.py --fp8-sweep), e4m3 widening to float16
# in one instruction per pair and to bfloat16 in three
FP8_DOT_F16 = True
# An fp8 cache's V tiles widened by inline PTX after a 16-byte shared read (decode_jit._widen),
# not by Triton's cast, which becomes a 1-byte shared load per element of the transposed operand.
# A V cache whose keys are contiguous (memory (B or page, H_kv, D, keys), vLLM's value-cache
# layout) is no transposed operand: Triton's cast reads it whole, without the float16 staging
FP8_V_PTX = True
# An fp8 cache at head_dim 128, one scale, up to 16 rows and no variant on sm_90 may run
# hopper_decode_jit's Gluon kernel, which reads K and V straight into the MMA operands' registers
# (the portable kernel moves each byte through shared memory four times), once its first-use check
# agreed with the portable kernel. Off unless FLASHRUN_DECODE_GLUON=1 at import: on the H100 it
# ran as fast as the portable kernel, no faster (the decode-fp8-gluon-h100 claim)
GLUON_FP8 = os.environ.get("FLASHRUN_DECODE_GLUON", "").strip().lower() in ("1", "true", "on", "yes")
# ... and with token scales too: off, its per-block cross-warp maximum of V's scales and the
# scales' loads ran it 1.1-1.3x slower than the portable kernel there
GLUON_TOKEN_SCALES = False
COMBINE_TILE = 8192  # partial elements the combine merges per step (splits x columns; 64 registers a thread)
COMBINE_MIN_COLS = 32  # the narrowest column block a combine program takes



_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, stream: int | None, o_numel: int, lse_numel: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for the splits' partial outputs and log-sum-exps. One pair per (device,
    stream), grown as needed: calls on one stream run in order, so they can share it. During
    CUDA-graph capture, fresh ones from the graph's pool (which lives as long as the graph)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (torch.empty(o_numel, dtype=torch.float32, device=device),
                torch.empty(lse_numel, dtype=torch.float32, device=device))
    key = (device.index or 0, stream or 0)
    held = _workspaces.get(key)
    if held is None or held[0].numel() < o_numel or held[1].numel() < lse_numel:
        sizes = (o_numel, lse_numel) if held is None else (max(o_numel, held[0].numel()),
                                                           max(lse_numel, held[1].numel()))
        held = _workspaces[key] = tuple(torch.empty(n, dtype=torch.float32, device=device) for n in sizes)
    return held


# ---------------------------------------------------------------------------------------------
# Plans


def _config(dtype: torch.dtype, head_dim: int, page_size: int = 0, kv_fp8: bool = False) -> LaunchConfig:
    """The fixed config; a paged cache whose pages do not hold whole key blocks (each key's page
    looked up) at most 2 stages: on the H200, page 16, B2/B16/B1-MQA bf16, 51.2/85.0/19.0 us
    against 53.2/87.6/20.4 at 3 stages (contiguous: 3 stages the faster, NOTES v21). An fp8 cache
    at head_dim <= 128 takes DECODE_FP8 (and FP8_REGISTERS, FP8_WAVES): 64-key tiles, which on the
    H200 read it 1.0-1.3x faster than 32-key ones (whose quarter of the bytes per step left too
    few loads in flight), at 2 stages, which on the H100 read it 1.01-1.07x faster than 3 (token
    scales the most; decode_probe.py --fp8-sweep, the decode-fp8-sweep claim: GQA 32/8, 8k-128k keys)."""
    if INTERPRETED:
        return DECODE_INTERPRETER
    if kv_fp8 and head_dim <= 128:
        cfg = DECODE_FP8
    else:
        cfg = DECODE_WIDE if dtype == torch.float32 or head_dim > 128 else DECODE
    if page_size % cfg.block_n:
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2))
    return cfg


_sms: dict[int | None, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if INTERPRETED:
        return 4  # small, so that the interpreter tests reach the split path with small shapes
    if device.index not in _sms:
        _sms[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[device.index]


_capabilities: dict[int | None, tuple[int, int]] = {}


def _pdl(device: torch.device) -> bool:
    """Whether this device's launches are programmatic dependent ones (:data:`PDL`, sm_90+)."""
    if not PDL or INTERPRETED or device.type != "cuda":
        return False
    if device.index not in _capabilities:
        _capabilities[device.index] = torch.cuda.get_device_capability(device)
    return _capabilities[device.index] >= (9, 0)


def _options(cfg: LaunchConfig, pdl: bool) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **({"launch_pdl": True} if pdl else {})}


def block_m(group: int, n_q: int, head_dim: int) -> int:
    """Rows of a tile: the group's (query, head) pairs, at least 16 (``tl.dot``), at most 64
    (32 past head_dim 128: the accumulator's registers)."""
    return min(max(16, next_power_of_2(group * n_q)), 64 if head_dim <= 128 else 32)


def num_splits(programs: int, keys: int, block_n: int, device: torch.device, waves: int | None = None) -> int:
    """Key splits for ``programs`` (batch, kv head, row tile) over at most ``keys`` keys: at most
    ``waves`` (WAVES) programs per SM (a whole number of waves: more would leave a partial one),
    each split at least MIN_CHUNK_BLOCKS key blocks."""
    chunk = MIN_CHUNK_BLOCKS * block_n
    return max(1, min((waves or WAVES) * _multiprocessors(device) // programs, cdiv(keys, chunk)))


def combine_cols(programs: int, head_dim: int, device: torch.device) -> int:
    """Head-dim columns per combine program, for ``programs`` (row, batch and kv head) pairs: the
    whole (padded) head dim where they fill WAVES programs per SM, else narrower blocks (at least
    COMBINE_MIN_COLS) so that a few rows' long merges spread over more programs - MQA at batch 1
    is 32 rows merging up to 264 splits each (H200: 0.77 -> 0.87 of cuDNN at 16k keys, 0.75 ->
    0.93 at 128k, NOTES v12)."""
    padded = max(16, next_power_of_2(head_dim))
    blocks = cdiv(WAVES * _multiprocessors(device), programs)
    return min(padded, max(COMBINE_MIN_COLS, next_power_of_2(cdiv(head_dim, blocks))))


@dataclass(frozen=True)
class _Dims:
    """A call's sizes and strides. Strides are (batch, row, head, dim) - for a paged cache
    (page, slot, head, dim) - whatever the tensors' own order of dims."""

    batch: int
    heads: int
    kv_heads: int
    n_q: int
    head_dim: int
    q: tuple[int, int, int, int]
    k: tuple[int, int, int, int]
    v: tuple[int, int, int, int]
    out: tuple[int, ...]  # the output's shape, allocated contiguous
    o: tuple[int, int, int, int]  # its strides
    new: tuple[int, int, int, int] = (0, 0, 0, 0)  # appended k and v (one layout for both)
    n_new: int = 0
    capacity: int = 0  # keys a sequence's cache holds (KV cache; checked against n_new)
    page_size: int = 0  # 0: contiguous cache
    table_stride: int = 0  # the block table's row stride
    keys: int = 0  # the most keys a sequence may hold: what the splits are sized for
    kv_fp8: bool = False  # an fp8 cache, dequantized as it is read
    k_scale: float = 1.0  # an fp8 cache's scales for the whole cache (1.0 with token scales)
    v_scale: float = 1.0
    scales: tuple[int, int, int] | None = None  # token scales' strides (page or batch, key, kv head)


@dataclass(frozen=True)
class _Plan:
    decode: _Launch
    combine: _Launch | None  # None: one split
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...] | None  # None: no LSE wanted
    partials: tuple[int, int]  # float32 elements of O_PART and LSE_PART
    splits: int
    room: int  # cached keys a sequence may hold before the new ones (KV cache)
    final: bool = True  # False: made while the Gluon kernel's first-use check was undecided (not kept)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_k: int, k_new=None, v_new=None,
            seqlens=None, block_table=None, alibi=None, scales=(None, None, None, None)
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``scales``: an fp8 cache's token scales, the cache's K and V then the new keys' K and V."""
        o = q.new_empty(self.out_shape)
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        stream = _current_stream(q.device)
        o_part = lse_part = None
        if self.combine is not None:
            o_part, lse_part = _workspace(q.device, stream, *self.partials)
        self.decode(stream, q, k, v, o, lse, k_new, v_new, seqlens, block_table, alibi, o_part, lse_part, *scales, n_k)
        if self.combine is not None:
            self.combine(stream, o_part, lse_part, o, lse)
        return o, lse


def _kv_fp8(dims: _Dims, dtype: torch.dtype) -> int:
    """The decode kernel's KV_FP8 constexpr."""
    if not dims.kv_fp8:
        return 0
    return (KV_FP8_F16 if FP8_DOT_F16 and dtype == torch.bfloat16 else KV_FP8_WIDEN).value


def _make_plan(dims: _Dims, dtype: torch.dtype, device: torch.device, variant: Variant, sm_scale: float,
               seqlens: bool, write_lse: bool) -> _Plan:
    """Everything a call of these dims launches with, but the data pointers and N_K."""
    if dims.n_q == 1 and variant.causal:  # one query, bottom-right: it sees every key (as FlashAttention-2 folds it)
        variant = replace(variant, causal=False)
    group = dims.heads // dims.kv_heads
    cfg = _config(dtype, dims.head_dim, dims.page_size, dims.kv_fp8)
    bm = block_m(group, dims.n_q, dims.head_dim)
    tiles = cdiv(group * dims.n_q, bm)
    pairs = dims.batch * dims.kv_heads
    held = dims.kv_fp8 and dims.head_dim <= 128 and not INTERPRETED  # FP8_REGISTERS, FP8_WAVES
    gluon = _gluon_route(dims, dtype, device, variant, bm)
    splits = num_splits(pairs * tiles, dims.keys, cfg.block_n, device, FP8_WAVES if held else None)
    d0, d1 = _split_head_dim(dims.head_dim)
    var = variant.kernel_args(sm_scale, dtype)
    pdl = _pdl(device)
    queries = bm // group + (2 if bm % group else 0)  # queries a tile's rows can belong to (at most)
    new_scales = (dims.n_new * dims.kv_heads, dims.kv_heads, 1)  # the new keys' token scales: (B, S_new, H_kv)
    tail = (*dims.q, *dims.k, *dims.v, *dims.o, *dims.new, dims.table_stride, var["stride_az"], var["stride_ah"],
            *(dims.scales or (0, 0, 0)), *new_scales, dims.kv_heads, dims.n_q, dims.n_new, dims.capacity, splits,
            var["qk_scale"] * dims.k_scale, dims.v_scale, var["softcap2"], var["win_left"], var["win_right"],
            group, dims.head_dim, d0, d1, bm, cfg.block_n, queries, dims.page_size, seqlens, dims.n_new > 0,
            splits > 1, write_lse, var["CAUSAL"], var["WINDOW"], var["SOFTCAP"], var["ALIBI"],
            *dot_options(dtype).values(), _kv_fp8(dims, dtype), dims.scales is not None,
            dims.kv_fp8 and FP8_V_PTX and dims.v[1] != 1 and not INTERPRETED, pdl)
    if gluon:
        from flashrun.kernels.flash.hopper_decode_jit import NUM_WARPS, _attn_decode_fp8

        decode = _Launch(_attn_decode_fp8, (splits, tiles, pairs), tail,
                         {"num_warps": NUM_WARPS, **({"launch_pdl": True} if pdl else {})})
    else:
        decode = _Launch(_attn_decode, (splits, tiles, pairs), tail,
                         {**_options(cfg, pdl), **({"maxnreg": FP8_REGISTERS} if held else {})})
    combine = None
    if splits > 1:
        cols = combine_cols(group * dims.n_q * pairs, dims.head_dim, device)
        block_s = min(next_power_of_2(splits), COMBINE_TILE // cols)
        combine = _Launch(_attn_decode_combine, (group * dims.n_q, pairs, cdiv(dims.head_dim, cols)),
                          (*dims.o, dims.kv_heads, dims.n_q, splits, group, dims.head_dim, bm, cols, block_s,
                           write_lse, pdl), _options(LaunchConfig(num_warps=4, num_stages=1), pdl))
    rows = pairs * tiles * splits * bm
    lse_shape = (dims.batch, dims.heads, dims.n_q) if write_lse else None
    return _Plan(decode, combine, dims.out, lse_shape, (rows * dims.head_dim, rows), splits,
                 dims.capacity - dims.n_new, final=gluon is not None)


_ROUTE: list[str] = []  # a forced route ("gluon" or "portable"): the first-use check's own calls
_gluon_checked: dict[tuple, str | None] = {}  # (dtype, head_dim) -> hopper.first_use's verdict


def _gluon_route(dims: _Dims, dtype: torch.dtype, device: torch.device, variant: Variant, bm: int) -> bool | None:
    """Whether a plan takes the Gluon fp8 kernel (:data:`GLUON_FP8`); None while its first-use
    check is undecided (compiling in the background: the portable kernel runs meanwhile)."""
    if _ROUTE:
        return _ROUTE[-1] == "gluon"
    from flashrun.kernels.flash import hopper

    if not (GLUON_FP8 and dims.kv_fp8 and not INTERPRETED and device.type == "cuda" and dims.head_dim == 128
            and bm == 16 and not variant.causal and variant.window is None and variant.softcap == 0
            and variant.alibi_slopes is None and dims.k[3] == 1 and dims.v[3] == 1
            and (dims.n_new == 0 or dims.new[3] == 1) and (dims.scales is None or GLUON_TOKEN_SCALES)):
        return False
    if (not hopper.ENABLED or hopper._disabled_by_env() or hopper._capability(device.index or 0) != (9, 0)
            or hopper._api_reason()):
        return False
    return hopper.first_use(_gluon_checked, (dtype, dims.head_dim), lambda: _gluon_check(device, dtype),
                            "fp8-cache decode")


def _gluon_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Gluon fp8 kernel agrees with the portable one on small caches (contiguous and
    pages of 16, one scale and token scales, ragged lengths, an appended key), else how not: within
    the forward's check bounds (both round P to 16 bits, in different orders)."""
    from flashrun.kernels.flash import hopper
    from flashrun.kernels.tuning import compiling

    gen = torch.Generator(device="cpu").manual_seed(0)
    b, h_kv, group, cap = 2, 2, 4, 320
    q = torch.randn(b, 1, h_kv * group, 128, generator=gen).to(device=device, dtype=dtype)
    new = [torch.randn(b, 1, h_kv, 128, generator=gen).to(device=device, dtype=dtype) for _ in range(2)]
    lens = torch.tensor([300, 77], dtype=torch.int32, device=device)
    kv = [torch.randn(b, cap, h_kv, 128, generator=gen).to(device) for _ in range(2)]
    for paged in (False, True):
        for token in (False, True):
            k_cache, v_cache = (x.to(torch.float8_e4m3fn) for x in kv)
            table = None
            if paged:
                k_cache, v_cache = (x.reshape(b * cap // 16, 16, h_kv, 128) for x in (k_cache, v_cache))
                table = torch.arange(b * cap // 16, dtype=torch.int32, device=device).flip(0).reshape(b, -1)
            scales = ({"k_scale": torch.rand(k_cache.shape[:3], generator=gen).to(device) + 0.5,
                       "v_scale": torch.rand(k_cache.shape[:3], generator=gen).to(device) + 0.5}
                      if token else {"k_scale": 0.7, "v_scale": 1.3})
            outs = []
            for route in ("gluon", "portable"):
                _ROUTE.append(route)
                try:
                    outs.append(flash_attention_with_kvcache(q, k_cache, v_cache, lens, k=new[0], v=new[1],
                                                             block_table=table, return_lse=True, **scales))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except Exception as exc:  # noqa: BLE001 - any failure turns the path off
                    return f"the {route} kernel raised {type(exc).__name__}: {str(exc).strip()[-200:]}"
                finally:
                    _ROUTE.pop()
            if compiling():
                continue
            (o, lse), (o_ref, lse_ref) = outs
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_l = (lse - lse_ref).abs().max().item()
            if not (err_o <= hopper.CHECK_ATOL[dtype] and err_l <= 1e-3):  # NaN fails too
                return (f"disagrees with the portable kernel ({'pages of 16' if paged else 'contiguous'}, "
                        f"{'token' if token else 'whole-cache'} scales: max |dO| {err_o:.3g}, max |dLSE| {err_l:.3g})")
    return None


_plans: dict[tuple, _Plan] = {}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------
# flash_attention's decode shapes


def applies(q: torch.Tensor, k: torch.Tensor, variant: Variant) -> bool:
    """Whether ``flash_attention`` runs these inputs here: dense, few queries, many keys."""
    return not variant.varlen and q.shape[2] <= DECODE_MAX_QUERIES and k.shape[2] >= DECODE_MIN_KEYS


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
         write_lse: bool = True) -> _Plan:
    """The plan of a :func:`forward` call (cached by everything it depends on)."""
    key = ("dense", _meta(q), _meta(k), _meta(v), _meta(variant.alibi_slopes), variant.causal, variant.window,
           variant.softcap, sm_scale, write_lse, PDL)
    found = _plans.get(key)
    if found is not None:
        return found
    batch, heads, n_q, head_dim = q.shape
    first, end = variant.key_span(n_q, k.shape[2])

    def order(t: torch.Tensor) -> tuple[int, int, int, int]:  # (B, H, N, D) -> (batch, row, head, dim)
        return t.stride(0), t.stride(2), t.stride(1), t.stride(3)

    o_strides = _contiguous_strides(q.shape)
    dims = _Dims(batch, heads, k.shape[1], n_q, head_dim, order(q), order(k), order(v), tuple(q.shape),
                 (o_strides[0], o_strides[2], o_strides[1], o_strides[3]), keys=end - first)
    made = _make_plan(dims, q.dtype, q.device, variant, sm_scale, seqlens=False, write_lse=write_lse)
    return keep(_plans, key, made) if made.final else made


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, variant: Variant,
            write_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, lse)`` for checked (B, H, Nq, D) inputs where :func:`applies`; lse (B, H, Nq), or
    None without ``write_lse`` (a call without autograd: no allocation, no store)."""
    return plan(q, k, v, sm_scale, variant, write_lse).run(q, k, v, k.shape[2], alibi=variant.alibi_slopes)


# ---------------------------------------------------------------------------------------------
# The KV-cache API


def _tensor_arg(t, name: str, dims: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise KernelError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
    return t


FP8_CACHE = (torch.float8_e4m3fn,)  # cache dtypes stored in 8 bits, dequantized as they are read
FP8_MAX = 448.0  # e4m3's largest finite value


def _layouts_differ(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether two tensors of one shape (new keys and values, or their token scales) lay their
    elements out differently (a size-1 dim's stride never counts)."""
    return k.shape == v.shape and any(a != b for a, b, n in zip(k.stride(), v.stride(), k.shape) if n > 1)


def _kvcache_dims(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale=None, v_scale=None) -> _Dims:
    """Check the KV-cache call's tensors (every message names the argument) and size it."""
    _tensor_arg(q, "q", 4, "(batch, seqlen_q, heads, head_dim)")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, kv_heads, head_dim)" if paged else "(batch, seqlen_cache, kv_heads, head_dim)"
    _tensor_arg(k_cache, "k_cache", 4, cache_layout)
    _tensor_arg(v_cache, "v_cache", 4, cache_layout)
    batch, n_q, heads, head_dim = q.shape
    if q.dtype not in SUPPORTED_DTYPES:
        raise KernelError(f"dtype {q.dtype} is not supported", hint="use float16, bfloat16 or float32")
    if k_cache.shape != v_cache.shape:
        raise KernelError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                          f"{tuple(v_cache.shape)}")
    fp8 = k_cache.dtype in FP8_CACHE
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != (k_cache.dtype if fp8 else q.dtype):
            raise KernelError(f"{name} must have q's dtype {q.dtype} (or both caches float8_e4m3fn), got {t.dtype}")
        if t.device != q.device:
            raise KernelError(f"{name} is on {t.device}, q on {q.device}")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise KernelError(f"head_dim differs: q has {head_dim}, k_cache/v_cache have {k_cache.shape[3]}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise KernelError(f"head_dim must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise KernelError(f"q's {heads} heads are not a multiple of the cache's {kv_heads} kv heads",
                          hint="GQA/MQA needs num_heads % num_kv_heads == 0")
    if batch == 0 or n_q == 0 or heads == 0:
        raise KernelError(f"empty input: q {tuple(q.shape)}")
    _check_device(q)
    if paged:
        _tensor_arg(block_table, "block_table", 2, "(batch, max_pages)")
        if block_table.dtype != torch.int32:
            raise ArgumentError(f"block_table must be int32, got {block_table.dtype}",
                                hint="pass block_table.to(torch.int32)")
        rows_contiguous = block_table.stride(1) == 1 or block_table.shape[1] == 1  # (one page a row: any stride)
        if block_table.shape[0] != batch or block_table.device != q.device or not rows_contiguous:
            raise ArgumentError(f"block_table must be ({batch}, max_pages) on {q.device} with contiguous rows, got "
                                f"{tuple(block_table.shape)} on {block_table.device}, strides {block_table.stride()}")
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise KernelError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch}",
                              hint="without a block_table the cache is (batch, seqlen_cache, kv_heads, head_dim)")
        page_size, capacity = 0, k_cache.shape[1]
    if (k is None) != (v is None):
        raise ArgumentError("k and v (the new keys and values) come together: give both or neither")
    n_new, new_strides = 0, (0, 0, 0, 0)
    if k is not None:
        _tensor_arg(k, "k", 4, "(batch, seqlen_new, kv_heads, head_dim)")
        _tensor_arg(v, "v", 4, "(batch, seqlen_new, kv_heads, head_dim)")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise KernelError(f"k and v must be ({batch}, seqlen_new, {kv_heads}, {head_dim}), got "
                              f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
            raise KernelError(f"k and v must be {q.dtype} on {q.device} like q, got {k.dtype} on {k.device} and "
                              f"{v.dtype} on {v.device}")
        n_new, new_strides = k.shape[1], tuple(k.stride())
        if n_new > capacity:
            raise ArgumentError(f"{n_new} new keys do not fit a cache of {capacity} per sequence")
    if isinstance(cache_seqlens, torch.Tensor):
        if (cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,)
                or cache_seqlens.device != q.device):
            raise ArgumentError(f"cache_seqlens must be an int or an int32 ({batch},) tensor on {q.device}, got "
                                f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)} on {cache_seqlens.device}",
                                hint="pass cache_seqlens.to(torch.int32)")
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
        raise ArgumentError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    scales = _fp8_scales(q, k_cache, k_scale, v_scale) if fp8 else None
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ArgumentError("k_scale and v_scale dequantize an fp8 cache; this one is " + str(k_cache.dtype)[6:])
    if fp8 and k is not None:  # the new keys are quantized by the call into contiguous fp8 tensors
        new_strides = _contiguous_strides(tuple(k.shape))
    o_strides = _contiguous_strides(q.shape)
    whole = (float(k_scale or 1.0), float(v_scale or 1.0)) if fp8 and scales is None else (1.0, 1.0)
    return _Dims(batch, heads, kv_heads, n_q, head_dim, tuple(q.stride()), tuple(k_cache.stride()),
                 tuple(v_cache.stride()), tuple(q.shape), o_strides, new_strides, n_new, capacity, page_size,
                 0 if block_table is None else block_table.stride(0), capacity, fp8, *whole, scales)


def _fp8_scales(q, k_cache, k_scale, v_scale) -> tuple[int, int, int] | None:
    """An fp8 cache's scales: None (1.0) or numbers for the whole cache (-> None), or float32
    tensors with one scale per key and kv head, shaped like the cache without head_dim (-> their
    strides)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise KernelError(f"an fp8 cache takes float16 or bfloat16 queries, got {q.dtype}")
    tensors = [isinstance(s, torch.Tensor) for s in (k_scale, v_scale)]
    if not any(tensors):
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0):
                raise ArgumentError(f"{name} must be a positive number (the whole cache's) or a float32 tensor of "
                                    f"one scale per key and kv head, got {scale!r}")
        return None
    shape = tuple(k_cache.shape[:3])
    if not all(tensors) or any(s.dtype != torch.float32 or tuple(s.shape) != shape or s.device != q.device
                               for s in (k_scale, v_scale)) or _layouts_differ(k_scale, v_scale):
        raise ArgumentError(f"token scales: k_scale and v_scale must both be float32 tensors {shape} on {q.device} "
                            "(the cache's shape without head_dim) laid out alike",
                            hint="or pass a number each: one scale for the whole cache")
    return tuple(k_scale.stride())


def _quantize(x: torch.Tensor, scale: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New keys or values (B, S_new, H_kv, D) into e4m3: divided by the cache's scale (a number),
    or by a scale of their own per key and kv head (``scale`` a tensor: the cache's, which the
    kernel copies theirs into): the power of two at or above amax / 448, so that nothing
    saturates and ``x8 * scale`` is exact in bf16 and fp16. -> (x8, token scales or None)."""
    if isinstance(scale, torch.Tensor):
        amax = x.float().abs().amax(-1)  # (B, S_new, H_kv)
        own = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
        own = torch.where(amax > 0, own, torch.ones_like(own))  # an all-zero row: any scale, 1
        return (x.float() / own[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), own
    return (x.float() / float(scale or 1.0)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None


# the last lengths (and block table) checked, by identity and version: (tensor ref, version, bounds)
_checked: dict[str, tuple[weakref.ref, int, tuple]] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _seen(name: str, t: torch.Tensor, bounds: tuple) -> bool:
    """Whether this very tensor, unchanged since, passed the same check last time (and note it now)."""
    last = _checked.get(name)
    if last is not None and last[0]() is t and last[1:] == (t._version, bounds):
        return True
    _checked[name] = (weakref.ref(t), t._version, bounds)
    return False


def _extremes(t: torch.Tensor) -> tuple[int, int]:
    """min and max of a device tensor, read back at once (the one sync of a check)."""
    low, high = torch.stack([t.min(), t.max()]).tolist()
    return low, high


def _check_in_cache(cache_seqlens: torch.Tensor, k_cache: torch.Tensor, n_new: int,
                    block_table: torch.Tensor | None) -> None:
    """Refuse lengths with no room for the ``n_new`` keys, and block-table pages outside the
    cache, before anything is written (see the module's docstring: one read-back, skipped for a
    tensor already checked unchanged, and under CUDA-graph capture)."""
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    room = capacity - n_new
    if _capturing(cache_seqlens.device):
        return
    lengths_changed = not _seen("cache_seqlens", cache_seqlens, (room,))
    if lengths_changed:
        low, high = _extremes(cache_seqlens)
        if low < 0 or high > room:
            _checked.pop("cache_seqlens")
            raise ArgumentError(
                f"cache_seqlens must be in 0..{room} (a sequence's cache holds {capacity} keys"
                + (f", {n_new} of them for the new ones" if n_new else "") + f"), got {low}..{high}",
                hint="nothing was written: grow the cache (or its block table) or evict keys before appending")
    if block_table is None:
        return
    num_pages = k_cache.shape[0]
    if not _seen("block_table", block_table, (n_new, num_pages)) or lengths_changed:
        # the pages that hold each sequence's keys, new ones included; other entries are never read
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] \
            < ((cache_seqlens + n_new + page_size - 1) // page_size)[:, None]
        pages = block_table[used]
        first, last = _extremes(pages) if pages.numel() else (0, 0)
        if first < 0 or last >= num_pages:
            _checked.pop("block_table")
            raise ArgumentError(f"block_table points at page {first if first < 0 else last}; the cache has pages "
                                f"0..{num_pages - 1}", hint="nothing was written")


def flash_attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cache_seqlens: int | torch.Tensor, *, k: torch.Tensor | None = None,
                                 v: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                                 causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                 alibi_slopes: torch.Tensor | None = None, sm_scale: float | None = None,
                                 k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
                                 return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over a KV cache, FlashAttention-2's ``flash_attn_with_kvcache``
    (forward only). Layouts are (batch, seq, heads, head_dim):

    * ``q`` (B, Sq, H, D); ``k_cache``, ``v_cache`` (B, S, H_kv, D), or paged (num_pages,
      page_size, H_kv, D) with ``block_table`` (B, max_pages) int32 (any page size; sequence b's
      key j is in page ``block_table[b, j // page_size]``); H a multiple of H_kv;
    * ``cache_seqlens``: the keys each sequence holds, an int or an int32 (B,) tensor: each in
      0..capacity - S_new, else :class:`~flashrun.errors.ArgumentError` and nothing is written
      (under CUDA-graph capture the kernel refuses the sequence instead: no write, NaN output);
    * ``k``, ``v`` (B, S_new, H_kv, D): written into the cache in place at positions
      cache_seqlens[b] .. + S_new, then attended to with it (``cache_seqlens`` itself is not
      advanced: that is the caller's);
    * ``causal`` is bottom-right aligned against the sequence's cache_seqlens[b] + S_new keys,
      ``window``, ``softcap``, ``alibi_slopes`` ((H,) or (B, H) float32) as in
      :func:`~flashrun.kernels.flash_attention`;
    * an **fp8 cache**: ``k_cache``, ``v_cache`` float8_e4m3fn with float16/bfloat16 ``q``, read
      as ``cache * scale``: ``k_scale``, ``v_scale`` numbers for the whole cache (default 1), or
      float32 tensors of one scale per key and kv head, shaped like the cache without head_dim
      ((B, S, H_kv), or (num_pages, page_size, H_kv)). New ``k``, ``v`` come in q's dtype and are
      quantized by the call: divided by the cache's scale, or each key and value by its own
      (amax / 448, written into the scale tensors beside it).

    Returns (B, Sq, H, D), and with ``return_lse`` also the log-sum-exp of each row's scores
    (B, H, Sq) float32, natural log (-inf for a query that sees no key), FlashAttention-2's
    ``return_softmax_lse``: what merging attention over several caches needs. A tensor
    ``cache_seqlens`` is read back once per version to check it; the call can be captured in a
    CUDA graph."""
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and _layouts_differ(k, v):
        k, v = k.contiguous(), v.contiguous()  # one layout for the kernel (views of a fused qkv differ: phi3's)
    slopes = alibi_slopes
    options = (causal, window, softcap, sm_scale)
    if not plain_options(causal, window, softcap, sm_scale):
        options = _hashable(options)  # (a bad value only has to fail its check, once)
    key = ("kvcache", *[_meta(t) if isinstance(t, torch.Tensor) else _hashable(t)
                        for t in (q, k_cache, v_cache, k, v, block_table, slopes, k_scale, v_scale)], options,
           _meta(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else int, bool(return_lse), PDL,
           tuple(_ROUTE))
    plan = _plans.get(key)
    if plan is None:
        dims = _kvcache_dims(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale)
        # the mask folded as flash_attention folds it, against the longest a sequence can be
        variant = _variant(q.transpose(1, 2), dims.batch, dims.capacity, causal, window, softcap, alibi_slopes)
        scale = 1.0 / math.sqrt(dims.head_dim) if sm_scale is None else float(sm_scale)
        plan = _make_plan(dims, q.dtype, q.device, variant, scale, seqlens=isinstance(cache_seqlens, torch.Tensor),
                          write_lse=bool(return_lse))
        if plan.final:
            keep(_plans, key, plan)
    n_k = 0
    if isinstance(cache_seqlens, torch.Tensor):
        _check_in_cache(cache_seqlens, k_cache, 0 if k is None else k.shape[1], block_table)
    else:
        n_k = int(cache_seqlens)
        if not 0 <= n_k <= plan.room:
            raise ArgumentError(f"cache_seqlens must be in 0..{plan.room} (the cache's capacity less the new "
                                f"keys), got {n_k}")
        cache_seqlens = None
    scales = (None, None, None, None)
    if k_cache.dtype in FP8_CACHE:
        new_k_scale = new_v_scale = None
        if k is not None:
            (k, new_k_scale), (v, new_v_scale) = _quantize(k, k_scale), _quantize(v, v_scale)
        if isinstance(k_scale, torch.Tensor):
            scales = (k_scale, v_scale, new_k_scale, new_v_scale)
    o, lse = plan.run(q, k_cache, v_cache, n_k, k, v, cache_seqlens, block_table, slopes, scales)
    return (o, lse) if return_lse else o
