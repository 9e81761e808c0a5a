"""Where a run happened: the environment fingerprint stored with every run record and bench result.

Cheap by design, since every run records one: versions come from package metadata, and torch's
GPU facts are read only when torch is already imported (the run itself imported it).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def fingerprint() -> dict[str, Any]:
    """Where a run happened. Reads torch's GPU facts only when torch is already imported."""
    from flashrun import __version__

    info: dict[str, Any] = {
        "flashrun": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "git_commit": _git_commit(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
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
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
