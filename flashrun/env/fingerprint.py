"""Where a run happened: the environment fingerprint stored with every run record and bench result.

Cheap by design, since every run records one: versions come from package metadata, and torch's
GPU facts are read only when torch is already imported (the run itself imported it).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from flashrun.device import interpreting
from flashrun.env.probes import dist_version, run_tool
from flashrun.limits import KERNEL_SWITCHES


def _first_line(ran: tuple[int, str] | None) -> str | None:
    """The first line a tool printed, when it ran and succeeded."""
    if ran is None or ran[0] != 0:
        return None
    lines = ran[1].strip().splitlines()
    return lines[0] if lines else None


def _git_commit() -> str | None:
    return _first_line(run_tool(["git", "rev-parse", "--short", "HEAD"], timeout=5))


def fingerprint() -> dict[str, Any]:
    """Where a run happened. Reads torch's GPU facts only when torch is already imported."""
    from flashrun import __version__

    info: dict[str, Any] = {
        "flashrun": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": dist_version("torch"),
        "triton": dist_version("triton"),
        "git_commit": _git_commit(),
        "triton_interpret": interpreting(),
    }
    switches = {name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ}
    if switches:  # a run with a kernel switch set says so (FLASHRUN_PDL=0, FLASHRUN_HOPPER=0, ...)
        info["switches"] = switches
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["cuda_runtime"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["compute_capability"] = f"{props.major}.{props.minor}"
            info["driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    return _first_line(run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=10))
