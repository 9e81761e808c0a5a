"""The options the commands share, as ``Annotated`` aliases, and the parsers of list-valued
options. Imported by :mod:`flashrun.cli` only; cheap (no torch, no triton)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flashrun.errors import InputError

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="config.toml to use (default: ./config.toml, else the shipped default).",
                 show_default=False),
]
SettingsOpt = Annotated[
    Optional[Path],
    typer.Option("--settings", help="settings.json to use (default: settings.json next to the config).",
                 show_default=False),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a key: section.key=value, value parsed as TOML (repeatable).",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="More detail; tracebacks on errors.")]
DeviceOpt = Annotated[
    Optional[str],
    typer.Option("--device", help="auto | cuda | cpu (cpu runs Triton's interpreter).", show_default=False),
]
WorkersOpt = Annotated[
    Optional[int],
    typer.Option("--workers", "-w", help="Run this many checks (verify) or shapes (bench) at once on Ray workers: "
                 "a local Ray cluster started for the command, one GPU (or CPU) each; with --cluster, a cap "
                 "(default \\[cluster].workers = 1: in this process, no Ray).", show_default=False),
]
TuneOpt = Annotated[
    bool, typer.Option("--tune", help="Tune flash's launch config for shapes the shipped tuned table misses (10-20 s "
                       "per new shape; default: a heuristic config at once; verify: check tuned configs, not each "
                       "kernel's default).")]
ClusterOpt = Annotated[
    Optional[str],
    typer.Option("--cluster", help="Run on an existing Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                 "(default \\[cluster].address).", show_default=False),
]
ListOpt = Optional[list[str]]


def split(values: list[str] | None) -> list[str]:
    """Options given repeated and/or comma-separated: ``-p a,b -p c`` -> ``[a, b, c]``."""
    return [part.strip() for value in values or () for part in value.split(",") if part.strip()]


def ints(option: str, values: list[str] | None) -> list[int] | None:
    parts = split(values)
    try:
        return [int(part) for part in parts] or None
    except ValueError:
        raise InputError(f"{option}: expected whole numbers like 512,1024, got {', '.join(parts)!r}") from None


def causal_choice(value: str | None) -> list[bool] | None:
    choices = {"yes": [True], "no": [False], "both": [False, True]}
    if value is not None and value not in choices:
        raise InputError(f"--causal {value!r}: expected yes, no or both")
    return None if value is None else choices[value]
