"""Reading a model's reply: the case items in it, and which of them a kernel can run.

Models answer in many shapes, so :func:`extract_items` accepts the whole reply as JSON, a fenced
code block, or the outermost balanced ``[...]``/``{...}`` inside prose; ``{"cases": [...]}``,
bare arrays, objects and ``[seq_len, head_dim]`` pairs. :func:`validate` keeps what the kernels
can run (as :class:`~flashrun.harness.cases.CaseSpec`) and says why it dropped the rest.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from flashrun.harness.cases import CaseSpec
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM


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


def _check(item: Any, max_seq_len: int) -> CaseSpec | str:
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
    return CaseSpec(seq_len=seq_len, head_dim=head_dim)


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
