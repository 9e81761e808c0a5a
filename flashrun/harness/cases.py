"""Test cases: parsing a model's reply, validating it, the offline generator and the cases file.

A case is an attention shape ``(seq_len, head_dim)``. Models answer in many shapes, so
:func:`extract_items` accepts the whole reply as JSON, a fenced code block, or the outermost
balanced ``[...]``/``{...}`` inside prose; ``{"cases": [...]}``, bare arrays, objects and
``[seq_len, head_dim]`` pairs. :func:`validate` keeps what the kernels can run and says why it
dropped the rest. The file written here is read back by ``flashrun verify --cases FILE`` through
:func:`load_cases`, which also accepts a hand-written list of case objects.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from flashrun.config import MAX_HEAD_DIM, MIN_HEAD_DIM, Dtype, HeadDim, PositiveInt
from flashrun.errors import InputError
from flashrun.records.files import atomic_write_json
from flashrun.records.redact import redact_data

FORMAT = "flashrun-cases/1"

# One head_dim per class the kernels treat differently: each power of two, and non powers of
# two that are padded up to 64 (40), 128 (80, 96) and 256 (192).
HEAD_DIMS = (16, 32, 40, 64, 80, 96, 128, 192, 256)
# Block sizes the kernels tile the sequence with; lengths one off a block edge catch masking bugs.
BLOCK_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class Case:
    seq_len: int
    head_dim: int

    def to_dict(self) -> dict[str, int]:
        return {"seq_len": self.seq_len, "head_dim": self.head_dim}


@dataclass(frozen=True)
class Rejected:
    item: Any  # as the model wrote it (JSON data, or an excerpt of the reply)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"item": self.item, "reason": self.reason}

    def describe(self) -> str:
        shown = json.dumps(self.item) if not isinstance(self.item, str) else self.item
        return f"{shown[:60]}: {self.reason}"


# --------------------------------------------------------------------------------------------
# Parsing a reply

_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)
_CLOSING = {"[": "]", "{": "}"}


def _balanced_spans(text: str) -> list[str]:
    """Every outermost balanced ``[...]`` or ``{...}`` span, left to right (string-aware)."""
    spans, stack, start, in_string, escaped = [], [], 0, False, False
    for i, char in enumerate(text):
        if in_string:  # brackets inside JSON strings do not count
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"' and stack:
            in_string = True
        elif char in _CLOSING:
            if not stack:
                start = i
            stack.append(_CLOSING[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                spans.append(text[start : i + 1])
        elif stack and char in "]}":  # mismatched: this span is not data; look further on
            stack.clear()
    return spans


def _load(candidate: str) -> Any:
    """JSON, or a Python literal (models sometimes write single quotes or tuples); None if neither."""
    try:
        return json.loads(candidate)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(candidate)  # literals only: never evaluates code
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    # Tuples become lists and sets, bytes, complex numbers strings, so every item (kept or
    # rejected) can go into the JSON file and the --json output as it is.
    return json.loads(json.dumps(value, default=str))


def _unwrap(value: Any) -> list[Any] | None:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        if "cases" in value:
            return _unwrap(value["cases"])
        if "seq_len" in value or "head_dim" in value:
            return [value]
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) == 1:  # {"test_cases": [...]} and the like
            return lists[0]
    return None


def extract_items(text: str) -> tuple[list[Any], str | None]:
    """The raw case items in a reply, or ``([], reason)`` when it holds no usable JSON."""
    candidates = [text.strip()] + [m.group(1) for m in _FENCE.finditer(text)] + _balanced_spans(text)
    found_data = False
    for candidate in candidates:
        value = _load(candidate)
        if value is None:
            continue
        found_data = True
        items = _unwrap(value)
        if items is not None:
            return items, None
    if found_data:
        return [], 'the JSON is not a list of cases or {"cases": [...]}'
    return [], "no JSON found in the reply"


# --------------------------------------------------------------------------------------------
# Validating items


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\+?\d+\s*", value):
        return int(value)
    return None


def _check(item: Any, max_seq_len: int) -> Case | str:
    """The case an item describes, or why it is unusable."""
    if isinstance(item, dict):
        missing = [k for k in ("seq_len", "head_dim") if k not in item]
        if missing:
            return f"missing {' and '.join(missing)}"
        raw_seq, raw_dim = item["seq_len"], item["head_dim"]
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        raw_seq, raw_dim = item
    else:
        return "expected {\"seq_len\": N, \"head_dim\": D} or a [seq_len, head_dim] pair"
    seq_len, head_dim = _as_int(raw_seq), _as_int(raw_dim)
    if seq_len is None:
        return f"seq_len {json.dumps(raw_seq, default=str)} is not an integer"
    if head_dim is None:
        return f"head_dim {json.dumps(raw_dim, default=str)} is not an integer"
    if not 1 <= seq_len <= max_seq_len:
        return f"seq_len {seq_len} is outside 1..{max_seq_len} (max_seq_len)"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (what the kernels support)"
    return Case(seq_len, head_dim)


def validate(items: list[Any], max_seq_len: int, count: int) -> tuple[list[Case], list[Rejected]]:
    """Valid, distinct cases (at most ``count``) in the model's order, and every rejected item."""
    cases: list[Case] = []
    rejected: list[Rejected] = []
    for item in items:
        result = _check(item, max_seq_len)
        if isinstance(result, str):
            rejected.append(Rejected(item, result))
        elif result in cases:
            rejected.append(Rejected(item, "duplicate of an earlier case"))
        elif len(cases) >= count:
            rejected.append(Rejected(item, f"more than the {count} cases asked for"))
        else:
            cases.append(result)
    return cases, rejected


# --------------------------------------------------------------------------------------------
# The offline generator


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def offline_cases(max_seq_len: int, count: int | None = None) -> list[Case]:
    """Deterministic edge cases: 1, block sizes +-1, powers of two from 256 with the largest
    prime below each, and ``max_seq_len`` itself; head_dims cycle so every class appears.
    Sorted by seq_len, so capping at ``count`` drops the most expensive ones."""
    lengths = {1, max_seq_len}
    lengths.update(b + delta for b in BLOCK_SIZES for delta in (-1, 0, 1))
    power = 256
    while power <= max_seq_len:
        lengths.add(power)
        lengths.add(next(n for n in range(power - 1, 1, -1) if _is_prime(n)))
        power *= 2
    seq_lens = sorted(n for n in lengths if 1 <= n <= max_seq_len)
    n = max(len(seq_lens), len(HEAD_DIMS))
    cases = list(dict.fromkeys(Case(seq_lens[i % len(seq_lens)], HEAD_DIMS[i % len(HEAD_DIMS)]) for i in range(n)))
    cases.sort(key=lambda c: (c.seq_len, c.head_dim))
    return cases if count is None else cases[:count]


# --------------------------------------------------------------------------------------------
# The cases file


def write_cases_file(path: Path, document: dict[str, Any]) -> None:
    """Atomically: a reader sees the previous file or this one, never half of it."""
    atomic_write_json(path, redact_data({"format": FORMAT, **document}))


class CaseSpec(BaseModel):
    """One case as ``verify`` takes it; fields left out come from ``[experiment]``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    seq_len: Optional[PositiveInt] = None
    seq_len_k: Optional[PositiveInt] = None
    head_dim: Optional[HeadDim] = None
    batch_size: Optional[PositiveInt] = None
    num_heads: Optional[PositiveInt] = None
    num_kv_heads: Optional[PositiveInt] = None
    dtype: Optional[Dtype] = None
    causal: Optional[bool] = None


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
