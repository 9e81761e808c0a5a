"""Reading a model's reply: the case items in it, and which of them a kernel can run.

Models answer in many shapes, so :func:`extract_items` accepts the whole reply as JSON, a fenced
code block, or the outermost balanced ``[...]``/``{...}`` inside prose; ``{"cases": [...]}``,
bare arrays, objects and ``[seq_len, head_dim]`` pairs. :func:`validate` keeps what the kernels
can run (as :class:`~flashrun.harness.cases.CaseSpec`) and says why it dropped the rest. An object
may also set ``seq_len_k``, ``causal`` and the variants (``window``, ``softcap``, ``alibi``, packed
``seqlens``/``seqlens_k``); each key is checked like seq_len and head_dim, and ``null`` means unset.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flashrun.config import ExperimentConfig
from flashrun.harness.cases import CaseSpec
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM


# The keys of a case item and their JSON types, in the order they are checked (the first problem
# is the reason given); anything else a model adds ("note", "why") is ignored.
_TYPES = {"seq_len": "integer", "head_dim": "integer", "seq_len_k": "integer", "causal": "boolean",
          "window": "array", "softcap": "number", "alibi": "boolean", "seqlens": "array", "seqlens_k": "array"}


def _property(key: str, kind: str) -> dict[str, Any]:
    if key in ("seq_len", "head_dim"):
        return {"type": kind}
    # strict structured outputs want every key required: the optional ones may be null (= not set)
    return {"type": [kind, "null"], **({"items": {"type": "integer"}} if kind == "array" else {})}


# What the gateway is asked to answer in (``response_format: json_schema``, strict).
CASES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "cases": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {key: _property(key, kind) for key, kind in _TYPES.items()},
                "required": list(_TYPES),
                "additionalProperties": False,
            },
        }
    },
    "required": ["cases"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Rejected:
    item: Any  # as the model wrote it (JSON data, or an excerpt of the reply)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"item": self.item, "reason": self.reason}

    def describe(self) -> str:
        shown = json.dumps(self.item) if not isinstance(self.item, str) else self.item
        return f"{shown[:60]}: {self.reason}"



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


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)


def _length(name: str, raw: Any, max_seq_len: int) -> int | str:
    value = _as_int(raw)
    if value is None:
        return f"{name} {_shown(raw)} is not an integer"
    if not 1 <= value <= max_seq_len:
        return f"{name} {value} is outside 1..{max_seq_len} (max_seq_len)"
    return value


def _head_dim(raw: Any) -> int | str:
    value = _as_int(raw)
    if value is None:
        return f"head_dim {_shown(raw)} is not an integer"
    if not MIN_HEAD_DIM <= value <= MAX_HEAD_DIM:
        return f"head_dim {value} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (what the kernels support)"
    return value


def _flag(name: str, raw: Any) -> bool | str:
    return raw if isinstance(raw, bool) else f"{name} {_shown(raw)} is not true or false"


def _window(raw: Any) -> tuple[int, int] | str:
    sides = [_as_int(side) for side in raw] if isinstance(raw, list) else []
    if len(sides) != 2 or None in sides:
        return f"window {_shown(raw)} is not a [left, right] pair of integers"
    if min(sides) < -1:
        return f"window {_shown(raw)}: a side is a number of keys >= 0, or -1 for unbounded"
    return (sides[0], sides[1])


def _softcap(raw: Any) -> float | str:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return f"softcap {_shown(raw)} is not a number"
    try:
        value = float(raw)
    except ValueError:
        return f"softcap {_shown(raw)} is not a number"
    if not math.isfinite(value) or value < 0:
        return f"softcap {_shown(raw)} is not a number >= 0 (0: no softcap)"
    return value


def _seqlens(name: str, raw: Any, max_seq_len: int) -> tuple[int, ...] | str:
    lengths = [_as_int(n) for n in raw] if isinstance(raw, list) else []
    if not lengths or any(n is None or n < 0 for n in lengths):
        return f"{name} {_shown(raw)} is not a list of lengths (integers >= 0)"
    if max(lengths) > max_seq_len:
        return f"{name} {_shown(raw)}: {max(lengths)} is over {max_seq_len} (max_seq_len)"
    return tuple(lengths)


def _field(name: str, raw: Any, max_seq_len: int) -> Any:
    """The value of one key, or why it is unusable (a str)."""
    if name in ("seq_len", "seq_len_k"):
        return _length(name, raw, max_seq_len)
    if name == "head_dim":
        return _head_dim(raw)
    if name in ("causal", "alibi"):
        return _flag(name, raw)
    if name == "window":
        return _window(raw)
    if name == "softcap":
        return _softcap(raw)
    return _seqlens(name, raw, max_seq_len)


def _packed(fields: dict[str, Any]) -> str | None:
    """Why the packed lengths do not fit together or with seq_len/seq_len_k, or None. The rules
    between seqlens and seqlens_k are [experiment]'s own; seq_len(_k) must be the longest."""
    try:
        ExperimentConfig.model_validate({k: fields[k] for k in ("seqlens", "seqlens_k") if k in fields})
    except ValidationError as exc:
        return exc.errors()[0]["msg"].removeprefix("Value error, ")
    if "seqlens" not in fields:
        return None
    for name, lengths in (("seq_len", "seqlens"), ("seq_len_k", "seqlens_k" if "seqlens_k" in fields else "seqlens")):
        longest = max(fields[lengths])
        if fields.get(name, longest) != longest:
            return (f"{name} {fields[name]} is not the longest of {lengths} ({longest}); packed cases may leave "
                    f"{name} out")
    return None


def _check(item: Any, max_seq_len: int) -> CaseSpec | str:
    """The case an item describes, or why it is unusable."""
    if isinstance(item, dict):
        given = {k: v for k, v in item.items() if k in _TYPES and v is not None}  # null: not set (strict schemas)
        needed = ("head_dim",) if "seqlens" in given else ("seq_len", "head_dim")  # packed: seq_len follows
        missing = [k for k in needed if k not in given]
        if missing:
            return f"missing {' and '.join(missing)}"
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        given = dict(zip(("seq_len", "head_dim"), item))
    else:
        return "expected {\"seq_len\": N, \"head_dim\": D} or a [seq_len, head_dim] pair"
    fields: dict[str, Any] = {}
    for name in _TYPES:
        if name in given:
            value = _field(name, given[name], max_seq_len)
            if isinstance(value, str):
                return value
            fields[name] = value
    why = _packed(fields)
    if why:
        return why
    if "seqlens" in fields:
        fields.setdefault("seq_len", max(fields["seqlens"]))
    return CaseSpec(**fields)


def validate(items: list[Any], max_seq_len: int, count: int) -> tuple[list[CaseSpec], list[Rejected]]:
    """Valid, distinct cases (at most ``count``) in the model's order, and every rejected item."""
    cases: list[CaseSpec] = []
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
