"""One attention shape, as verify, bench, cases files and the tests all use it.

A :class:`Shape` is everything that decides a kernel's inputs and the maths it must compute:
batch, heads (fewer kv heads for GQA/MQA), query and key lengths, head_dim, dtype, the mask,
and FlashAttention-2's variants (sliding ``window``, ``softcap``, ``alibi`` with the standard
slopes, packed sequences ``seqlens``). Its fields are named like the ``[experiment]`` keys, so
a shape, a config section and a cases-file entry read the same; :attr:`Shape.label` is its one
printed name. The variant fields default to plain attention, so records written before they
existed still load (``Shape(**record)``).

Packed sequences (varlen): ``seqlens`` are the query lengths of the sequences packed back to
back, ``seqlens_k`` the key lengths (None: the same as the queries). Then ``batch_size`` is
the number of sequences and ``seq_len``/``seq_len_k`` the longest ones (what the kernels' grid
spans); :func:`packed` builds such a shape.

A KV-cache call (``flash_attention_with_kvcache``): ``cache_seqlens`` are the keys each
sequence holds in the cache, ``new_keys`` the keys (and values) the call appends to each, and
``page_size`` the cache's page size (0: a contiguous cache). ``seq_len`` queries per sequence
attend to its cached and new keys; ``batch_size`` is the number of sequences and ``seq_len_k``
the longest cached + new (:func:`kvcache` builds such a shape); the cache holds
:attr:`Shape.capacity` keys per sequence, past every sequence's end. ``kv_scale`` stores it in
float8_e4m3fn with one scale (``"tensor"``) or one per key and kv head (``"token"``).

Where shapes come from:
  * ``flashrun verify``: ``[experiment]`` as one shape, or the cartesian product of the
    ``[verify]`` lists (:func:`verify_shapes`), or a cases file (:meth:`Shape.from_fields`);
  * ``flashrun bench``: the ``[bench]`` sweep (:func:`bench_shapes`), which follows the
    FlashAttention benchmark convention: ``heads = hidden // head_dim`` and
    ``batch = tokens // max(Nq, Nk)``, so every shape moves the same amount of q/k/v data.

:func:`flops` counts the work of one call. This module stays cheap to import: no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Any

from flashrun.config import BenchConfig, Config, ExperimentConfig
from flashrun.errors import InputError
from flashrun.limits import FP8_DTYPE, SHORT_DTYPES

FIELDS = ("batch_size", "num_heads", "num_kv_heads", "seq_len", "seq_len_k", "head_dim", "dtype", "causal")
# The variants, after the fields above (records, JSON and CSV keep the old order, these appended).
VARIANT_FIELDS = ("window", "softcap", "alibi", "seqlens", "seqlens_k", "cache_seqlens", "page_size", "new_keys",
                  "kv_scale")
PLAIN = {"window": (-1, -1), "softcap": 0.0, "alibi": False, "seqlens": None, "seqlens_k": None,
         "cache_seqlens": None, "page_size": 0, "new_keys": 0, "kv_scale": ""}
MODES = ("fwd", "bwd", "fwd_bwd")

# FLOPs of a mode relative to the forward. Forward: 2 matrix products (S = QKᵀ, O = PV).
# Backward: 5 (S = QKᵀ recomputed, dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀQ),
# so 2.5x the forward; forward + backward together 3.5x. This is the FlashAttention papers'
# convention; the recomputation is counted because every fast backward does it.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


@dataclass(frozen=True)
class Shape:
    """One attention problem in the (batch, heads, seq, head_dim) layout."""

    batch_size: int
    num_heads: int
    num_kv_heads: int  # < num_heads for GQA/MQA
    seq_len: int  # queries (Nq)
    seq_len_k: int  # keys and values (Nk)
    head_dim: int
    dtype: str
    causal: bool  # bottom-right aligned when Nq != Nk
    window: tuple[int, int] = (-1, -1)  # (left, right) keys around the diagonal; -1 unbounded
    softcap: float = 0.0  # > 0: scores become softcap·tanh(s / softcap)
    alibi: bool = False  # ALiBi with the standard slopes of num_heads (kernels.alibi_slopes)
    seqlens: tuple[int, ...] | None = None  # packed: query lengths per sequence (a length may be 0)
    seqlens_k: tuple[int, ...] | None = None  # packed: key lengths; None = seqlens
    cache_seqlens: tuple[int, ...] | None = None  # KV cache: keys cached per sequence (a length may be 0)
    page_size: int = 0  # KV cache: 0 contiguous, else paged
    new_keys: int = 0  # KV cache: keys appended to each sequence by the call
    kv_scale: str = ""  # KV cache: "" in dtype; "tensor"/"token": e4m3, one scale / one per key and kv head

    def __post_init__(self) -> None:
        # JSON records give lists; a frozen, hashable shape keeps tuples
        for name in ("window", "seqlens", "seqlens_k", "cache_seqlens"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.softcap, int):
            object.__setattr__(self, "softcap", float(self.softcap))

    @property
    def group(self) -> int:
        """Query heads served by one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def kvcache(self) -> bool:
        return self.cache_seqlens is not None

    @property
    def forward_only(self) -> bool:
        """No gradients to check, whatever --grad says: e4m3 (the fp8 forward has no backward)."""
        return self.dtype == FP8_DTYPE

    @property
    def capacity(self) -> int:
        """Keys the cache holds per sequence: past the longest sequence by at least one key, so
        that every sequence has cache slots after its end (a kernel reading past it reads keys
        that are there, but not its own), in whole pages."""
        unit = self.page_size or 16
        return -(-(self.seq_len_k + 1) // unit) * unit

    @property
    def key_lengths(self) -> tuple[int, ...] | None:
        """The packed key lengths (``seqlens_k``, or the query lengths when not given)."""
        return None if self.seqlens is None else self.seqlens_k or self.seqlens

    @property
    def plain(self) -> bool:
        """No variant: what every kernel and provider can run."""
        return not self.variant_label

    @property
    def variant_label(self) -> str:
        """``w128,0 cap30 alibi varlen[0,1,17] cache[0,300] page16 new1 e4m3`` (empty for plain attention)."""
        parts = []
        if self.window != (-1, -1):
            parts.append(f"w{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.seqlens is not None:
            parts.append("varlen[" + ",".join(map(str, self.seqlens)) + "]"
                         + ("x[" + ",".join(map(str, self.seqlens_k)) + "]" if self.seqlens_k else ""))
        if self.cache_seqlens is not None:
            parts.append("cache[" + ",".join(map(str, self.cache_seqlens)) + "]")
            if self.page_size:
                parts.append(f"page{self.page_size}")
            if self.new_keys:
                parts.append(f"new{self.new_keys}")
            if self.kv_scale:
                parts.append("e4m3" + ("/token" if self.kv_scale == "token" else ""))
        return " ".join(parts)

    @property
    def label(self) -> str:
        """``B2 H8/2 N128x256 D64 fp16 causal w128,0``: GQA, Nq != Nk and variants only when present."""
        heads = f"H{self.num_heads}" + (f"/{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else "")
        seq = f"N{self.seq_len}" + (f"x{self.seq_len_k}" if self.seq_len_k != self.seq_len else "")
        return (f"B{self.batch_size} {heads} {seq} D{self.head_dim} {SHORT_DTYPES[self.dtype]}"
                + (" causal" if self.causal else "") + (f" {self.variant_label}" if self.variant_label else ""))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, values: dict[str, Any], base: ExperimentConfig, where: str) -> Shape:
        """Fill the fields ``values`` leaves out from ``[experiment]``, then validate them like it."""
        names = FIELDS + VARIANT_FIELDS
        unknown = set(values) - set(names) - {"model", "source"}
        if unknown:
            raise InputError(f"{where}: unknown case field(s) {', '.join(sorted(unknown))}",
                             hint=f"a case may set {', '.join(names)}")
        given = {k: v for k, v in values.items() if k in names and v is not None}
        if "seqlens" in given and "seqlens_k" not in given:  # new query lengths: keys follow them
            given["seqlens_k"] = None
        if given.get("seqlens") == []:  # [] in a [verify] seqlens list: not packed
            given["seqlens"] = given["seqlens_k"] = None
        if given.get("cache_seqlens") == []:  # [] in a [verify] cache_seqlens list: no KV cache
            given.update(cache_seqlens=None, page_size=0, new_keys=0, kv_scale="")
        merged = {**base.model_dump(), **given}
        try:  # the same checks as [experiment] (types, ranges, heads divisible, packed lengths)
            exp = ExperimentConfig.model_validate({k: merged[k] for k in names if merged.get(k) is not None})
        except Exception as exc:  # pydantic.ValidationError; one line per case is enough
            first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
            key = ".".join(str(p) for p in first["loc"])
            raise InputError(f"{where}: {key or 'case'}: {first['msg']}", hint="fix or drop that case") from None
        shape = cls(exp.batch_size, exp.num_heads, exp.num_kv_heads or exp.num_heads, exp.seq_len,
                    exp.seq_len_k or exp.seq_len, exp.head_dim, exp.dtype, exp.causal, tuple(exp.window),
                    float(exp.softcap), exp.alibi)
        if exp.cache_seqlens is not None:
            return kvcache(shape, exp.cache_seqlens, exp.page_size, exp.new_keys, exp.kv_scale)
        return packed(shape, exp.seqlens, exp.seqlens_k) if exp.seqlens is not None else shape


def packed(shape: Shape, seqlens: list[int] | tuple[int, ...], seqlens_k: list[int] | tuple[int, ...] | None = None
           ) -> Shape:
    """``shape`` as packed sequences of these lengths: batch = their number, seq_len(_k) = the
    longest (keys = queries when ``seqlens_k`` is None)."""
    keys = seqlens_k or seqlens
    return replace(shape, batch_size=len(seqlens), seq_len=max(seqlens), seq_len_k=max(keys),
                   seqlens=tuple(seqlens), seqlens_k=tuple(seqlens_k) if seqlens_k else None)


def kvcache(shape: Shape, cache_seqlens: list[int] | tuple[int, ...], page_size: int = 0, new_keys: int = 0,
            kv_scale: str = "") -> Shape:
    """``shape`` as a KV-cache call over caches holding these lengths: batch = their number,
    seq_len_k = the longest cached + new."""
    return replace(shape, batch_size=len(cache_seqlens), seq_len_k=max(cache_seqlens) + new_keys,
                   cache_seqlens=tuple(cache_seqlens), page_size=page_size, new_keys=new_keys, kv_scale=kv_scale)


def verify_shapes(cfg: Config) -> list[Shape]:
    """``[experiment]`` as one shape, or the cartesian product of the ``[verify]`` lists."""
    exp, sweep = cfg.experiment, cfg.verify
    axes = {key: getattr(sweep, key) for key in FIELDS + VARIANT_FIELDS if getattr(sweep, key, None) is not None}
    names = list(axes)
    shapes = [Shape.from_fields(dict(zip(names, combo)), exp, "[verify] sweep")
              for combo in itertools.product(*(axes[n] for n in names))]
    return list(dict.fromkeys(shapes))  # drop duplicates, keep order


def bench_shapes(bench: BenchConfig) -> list[Shape]:
    """The cartesian product of the [bench] lists, shape-major (all providers and modes of one
    shape run together, so inputs and compiled callables are made once per shape).

    The variant lists (``window``, ``softcap``, ``alibi``) multiply the sweep like the others;
    each ``varlen`` batch (a list of sequence lengths, packed back to back) adds shapes after the
    dense ones, for every dtype, head_dim, causal and variant value; each ``page_size`` adds
    every dense shape again as a KV-cache call whose caches are full (seq_len_k keys each), once
    per ``kv_scale`` format (an fp8 one for fp16/bf16 shapes only)."""
    keys = ["mode", "dtype", "head_dim", "causal", "window", "softcap", "alibi"]
    if not bench.varlen:
        keys.append("seq_len")  # packed batches alone need no dense length
    for key in keys:
        if not getattr(bench, key):
            raise InputError(f"bench.{key} is an empty list: the sweep has nothing to measure",
                             hint=f"give at least one value, e.g. --set bench.{key}=... or remove the key")
    shapes: list[Shape] = []
    variants = list(itertools.product(bench.window, bench.softcap, bench.alibi))
    for dtype, head_dim, causal, n_q, n_k in itertools.product(
        bench.dtype, bench.head_dim, bench.causal, bench.seq_len, bench.seq_len_k or [None]
    ):
        n_k = n_k or n_q
        heads, kv_heads = _bench_heads(bench, head_dim)
        batch = max(1, bench.tokens // max(n_q, n_k))  # decode-like shapes: the keys set the batch
        for window, softcap, alibi in variants:
            shape = Shape(batch, heads, kv_heads, n_q, n_k, head_dim, dtype, causal, tuple(window), float(softcap),
                          alibi)
            if shape not in shapes:
                shapes.append(shape)
    for shape, page_size, kv_scale in itertools.product([s for s in shapes if not s.varlen], bench.page_size or [],
                                                         bench.kv_scale):
        if kv_scale and shape.dtype == "float32":
            continue
        cached = kvcache(shape, (shape.seq_len_k,) * shape.batch_size, page_size, kv_scale=kv_scale)
        if cached not in shapes:
            shapes.append(cached)
    for lengths, dtype, head_dim, causal in itertools.product(bench.varlen or [], bench.dtype, bench.head_dim,
                                                              bench.causal):
        heads, kv_heads = _bench_heads(bench, head_dim)
        for window, softcap, alibi in variants:
            base = Shape(1, heads, kv_heads, 1, 1, head_dim, dtype, causal, tuple(window), float(softcap), alibi)
            shape = packed(base, lengths)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def _bench_heads(bench: BenchConfig, head_dim: int) -> tuple[int, int]:
    heads = max(1, bench.hidden // head_dim)
    kv_heads = bench.num_kv_heads or heads
    if heads % kv_heads:
        raise InputError(
            f"bench.num_kv_heads = {kv_heads} does not divide the {heads} heads of head_dim {head_dim} "
            f"(hidden {bench.hidden} / {head_dim})",
            hint="pick num_kv_heads dividing hidden/head_dim for every head_dim in the sweep",
        )
    return heads, kv_heads


def visible_pairs(n_q: int, n_k: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> float:
    """(query, key) pairs whose score is computed, per batch element (or sequence) and head.

    Full attention: ``Nq·Nk``. Causal with ``Nq == Nk`` and no window: ``Nq·Nk/2``, the
    FlashAttention convention (the exact count is N(N+1)/2; the convention keeps numbers
    comparable with published ones). Everything else is counted exactly, with the reference's
    mask (bottom-right aligned, ``off = Nk - Nq``): query i sees keys
    ``max(0, i + off - left) .. min(Nk - 1, i + off + right)``, a side -1 or at least Nk wide
    being unbounded and causal meaning right = 0. So one query against 4096 causal keys sees all
    4096, and a window of (W, 0) counts about ``N·(W + 1)``, not ``N²/2``.
    """
    left, right = window
    left = -1 if left >= n_k else left
    right = 0 if causal else -1 if right >= n_k else right
    if left < 0 and right < 0:
        return float(n_q * n_k)
    if causal and left < 0 and n_q == n_k:
        return n_q * n_k / 2
    off = n_k - n_q
    total = 0
    for i in range(n_q):  # cheap next to any measurement: one row at a time
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = n_k - 1 if right < 0 else min(n_k - 1, i + off + right)
        total += max(0, hi - lo + 1)
    return float(total)


def pairs(shape: Shape) -> float:
    """Visible (query, key) pairs of the whole batch, per head: ``B·visible_pairs`` dense, the sum
    over the sequences packed or cached (each sequence has its own bottom-right alignment and window)."""
    if shape.seqlens is not None:
        return sum(visible_pairs(n_q, n_k, shape.causal, shape.window)
                   for n_q, n_k in zip(shape.seqlens, shape.key_lengths) if n_q and n_k)
    if shape.cache_seqlens is not None:
        return sum(visible_pairs(shape.seq_len, n + shape.new_keys, shape.causal, shape.window)
                   for n in shape.cache_seqlens if n + shape.new_keys)
    return shape.batch_size * visible_pairs(shape.seq_len, shape.seq_len_k, shape.causal, shape.window)


def flops(shape: Shape, mode: str) -> float:
    """FLOPs of one call: ``4·H·pairs·D`` forward (2 products x 2 FLOPs per multiply-add),
    with ``pairs`` the visible (query, key) pairs of the batch (:func:`pairs`: ``B·Nq·Nk``, x0.5
    causal, only the allowed pairs under a window or packing), times 2.5 for backward and 3.5
    for both. Softcap and ALiBi add element-wise work, not counted (like the causal mask's).
    Counted with the query heads: GQA shares k/v, not the work."""
    return 4.0 * shape.num_heads * pairs(shape) * shape.head_dim * MODE_FACTOR[mode]
