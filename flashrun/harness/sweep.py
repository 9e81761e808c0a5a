"""The ``flashrun bench`` sweep: which shapes are measured, and how many FLOPs each one is.

Shapes follow the FlashAttention benchmark convention: a fixed hidden size split into
``heads = hidden // head_dim`` and a fixed number of tokens split into
``batch = tokens // seq_len``, so every shape of the default sweep moves the same amount of
q/k/v data. For decode-like shapes (``seq_len_k`` given, e.g. one query against 16384 keys) the
batch follows the longer of the two lengths, so that the keys, not the single query, set it.

This module stays cheap to import: no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flashrun.config import BenchConfig
from flashrun.errors import InputError

MODES = ("fwd", "bwd", "fwd_bwd")

# FLOPs of a mode relative to the forward. Forward: 2 matrix products (S = QKᵀ, O = PV).
# Backward: 5 (S = QKᵀ recomputed, dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀQ),
# so 2.5x the forward; forward + backward together 3.5x. This is the FlashAttention papers'
# convention; the recomputation is counted because every fast backward does it.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


@dataclass(frozen=True)
class Case:
    """One attention shape of the sweep, in the (batch, heads, seq, head_dim) layout."""

    dtype: str
    causal: bool
    batch: int
    heads: int
    kv_heads: int  # < heads for GQA/MQA
    seq_len: int  # queries (Nq)
    seq_len_k: int  # keys and values (Nk); equal to seq_len except for decode-like shapes
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads served by one kv head."""
        return self.heads // self.kv_heads

    def label(self) -> str:
        n = f"N={self.seq_len}" if self.seq_len == self.seq_len_k else f"Nq={self.seq_len} Nk={self.seq_len_k}"
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"{self.dtype} D={self.head_dim} {'causal' if self.causal else 'full'} {n} "
                f"B={self.batch} H={self.heads}{kv}")


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


def flops(case: Case, mode: str) -> float:
    """FLOPs of one call: ``4·B·H·pairs·D`` forward (2 products x 2 FLOPs per multiply-add),
    with ``pairs = Nq·Nk`` (x0.5 causal), times 2.5 for backward and 3.5 for both.
    Counted with the query heads: GQA shares k/v, not the work."""
    forward = 4.0 * case.batch * case.heads * visible_pairs(case.seq_len, case.seq_len_k, case.causal) * case.head_dim
    return forward * MODE_FACTOR[mode]


def expand(bench: BenchConfig) -> list[Case]:
    """The cartesian product of the [bench] lists, shape-major (all providers and modes of one
    shape run together, so inputs and compiled callables are made once per shape)."""
    for key in ("mode", "dtype", "head_dim", "causal", "seq_len"):
        if not getattr(bench, key):
            raise InputError(f"bench.{key} is an empty list: the sweep has nothing to measure",
                             hint=f"give at least one value, e.g. --set bench.{key}=... or remove the key")
    cases: list[Case] = []
    lengths_k = bench.seq_len_k or [None]
    for dtype, head_dim, causal, n_q, n_k in itertools.product(
        bench.dtype, bench.head_dim, bench.causal, bench.seq_len, lengths_k
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
        batch = max(1, bench.tokens // max(n_q, n_k))
        case = Case(dtype, causal, batch, heads, kv_heads, n_q, n_k, head_dim)
        if case not in cases:
            cases.append(case)
    return cases
