"""A real ``flashrun`` process that a test watches and interrupts.

Tests wait here for events - a file that a kernel writes, lines on stderr - never for a fixed
time: a slow or loaded machine makes the waits longer, not the test red. A wait that runs out
fails with everything the process printed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

PATIENCE_S = 600.0  # longer than any healthy wait on a loaded 2-core machine; only a hang runs out


class Watched:
    """``python -m flashrun ARGS``: stdout into a file (read once it ended), stderr collected line
    by line as it comes (``lines``). Use as a context manager: a process left running is killed."""

    def __init__(self, args: list[str], env: dict[str, str], stdout: Path) -> None:
        self._stdout = stdout
        self._out = stdout.open("w")
        # Ctrl-C's default action in the child, whatever this process inherited (a suite started in
        # the background by a non-interactive shell ignores SIGINT, and so would every child)
        self.proc = subprocess.Popen([sys.executable, "-m", "flashrun", *args], stdout=self._out,
                                     stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = PATIENCE_S) -> None:
        """Return once ``ready()``; fail if the process ends first or ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                self._reader.join(timeout)
                raise AssertionError(f"flashrun ended (exit {self.proc.returncode}) before {what}:\n{self.stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"still no {what} after {timeout:g} s:\n{self.stderr}")
            time.sleep(0.05)  # how often to look, not how long to wait

    def interrupt(self, timeout: float = PATIENCE_S) -> tuple[int, str, str]:
        """Ctrl-C (SIGINT); ``(exit code, stdout, stderr)`` once the process has ended."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        self._out.close()
        return code, self._stdout.read_text(), self.stderr

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
