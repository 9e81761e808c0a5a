"""``flashrun runs``: list recorded runs from ``<log_dir>/runs.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
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


def render_list(records: list[dict[str, Any]], log_dir: Path, console: Console) -> None:
    if not records:
        console.print(f"no runs recorded in {log_dir}")
        return
    table = Table(title=f"runs in {log_dir}")
    for column in ("id", "time", "command", "kernels", "cases", "outcome"):
        table.add_column(column)
    for record in records:
        row = summary(record)
        table.add_row(*("" if row[c] is None else str(row[c]) for c in row))
    console.print(table)
