"""Run records: one JSON line per run in ``<log_dir>/runs.jsonl``.

A record holds the command, time, resolved config (never a secret), an environment
fingerprint (:mod:`flashrun.env.fingerprint`) and the results, so that any run can be listed,
shown and repeated.
Each record is appended with a single ``write`` on an ``O_APPEND`` descriptor; a reader skips
a torn last line, so a crash never corrupts earlier records.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
from pathlib import Path
from typing import Any

from flashrun.env.fingerprint import fingerprint
from flashrun.errors import InputError
from flashrun.records.redact import redact

RUNS_FILE = "runs.jsonl"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def append_record(log_dir: Path, record: dict[str, Any]) -> Path:
    """Append one record as one line, any registered secret masked. Returns the file written."""
    log_dir = Path(log_dir)
    path = log_dir / RUNS_FILE
    line = (redact(json.dumps(record, default=str, separators=(",", ":"))) + "\n").encode("utf-8")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise InputError(
            f"cannot record the run in {path}: {exc.strerror or exc}",
            hint="set logging.log_dir to a folder you can write (--set logging.log_dir=PATH)",
        ) from None
    return path


def make_record(command: str, argv: list[str], config: dict[str, Any], results: Any, **extra: Any) -> dict[str, Any]:
    return {
        "id": new_run_id(),
        "time": now_iso(),
        "command": command,
        "argv": argv,
        "cwd": str(Path.cwd()),
        "config": config,
        "env": fingerprint(),
        **extra,
        "results": results,
    }


def load_records(log_dir: Path) -> list[dict[str, Any]]:
    """All readable records, oldest first; torn or foreign lines are skipped."""
    path = Path(log_dir) / RUNS_FILE
    if not path.is_file():
        return []
    records = []
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "id" in record:
                records.append(record)
    return records


def find_record(log_dir: Path, run_id: str) -> dict[str, Any]:
    """The record whose id is ``run_id`` (or starts with it, when that is unambiguous)."""
    records = load_records(log_dir)
    exact = [r for r in records if r["id"] == run_id]
    matches = exact or [r for r in records if str(r["id"]).startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    where = Path(log_dir) / RUNS_FILE
    if not matches:
        raise InputError(f"no run {run_id!r} in {where}", hint="`flashrun runs` lists the recorded runs")
    raise InputError(f"run id {run_id!r} is ambiguous ({len(matches)} runs match)", hint="give more characters")


def refuse_rerun_conflicts(run_id: str, given: dict[str, Any], sets: list[str] | None) -> None:
    """``--rerun`` repeats a recorded plan exactly: options that would change it are refused, not
    silently ignored. ``--set logging.*`` stays allowed: it only says where the record is."""
    named = [name for name, value in given.items() if value is not None]
    named += [f"--set {item}" for item in sets or () if not item.partition("=")[0].strip().startswith("logging.")]
    if named:
        raise InputError(
            f"--rerun {run_id} repeats that run exactly as recorded, so {', '.join(named)} would be ignored",
            hint=f"drop {'it' if len(named) == 1 else 'them'} to repeat the run, or run without --rerun to change "
                 f"the plan (`flashrun runs show {run_id}` shows what it ran)",
        )
