"""``bench --profile DIR``: Proton's per-kernel views (``.hatchet``), written by a child process.

Why a child: CUPTI, which both profilers drive, takes one subscriber per process, and
torch.profiler (kineto) stays subscribed after its first session. On the H200 (torch 2.11,
triton 3.6) the first Proton pass of a ``bench --profile`` run wrote its view; every pass after
the first torch.profiler session failed with ``RuntimeError: Failed to execute cuptiSubscribe with
error 39`` (or ``cuptiActivityFlushAll``), and running Proton before torch.profiler in each cell
did not help. So bench's process keeps torch.profiler (each row's GPU time and Chrome trace,
:mod:`~flashrun.harness.probe`), and after the sweep :func:`write_views` runs every cell that
timed ``ok`` once more in ``python -m flashrun.harness.proton_pass``, a process that never starts
torch.profiler: the same inputs (:func:`~flashrun.harness.measure.make_sets`, same shape and
seed), the same timed callable (:func:`~flashrun.harness.measure._timed_call`), one warm-up call,
then Proton over as many calls as torch.profiler watched (:func:`~flashrun.harness.probe.profiled_calls`).
Each view is named like its cell's trace (``NNN_<shape>-<provider>-<mode>.hatchet``).

The child reads a pickled :class:`Request` on stdin and answers on stdout with a JSON list, one
``{"hatchet": PATH or null, "note": TEXT}`` per cell, in order; whatever else it or a library
prints goes to stderr. A cell that fails is a note; the child exits 0 unless it could not read
its request.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashrun.harness.shapes import Shape

if TYPE_CHECKING:  # torch is imported only where a pass runs
    import torch
    from rich.console import Console

    from flashrun.harness.sweep import ShapeJob, ShapeRows

START_S, CELL_S = 300, 60  # the child's time limit: imports and CUDA first, then each cell (compiles included)
WHY = "in a child process: CUPTI takes one profiler per process"


@dataclass(frozen=True)
class Cell:
    """One timed cell to view again: which call, and where its view goes."""

    shape: Shape
    provider: str
    mode: str
    seed: int
    stem: str  # the view's path without ".hatchet" (Proton adds it)
    calls: int  # calls watched by Proton: as many as torch.profiler watched

    @property
    def name(self) -> str:
        return f"{self.provider} {self.mode} on {self.shape.label}"


@dataclass(frozen=True)
class Request:
    device: str  # "cuda" (bench), or "cpu" (the tests: Proton cannot profile there)
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Outcome:
    """A cell's view: the file written, or why there is none."""

    hatchet: str | None
    note: str = ""


class ChildFailed(Exception):
    """The child gave no usable answer at all (it died, hung, or was stopped)."""


# -- the parent: bench's process -----------------------------------------------------------------------
def available() -> bool:
    """Whether Triton's Proton profiler is installed and not switched off, without importing it
    (``TRITON_PROTON_DISABLE`` read as Triton reads a flag: 1, true or on)."""
    import importlib.util

    if os.environ.get("TRITON_PROTON_DISABLE", "").strip().lower() in ("1", "true", "on"):
        return False
    try:
        return importlib.util.find_spec("triton.profiler") is not None
    except (ImportError, ValueError):
        return False


def cells_of(jobs: list[ShapeJob], parts: list[ShapeRows], profile: Path) -> list[Cell]:
    """Every cell of the sweep that timed ``ok``, its view named like its trace."""
    from flashrun.harness.probe import file_stem, profiled_calls

    by_index = {job.index: job for job in jobs}
    cells = []
    for part in parts:
        job = by_index[part.index]
        for row in part.rows:
            if row.status == "ok" and row.ms:
                stem = profile / file_stem(job.prefix, f"{row.provider}-{row.mode}")
                cells.append(Cell(job.shape, row.provider, row.mode, job.seed, str(stem), profiled_calls(row.ms)))
    return cells


def write_views(cells: list[Cell], device: str, profile: Path, console: Console | None = None) -> str | None:
    """Proton's views of ``cells``, written by one child process; the notice that says how it went
    (None: no cell to view). Never raises for the child's sake: the bench's rows stand without it."""
    if not cells:
        return None
    status = console.status(f"Proton's per-kernel views of {len(cells)} cells ({WHY})") if console else nullcontext()
    try:
        with status:
            outcomes = spawn(Request(device, tuple(cells)), timeout=START_S + CELL_S * len(cells))
    except ChildFailed as exc:
        return f"Proton's per-kernel views: none written: the child process that writes them failed ({exc})"
    return summary(cells, outcomes, profile)


def spawn(request: Request, timeout: float) -> list[Outcome]:
    """``python -m flashrun.harness.proton_pass`` on ``request`` (this environment inherited): one
    :class:`Outcome` per cell. Ctrl-C stops the child, not the bench: its files are written."""
    try:
        done = subprocess.run([sys.executable, "-m", "flashrun.harness.proton_pass"], input=pickle.dumps(request),
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"stopped after {timeout:.0f} s") from None
    except KeyboardInterrupt:
        raise ChildFailed("stopped by Ctrl-C") from None
    except OSError as exc:
        raise ChildFailed(f"could not start {sys.executable}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        raise ChildFailed(f"exit code {done.returncode}: {_last_line(done.stderr)}")
    try:
        replies = json.loads(done.stdout)
        outcomes = [Outcome(reply["hatchet"], reply["note"]) for reply in replies]
    except (ValueError, TypeError, KeyError):
        raise ChildFailed(f"an unreadable reply: {done.stdout[:200]!r}") from None
    if len(outcomes) != len(request.cells):
        raise ChildFailed(f"{len(outcomes)} replies for {len(request.cells)} cells")
    return outcomes


def summary(cells: list[Cell], outcomes: list[Outcome], profile: Path) -> str:
    """``Proton's per-kernel views: 10 written to DIR (...); 2 not, e.g. flash bwd on ...: why``."""
    written = sum(outcome.hatchet is not None for outcome in outcomes)
    failed = [(cell, outcome.note) for cell, outcome in zip(cells, outcomes) if outcome.hatchet is None]
    text = f"Proton's per-kernel views: {written or 'none'} written to {profile} ({WHY})"
    if failed:
        cell, note = failed[0]
        text += f"; {len(failed)} not, " + (f"e.g. {cell.name}: " if len(failed) > 1 else f"{cell.name}: ") + note
    return text


def _last_line(text: bytes) -> str:
    lines = [line.strip() for line in text.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:240] if lines else "nothing on stderr"


# -- the child -----------------------------------------------------------------------------------------
def serve() -> int:
    """The child's life: one request from stdin, the JSON reply on stdout."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever prints to stdout (Proton, a compiler) stays out of the reply
    request: Request = pickle.load(sys.stdin.buffer)
    outcomes = views(request)
    json.dump([asdict(outcome) for outcome in outcomes], replies)
    replies.close()
    return 0


def views(request: Request) -> list[Outcome]:
    """Each cell of ``request`` timed again, in this process, under Proton: one :class:`Outcome` each."""
    from flashrun import device as device_mod

    device_mod.select(request.device)  # before any kernel module is imported: Triton reads TRITON_INTERPRET then
    import torch

    from flashrun.harness.flex import compile_settings
    from flashrun.harness.measure import free_memory

    device = torch.device(request.device)
    try:
        import triton.profiler as proton
    except ImportError as exc:
        return [Outcome(None, f"cannot import triton.profiler: {exc}")] * len(request.cells)
    compiles = device.type == "cuda" and any(cell.provider == "flex" for cell in request.cells)
    n_shapes = len({cell.shape for cell in request.cells})
    outcomes = []
    with compile_settings(n_shapes) if compiles else nullcontext():  # as the sweep compiled Flex
        for cell in request.cells:
            outcomes.append(_view(cell, device, proton))
            free_memory(device)
    return outcomes


def _view(cell: Cell, device: torch.device, proton: Any) -> Outcome:
    """``cell``'s call as bench timed it, warmed up once (compiles and autotuning stay out of the
    view), then under Proton."""
    from flashrun.harness import measure
    from flashrun.harness.providers import failure_reason, resolve

    try:
        provider = resolve(cell.provider, device)
        sets = measure.make_sets(cell.shape, device, cell.seed)
        attn = provider.prepare(cell.shape, device)
        with attn.scope():
            fn, leaves = measure._timed_call(attn, sets, cell.mode, not measure.inference(cell.shape, cell.mode))

            def call() -> None:
                for leaf in leaves or ():
                    leaf.grad = None  # as the timing did
                fn()

            call()
            _synchronize(device)
            return _proton(proton, call, cell.calls, Path(cell.stem), device)
    except Exception as exc:  # noqa: BLE001 - this cell has no view; the others still run
        return Outcome(None, f"could not run it: {failure_reason(cell.provider, exc, [])}")


def _proton(proton: Any, call: Callable[[], None], calls: int, stem: Path, device: torch.device) -> Outcome:
    """Proton's view of ``calls`` calls at ``stem``.hatchet, or why there is none."""
    from flashrun.harness.providers import failure_reason

    try:
        session = proton.start(str(stem), hook="triton")
        if session is None:
            return Outcome(None, "Proton declined to start (switched off, or under proton's own command line)")
        try:
            for _ in range(calls):
                call()
            _synchronize(device)
        finally:
            proton.finalize(session)  # its launch hook must not outlive the pass
    except Exception as exc:  # noqa: BLE001 - an optional view: say why it is missing
        return Outcome(None, f"Proton: {failure_reason('Proton', exc, [])}")
    path = stem.with_name(f"{stem.name}.hatchet")
    return Outcome(str(path)) if path.is_file() else Outcome(None, f"Proton wrote no {path.name}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(serve())
