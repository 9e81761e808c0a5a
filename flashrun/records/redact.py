"""Keep secrets out of everything flashrun prints or writes.

The gateway registers the API key as soon as it reads it; the CLI boundary, the log handler and
the code that builds what flashrun keeps (run records, cases files, bench results) pass text
through :func:`redact`, so a key echoed back by a server (in an error body, say) is masked
wherever it would otherwise appear. The file writers themselves (:mod:`flashrun.records.files`)
write what they are given.
"""

from __future__ import annotations

import logging
from typing import Any

MASK = "***"
_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    if value and len(value) >= 4:  # masking shorter strings would mangle ordinary text
        _secrets.add(value)


def redact(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def redact_data(value: Any) -> Any:
    """``redact`` applied to every string inside lists/dicts (keys included)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_data(k): redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_data(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = ()
        return True
