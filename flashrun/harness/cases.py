"""Test cases on disk: the cases file, and the offline generator of edge cases.

A case is a partial :class:`~flashrun.harness.shapes.Shape` (:class:`CaseSpec`): the keys it
sets, the rest filled from ``[experiment]`` when ``flashrun verify --cases FILE`` reads it back
(:func:`load_cases`, which also accepts a hand-written list of case objects). ``gen-cases``
writes the file (:func:`write_cases_file`), from a model's reply (:mod:`flashrun.gateway.replies`)
or from :func:`offline_cases`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from flashrun.config import Dtype, HeadDim, PositiveInt
from flashrun.config.schema import NonNegativeInt
from flashrun.config.schema import KvScale, SeqLens, Softcap, Window
from flashrun.errors import InputError
from flashrun.records.files import atomic_write_json
from flashrun.records.redact import redact_data

FORMAT = "flashrun-cases/1"

# One head_dim per class the kernels treat differently: each power of two, and non powers of
# two that run as two column blocks: 40 = 32 + 16 (padded to 48), 80 = 64 + 16, 96 = 64 + 32,
# 192 = 128 + 64.
HEAD_DIMS = (16, 32, 40, 64, 80, 96, 128, 192, 256)
# Block sizes the kernels tile the sequence with; lengths one off a block edge catch masking bugs.
BLOCK_SIZES = (16, 32, 64, 128)


# --------------------------------------------------------------------------------------------
# The offline generator


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def offline_cases(max_seq_len: int, count: int | None = None) -> list[CaseSpec]:
    """Deterministic edge cases: 1, block sizes +-1, powers of two from 256 with the largest
    prime below each, and ``max_seq_len`` itself; head_dims cycle so every class appears.
    Sorted by seq_len, so capping at ``count`` drops the most expensive ones. Then the variants'
    edge cases (:func:`variant_cases`), never capped: they are few and small."""
    return _length_cases(max_seq_len, count) + variant_cases(max_seq_len)


def variant_cases(max_seq_len: int) -> list[CaseSpec]:
    """Edge cases of FlashAttention-2's variants, each one a known bug class: a window of 0 (each
    query sees one key), a window wider than the sequence (unbounded), windows with Nq != Nk
    both ways (bottom-right alignment, rows that see no key), softcap and ALiBi with a window,
    packed batches with an empty and a length-1 sequence, and KV-cache calls: ragged lengths
    with an empty cache, page boundaries inside sequences (pages of 16 and of 48 keys), new keys
    appended across a page boundary, new keys no query sees (a window of 0), fp8 caches (one scale,
    and one per key and kv head with new keys). Lengths above
    ``max_seq_len`` are left out."""
    cases = [
        CaseSpec(seq_len=97, head_dim=64, window=(0, 0)),
        CaseSpec(seq_len=17, head_dim=32, window=(0, 0), causal=True),
        CaseSpec(seq_len=33, head_dim=64, window=(64, 100)),  # wider than the sequence both ways
        CaseSpec(seq_len=17, seq_len_k=97, head_dim=40, window=(8, 0)),  # Nq < Nk
        CaseSpec(seq_len=97, seq_len_k=17, head_dim=40, window=(3, 5)),  # Nq > Nk: the first rows see nothing
        CaseSpec(seq_len=65, head_dim=64, window=(16, 0), softcap=2.0, alibi=True),
        CaseSpec(seq_len=17, head_dim=64, seqlens=[0, 1, 17, 5]),
        CaseSpec(seq_len=33, head_dim=32, seqlens=[17, 0, 1, 33], seqlens_k=[5, 9, 1, 40], causal=True,
                 window=(4, 0)),
        CaseSpec(seq_len=1, head_dim=64, num_heads=8, num_kv_heads=2, cache_seqlens=[0, 17, 70], page_size=16),
        CaseSpec(seq_len=3, head_dim=40, num_heads=4, num_kv_heads=1, cache_seqlens=[47, 0, 5], page_size=48,
                 new_keys=2, causal=True),
        CaseSpec(seq_len=2, head_dim=64, cache_seqlens=[15, 33], page_size=16, new_keys=3, causal=True,
                 softcap=5.0, alibi=True),
        CaseSpec(seq_len=1, head_dim=32, cache_seqlens=[9, 20], new_keys=3, window=(0, 0)),
        # an fp8 cache: one scale, and one per key and kv head with new keys across a page boundary
        CaseSpec(seq_len=1, head_dim=64, num_heads=8, num_kv_heads=2, cache_seqlens=[0, 17, 70], kv_scale="tensor"),
        CaseSpec(seq_len=2, head_dim=40, num_heads=4, num_kv_heads=1, cache_seqlens=[15, 47], page_size=16,
                 new_keys=2, causal=True, kv_scale="token"),
    ]
    def longest(c: CaseSpec) -> int:
        return max([c.seq_len or 0, c.seq_len_k or 0, *(c.seqlens or []), *(c.seqlens_k or []),
                    *((n + (c.new_keys or 0) for n in c.cache_seqlens) if c.cache_seqlens else [])])

    return [c for c in cases if longest(c) <= max_seq_len]


def _length_cases(max_seq_len: int, count: int | None) -> list[CaseSpec]:
    lengths = {1, max_seq_len}
    lengths.update(b + delta for b in BLOCK_SIZES for delta in (-1, 0, 1))
    power = 256
    while power <= max_seq_len:
        lengths.add(power)
        lengths.add(next(n for n in range(power - 1, 1, -1) if _is_prime(n)))
        power *= 2
    seq_lens = sorted(n for n in lengths if 1 <= n <= max_seq_len)
    n = max(len(seq_lens), len(HEAD_DIMS))
    cases = list(dict.fromkeys(CaseSpec(seq_len=seq_lens[i % len(seq_lens)], head_dim=HEAD_DIMS[i % len(HEAD_DIMS)]) for i in range(n)))
    cases.sort(key=lambda c: (c.seq_len, c.head_dim))
    return cases if count is None else cases[:count]


# --------------------------------------------------------------------------------------------
# The cases file


def write_cases_file(path: Path, document: dict[str, Any]) -> None:
    """Atomically: a reader sees the previous file or this one, never half of it."""
    atomic_write_json(path, redact_data({"format": FORMAT, **document}))


class CaseSpec(BaseModel):
    """One case as ``verify`` takes it; fields left out come from ``[experiment]``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    seq_len: Optional[PositiveInt] = None
    seq_len_k: Optional[PositiveInt] = None
    head_dim: Optional[HeadDim] = None
    batch_size: Optional[PositiveInt] = None
    num_heads: Optional[PositiveInt] = None
    num_kv_heads: Optional[PositiveInt] = None
    dtype: Optional[Dtype] = None
    causal: Optional[bool] = None
    window: Optional[Window] = None
    softcap: Optional[Softcap] = None
    alibi: Optional[bool] = None
    seqlens: Optional[SeqLens] = None  # packed: batch_size and seq_len follow from these
    seqlens_k: Optional[SeqLens] = None
    cache_seqlens: Optional[SeqLens] = None  # a KV-cache call: batch_size and seq_len_k follow from these
    page_size: Optional[NonNegativeInt] = None
    new_keys: Optional[NonNegativeInt] = None
    kv_scale: Optional[KvScale] = None  # an fp8 KV cache's scales


# Tags that the writer puts on a case and that are not part of its shape.
_TAGS = ("model",)


def _spec_error(path: Path, index: int, exc: ValidationError) -> InputError:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        what = f"unknown key (known: {', '.join(CaseSpec.model_fields)})"
    else:
        what = f"{error['msg'].lower()}, got {json.dumps(error.get('input'), default=str)}"
    return InputError(f"{path}: cases[{index}].{where}: {what}",
                      hint="each case is an object like {\"seq_len\": 128, \"head_dim\": 64}")


def load_cases(path: Path) -> list[dict[str, Any]]:
    """The distinct cases in a cases file, each a dict of the keys it sets (see :class:`CaseSpec`).

    Accepts the file ``gen-cases`` writes (a multi-model file yields the union of its models'
    cases) and a bare JSON list of case objects. Raises :class:`InputError` on anything else."""
    path = Path(path)
    hint = "write one with `flashrun gen-cases` (or `flashrun gen-cases --offline`)"
    if not path.is_file():
        raise InputError(f"{path}: no such cases file" + (" (it is a folder)" if path.is_dir() else ""), hint=hint)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file", hint=hint) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON: {exc.msg} (at line {exc.lineno}, column {exc.colno})",
                         hint=hint) from None
    items = data.get("cases") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise InputError(f'{path}: expected {{"cases": [...]}} or a list of cases', hint=hint)
    cases: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(f"{path}: cases[{index}]: expected an object, got {json.dumps(item, default=str)[:60]}",
                             hint="each case is an object like {\"seq_len\": 128, \"head_dim\": 64}")
        try:
            spec = CaseSpec.model_validate({k: v for k, v in item.items() if k not in _TAGS})
        except ValidationError as exc:
            raise _spec_error(path, index, exc) from None
        case = spec.model_dump(exclude_none=True)
        if not case:
            raise InputError(f"{path}: cases[{index}] sets no shape key", hint="give at least seq_len or head_dim")
        if case not in cases:
            cases.append(case)
    if not cases:
        raise InputError(f"{path}: the file holds no cases", hint=hint)
    return cases
