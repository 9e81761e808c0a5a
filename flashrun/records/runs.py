"""``flashrun runs``: list recorded runs from ``<log_dir>/runs.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashrun.records.runlog import load_records


def recent(log_dir: Path, limit: int) -> list[dict[str, Any]]:
    return load_records(log_dir)[-limit:] if limit > 0 else []


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """One line's worth: what ran and how it ended (verdict, or the best TFLOP/s of a bench)."""
    results = record.get("results") or {}
    outcome = results.get("verdict") if isinstance(results, dict) else None
    if outcome is None and isinstance(results, dict) and results.get("best_tflops") is not None:
        outcome = f"best {results['best_tflops']:.1f} TFLOP/s"
    return {
        "id": record.get("id"),
        "time": record.get("time"),
        "command": record.get("command"),
        "kernels": ", ".join(record.get("kernels") or []),
        "cases": record.get("n_cases"),
        "outcome": outcome or (results.get("outcome") if isinstance(results, dict) else None),
    }


def _kernel_label(spec: str) -> str:
    """``/abs/experiments/my_attention.py:attention`` -> ``my_attention.py:attention`` (as verify names it)."""
    path, sep, func = spec.rpartition(":")
    return f"{Path(path).name}:{func}" if sep and path.endswith(".py") else spec


# Columns that are never wrapped or cut: `runs show ID` and `verify --rerun ID` need the id whole,
# and a number cut short is a different number. Only the text columns wrap (folding long words,
# never an ellipsis).
_WHOLE = ("id", "time", "command", "cases")
_TEXT_MIN = 12  # the narrowest a text column gets before the time column is left out


def render_list(records: list[dict[str, Any]], log_dir: Path, console: Console) -> None:
    if not records:
        console.print(f"no runs recorded in {log_dir}")
        return
    cells = []
    for record in records:
        row = {**summary(record), "kernels": ", ".join(_kernel_label(k) for k in record.get("kernels") or [])}
        cells.append({c: "" if value is None else str(value) for c, value in row.items()})
    columns = list(cells[0])

    def natural(column: str) -> int:
        return max(len(column), *(len(cell[column]) for cell in cells))

    def width_needed(shown: list[str], text_width: int) -> int:
        fixed = sum(natural(c) for c in shown if c in _WHOLE)
        text = sum(min(natural(c), text_width) for c in shown if c not in _WHOLE)
        return fixed + text + 3 * len(shown) + 1  # padding of 1 each side and the borders

    # The id already holds the local time to the second: when the terminal (or a pipe's 80
    # columns) is too narrow for everything, the time column goes, never part of an id.
    if width_needed(columns, _TEXT_MIN) > console.width:
        columns.remove("time")
    table = Table(title=f"runs in {log_dir}")
    for column in columns:
        whole = column in _WHOLE
        table.add_column(column, no_wrap=whole, overflow="fold", justify="right" if column == "cases" else "left",
                         min_width=natural(column) if whole else None)
    # Narrower still: the table grows past the terminal (which then wraps lines) rather than cut an id.
    needed = width_needed(columns, _TEXT_MIN)
    if needed > console.width:
        table.width = needed
    for cell in cells:
        table.add_row(*(escape(cell[c]) for c in columns))  # a path may hold [brackets]
    console.print(table)
