"""Compile kernels ahead of their launches, many at once.

Triton compiles a kernel specialization - its constexprs, its arguments' dtypes, which integer
arguments are 1 or multiples of 16 and which pointers are 16-byte aligned - on its first
launch, in the launching thread, one after the other; on Triton 3.6 that first launch also
builds a C launcher for the kernel's signature. A run that needs thirty specializations waits
for thirty compiles in a row while the other cores idle.

:class:`Batch` runs launchers in compile-only mode (:func:`flashrun.kernels.tuning.compile_only`):
each launch becomes ``kernel.warmup(...)`` under Triton's ``AsyncCompileMode``, which works out
Triton's own key, returns what this process holds already, and hands a new specialization to
:func:`pool` - once, however many launches share it. A pool thread compiles it (from Triton's
cache on disk when an earlier process compiled it: then it is only loaded) and then loads it
(``CompiledKernel._init_handles``: the launcher, the cubin onto the GPU), which the first launch
would otherwise do in the caller's thread. :meth:`Batch.wait` blocks until the given kernels
are ready and puts them into their kernel's in-memory cache, where the real launches find them.
Triton's caches stay the store: nothing here is kept.

Before its first compile or cache lookup, each process hashes Triton's own installation
(``triton_key``: ~400-500 MB of libtriton, 0.3-1.5 s). :func:`prime` starts that in a background
thread when the kernels are imported (hashing releases the GIL), so it overlaps the CUDA
context's start and the first inputs instead of delaying the first kernel; a batch waits for it
rather than hashing a second time.

The mode is entered in a copy of the caller's context, so launches the caller makes while
kernels compile (a run working through the cases whose kernels are ready) run as usual instead
of joining the mode (Triton 3.6 cannot launch inside it). A kernel that fails to compile here is
left alone: its real launch compiles it again and raises the error where it belongs. Loading in
a pool thread uses a Triton internal that 3.6 to 3.9 share; without it a kernel loads on its
first launch, as before.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import triton

from flashrun.kernels import tuning

log = logging.getLogger("flashrun.warmup")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads compiling at once: one per core of this machine."""
    return os.cpu_count() or 4


def pool() -> ThreadPoolExecutor:
    """This process's compile threads (started on first use, :func:`workers` of them)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="flashrun-compile")
    return _pool


_primer: threading.Thread | None = None


def prime() -> None:
    """Start hashing Triton's installation (its cache key) in the background, once per process."""
    global _primer
    if _primer is not None or tuning.INTERPRETED:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first compile hashes what it hashes, as before
        return
    _primer = threading.Thread(target=triton_key, name="flashrun-triton-key", daemon=True)
    _primer.start()


def _primed() -> None:
    if _primer is not None:
        _primer.join()


def available() -> bool:
    """Whether kernels can be compiled ahead here: a GPU build (not the interpreter) of a Triton
    with ``AsyncCompileMode`` (3.5+)."""
    return not tuning.INTERPRETED and hasattr(triton, "AsyncCompileMode")


@dataclass(eq=False)
class Compile:
    """One kernel specialization a batch waits for."""

    name: str  # the @triton.jit function's name
    handle: Any = field(repr=False)  # Triton's FutureKernel, or the CompiledKernel this process held
    ready: threading.Event = field(default_factory=threading.Event, repr=False)
    submitted: bool = True  # False: it was compiled (or being compiled) before this batch asked


class Batch:
    """Kernels compiled ahead for a run: :meth:`collect` what some launcher calls would launch,
    :meth:`wait` for some of them, :meth:`close` when done. ``on_ready(compile)`` is called (from
    a pool thread) as each kernel becomes ready."""

    def __init__(self, on_ready: Callable[[Compile], None] | None = None) -> None:
        self.kernels: dict[int, Compile] = {}  # id(Triton's handle) -> Compile
        self.started = time.perf_counter()
        self.finished: float | None = None  # when the last kernel so far became ready
        self.on_ready = on_ready
        _primed()
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._context = contextvars.copy_context()
        self._mode = triton.AsyncCompileMode(pool(), ignore_errors=True)
        self._context.run(self._mode.__enter__)
        self._open = True

    @property
    def submitted(self) -> int:
        """Specializations this batch handed to the pool (compiled, or loaded from Triton's disk cache)."""
        return sum(c.submitted for c in self.kernels.values())

    @property
    def seconds(self) -> float:
        """From the batch's start until its last kernel so far was ready."""
        return (self.finished or self.started) - self.started

    def collect(self, launches: Callable[[], Any]) -> list[Compile]:
        """Call ``launches()`` with every kernel launch handed to the pool instead of run; the
        kernels it needs, each once. Its outputs are garbage (nothing ran); exceptions pass."""
        needed: dict[int, Compile] = {}

        def hand_over(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
            if self._device is None and torch.cuda.is_initialized():  # the device the launches are for
                self._device = torch.cuda.current_device()
            try:
                handle = self._context.run(kernel.warmup, *args, grid=grid, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the real launch will say what is wrong
                log.debug("not compiling %s ahead: %s: %s", getattr(kernel, "__name__", kernel), type(exc).__name__, exc)
                return
            if handle is not None:
                compile_ = self._track(kernel, handle)
                needed[id(compile_)] = compile_

        with tuning.compile_only(hand_over):
            launches()
        return list(needed.values())

    def _track(self, kernel: Any, handle: Any) -> Compile:
        if id(handle) in self.kernels:
            return self.kernels[id(handle)]
        future = getattr(handle, "future", None)
        compile_ = Compile(getattr(kernel, "__name__", str(kernel)), handle, submitted=isinstance(future, Future))
        self.kernels[id(handle)] = compile_
        if isinstance(future, Future):  # compiling now: load it in the thread that compiled it
            future.add_done_callback(lambda done: self._loaded(compile_, _result(done)))
        elif getattr(handle, "module", True) is None:  # in memory, not loaded yet
            pool().submit(self._loaded, compile_, handle)
        else:
            self._loaded(compile_, None)
        return compile_

    def _loaded(self, compile_: Compile, compiled: Any) -> None:
        if compiled is not None:
            _load(compiled, self._device)
        self.finished = time.perf_counter()
        compile_.ready.set()
        if self.on_ready is not None:
            self.on_ready(compile_)

    def wait(self, kernels: list[Compile]) -> float:
        """Block until ``kernels`` are ready and in their in-memory caches; the seconds waited."""
        start = time.perf_counter()
        for compile_ in kernels:
            compile_.ready.wait()
            result = getattr(compile_.handle, "result", None)
            if result is not None:
                result(True)  # Triton's finalize (ignore_errors: a failed compile is the launch's to report)
        return time.perf_counter() - start

    def close(self) -> None:
        """Wait for every kernel still compiling and leave Triton's mode."""
        if self._open:
            self._open = False
            self.wait(list(self.kernels.values()))
            self._context.run(self._mode.__exit__, None, None, None)


def _result(future: Future) -> Any:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - a compile error: the real launch raises it again
        return None


def _load(compiled: Any, device: int | None) -> None:
    """What the first launch would do before launching: build the launcher, load the binary."""
    init = getattr(compiled, "_init_handles", None)
    if init is None:
        return
    try:
        if device is not None:
            torch.cuda.set_device(device)  # this thread's current device, as the caller's
        init()
    except Exception as exc:  # noqa: BLE001 - e.g. too much shared memory: the launch raises it again
        log.debug("not loading %s ahead: %s: %s", getattr(compiled, "name", compiled), type(exc).__name__, exc)
