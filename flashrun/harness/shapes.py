"""One attention shape, as verify, bench, cases files and the tests all use it.

A :class:`Shape` is everything that decides a kernel's inputs and the maths it must compute:
batch, heads (fewer kv heads for GQA/MQA), query and key lengths, head_dim, dtype and the
mask. Its fields are named like the ``[experiment]`` keys, so a shape, a config section and a
cases-file entry read the same; :attr:`Shape.label` is its one printed name.

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
from dataclasses import asdict, dataclass
from typing import Any

from flashrun.config import BenchConfig, Config, ExperimentConfig
from flashrun.errors import InputError
from flashrun.limits import SHORT_DTYPES

FIELDS = ("batch_size", "num_heads", "num_kv_heads", "seq_len", "seq_len_k", "head_dim", "dtype", "causal")
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

    @property
    def group(self) -> int:
        """Query heads served by one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def label(self) -> str:
        """``B2 H8/2 N128x256 D64 fp16 causal``: GQA and Nq != Nk shown only when present."""
        heads = f"H{self.num_heads}" + (f"/{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else "")
        seq = f"N{self.seq_len}" + (f"x{self.seq_len_k}" if self.seq_len_k != self.seq_len else "")
        return (f"B{self.batch_size} {heads} {seq} D{self.head_dim} {SHORT_DTYPES[self.dtype]}"
                + (" causal" if self.causal else ""))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, values: dict[str, Any], base: ExperimentConfig, where: str) -> Shape:
        """Fill the fields ``values`` leaves out from ``[experiment]``, then validate them like it."""
        unknown = set(values) - set(FIELDS) - {"model", "source"}
        if unknown:
            raise InputError(f"{where}: unknown case field(s) {', '.join(sorted(unknown))}",
                             hint=f"a case may set {', '.join(FIELDS)}")
        merged = {**base.model_dump(), **{k: v for k, v in values.items() if k in FIELDS and v is not None}}
        try:  # the same checks as [experiment] (types, ranges, heads divisible)
            exp = ExperimentConfig.model_validate({k: merged[k] for k in FIELDS if merged.get(k) is not None})
        except Exception as exc:  # pydantic.ValidationError; one line per case is enough
            first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
            key = ".".join(str(p) for p in first["loc"])
            raise InputError(f"{where}: {key or 'case'}: {first['msg']}", hint="fix or drop that case") from None
        return cls(exp.batch_size, exp.num_heads, exp.num_kv_heads or exp.num_heads, exp.seq_len,
                   exp.seq_len_k or exp.seq_len, exp.head_dim, exp.dtype, exp.causal)


def verify_shapes(cfg: Config) -> list[Shape]:
    """``[experiment]`` as one shape, or the cartesian product of the ``[verify]`` lists."""
    exp, sweep = cfg.experiment, cfg.verify
    axes = {key: getattr(sweep, key) for key in FIELDS if getattr(sweep, key) is not None}
    names = list(axes)
    shapes = [Shape.from_fields(dict(zip(names, combo)), exp, "[verify] sweep")
              for combo in itertools.product(*(axes[n] for n in names))]
    return list(dict.fromkeys(shapes))  # drop duplicates, keep order


def bench_shapes(bench: BenchConfig) -> list[Shape]:
    """The cartesian product of the [bench] lists, shape-major (all providers and modes of one
    shape run together, so inputs and compiled callables are made once per shape)."""
    for key in ("mode", "dtype", "head_dim", "causal", "seq_len"):
        if not getattr(bench, key):
            raise InputError(f"bench.{key} is an empty list: the sweep has nothing to measure",
                             hint=f"give at least one value, e.g. --set bench.{key}=... or remove the key")
    shapes: list[Shape] = []
    for dtype, head_dim, causal, n_q, n_k in itertools.product(
        bench.dtype, bench.head_dim, bench.causal, bench.seq_len, bench.seq_len_k or [None]
    ):
        n_k = n_k or n_q
        heads = max(1, bench.hidden // head_dim)
        kv_heads = bench.num_kv_heads or heads
        if heads % kv_heads:
            raise InputError(
                f"bench.num_kv_heads = {kv_heads} does not divide the {heads} heads of head_dim {head_dim} "
                f"(hidden {bench.hidden} / {head_dim})",
                hint="pick num_kv_heads dividing hidden/head_dim for every head_dim in the sweep",
            )
        batch = max(1, bench.tokens // max(n_q, n_k))  # decode-like shapes: the keys set the batch
        shape = Shape(batch, heads, kv_heads, n_q, n_k, head_dim, dtype, causal)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def visible_pairs(n_q: int, n_k: int, causal: bool) -> float:
    """(query, key) pairs whose score is computed, per batch element and head.

    Full attention: ``Nq·Nk``. Causal with ``Nq == Nk``: ``Nq·Nk/2``, the FlashAttention
    convention (the exact count is N(N+1)/2; the convention keeps numbers comparable with
    published ones). Causal with ``Nq != Nk`` is bottom-right aligned (query i sees keys
    j <= i + Nk - Nq), where halving would be wrong (one query against 4096 keys sees all
    4096), so the visible pairs are counted exactly.
    """
    if not causal:
        return float(n_q * n_k)
    if n_q == n_k:
        return n_q * n_k / 2
    if n_k >= n_q:  # row i sees i + (Nk - Nq) + 1 keys
        return float(n_q * (n_k - n_q + 1) + n_q * (n_q - 1) // 2)
    return float(n_k * (n_k + 1) // 2)  # the first Nq - Nk rows see nothing; the rest 1..Nk keys


def flops(shape: Shape, mode: str) -> float:
    """FLOPs of one call: ``4·B·H·pairs·D`` forward (2 products x 2 FLOPs per multiply-add),
    with ``pairs = Nq·Nk`` (x0.5 causal), times 2.5 for backward and 3.5 for both.
    Counted with the query heads: GQA shares k/v, not the work."""
    pairs = visible_pairs(shape.seq_len, shape.seq_len_k, shape.causal)
    return 4.0 * shape.batch_size * shape.num_heads * pairs * shape.head_dim * MODE_FACTOR[mode]
