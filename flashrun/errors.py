"""Typed errors. They travel up unchanged; only ``cli.py`` turns them into a message.

Every error carries a one-line ``message`` and an optional ``hint`` (what to do about it).
``exit_code`` follows the CLI contract: 1 a check failed, 2 usage/config/input error.
"""

from __future__ import annotations


class FlashrunError(Exception):
    """Base class: a problem the user can act on, reported without a traceback."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(FlashrunError):
    """A config or settings file (or a ``--set`` override) is missing, malformed or invalid."""


class InputError(FlashrunError):
    """A command-line argument or input file (cases file, run id, ...) is unusable."""


class KernelError(FlashrunError):
    """A kernel cannot be loaded or refuses its inputs (unsupported shape, dtype, signature)."""


class ArgumentError(KernelError, ValueError):
    """A kernel argument has a bad value (a window, softcap, ALiBi slopes, cu_seqlens): a
    ``ValueError`` for Python callers, a ``KernelError`` for the CLI."""


class DeviceError(FlashrunError):
    """The requested device cannot be used (no GPU, Triton already imported in another mode)."""


class ClusterError(FlashrunError):
    """Ray is not installed, or the Ray cluster cannot be started or reached."""


class ModelError(FlashrunError):
    """``flashrun model`` cannot build or load its model (transformers missing, no such checkpoint)."""


class GatewayError(FlashrunError):
    """The LLM gateway could not be reached or answered with an error."""

    exit_code = 1


class MissingKeyError(FlashrunError):
    """The API key variable is not set."""


class GPUFault(FlashrunError):
    """A kernel left the GPU unusable (illegal memory access, launch failure): nothing after it
    in this process can be trusted, so the run stops."""

    exit_code = 1


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure, on the GPU or the CPU: PyTorch's OutOfMemoryError, Python's (or
    numpy's) MemoryError, or an OOM reported by a library as a RuntimeError (cuDNN, Triton, the
    CPU allocator). Read without importing torch."""
    text = str(exc)
    return (isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)
            or "out of memory" in text.lower() or "can't allocate memory" in text)
