"""Where kernels run: the GPU, or Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is defined
(that is, when a kernel module is imported), from ``TRITON_INTERPRET``. So :func:`select` must
run before ``flashrun.kernels`` (or a user's kernel file) is imported; it imports torch, never
triton.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

from flashrun.errors import DeviceError

INTERPRETER_NOTICE = "CPU interpreter mode (slow; for correctness only)"


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    interpreter: bool  # kernels run through TRITON_INTERPRET=1
    notice: str | None = None  # said to the user when the choice is not what they asked for

    @property
    def torch_device(self) -> str:
        return self.kind


def no_gpu_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; `flashrun check-env` says why"


def select(requested: str = "auto") -> Device:
    """Pick the device for ``requested`` (auto | cuda | cpu) and set up Triton for it."""
    import torch

    if requested not in ("auto", "cuda", "cpu"):
        raise DeviceError(f"unknown device {requested!r}", hint="use auto, cuda or cpu")
    has_gpu = torch.cuda.is_available()
    if requested == "cpu" or not has_gpu:
        notice = None
        if requested == "cuda":
            notice = f"the config asks for cuda, but {no_gpu_reason()}: running through Triton's interpreter on the CPU"
        elif requested == "auto":
            notice = f"no GPU found: {INTERPRETER_NOTICE}"
        use_interpreter()
        return Device("cpu", True, notice)
    use_compiler()
    # flashrun's commands judge and time the fast path and compile it ahead: the Gluon paths'
    # first-use checks wait rather than run in the background (the library's default, hopper.first_use)
    os.environ.setdefault("FLASHRUN_FIRST_USE", "wait")
    return Device("cuda", False)


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter in this process (TRITON_INTERPRET=1).
    Triton reads the variable when a kernel is defined; so do flashrun's kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def where(kind: str) -> str:
    """This process's node and device, as results name them: ``node7:gpu3 (NVIDIA H200)`` (the
    physical index: under Ray, CUDA_VISIBLE_DEVICES maps it to cuda:0) or ``node7:cpu``."""
    host = socket.gethostname()
    if kind != "cuda":
        return f"{host}:cpu"
    import torch

    index = torch.cuda.current_device()
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    physical = visible[index] if index < len(visible) else str(index)
    return f"{host}:gpu{physical} ({torch.cuda.get_device_name(index)})"


def _kernels_imported() -> bool:
    return any(name == "flashrun.kernels" or name.startswith("flashrun.kernels.") for name in sys.modules)


def use_interpreter() -> None:
    if interpreting():
        return
    if _kernels_imported():
        raise DeviceError(
            "the kernels were already loaded for the GPU in this process; cannot switch to the interpreter",
            hint="run the CPU check in a separate process (set TRITON_INTERPRET=1 before starting it)",
        )
    os.environ["TRITON_INTERPRET"] = "1"


def use_compiler() -> None:
    if interpreting():
        if _kernels_imported():
            raise DeviceError(
                "TRITON_INTERPRET=1 is set, so the kernels were loaded for the interpreter, not the GPU",
                hint="unset TRITON_INTERPRET, or pass --device cpu",
            )
        os.environ.pop("TRITON_INTERPRET")
