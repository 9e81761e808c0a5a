"""Compile kernels ahead of their launches, many at once.

Triton compiles a kernel specialization - its constexprs, its arguments' dtypes, which integer
arguments are 1 or multiples of 16 and which pointers are 16-byte aligned - on its first
launch, in the launching thread, one after the other; on Triton 3.6 that first launch also
builds a C launcher for the kernel's signature. A run that needs thirty specializations waits
for thirty compiles in a row while the other cores idle.

:class:`Batch` runs launchers in compile-only mode (:func:`flashrun.kernels.tuning.compile_only`):
each launch becomes ``kernel.warmup(...)`` under Triton's ``AsyncCompileMode``, which works out
Triton's own key, returns what this process holds already, and hands a new specialization to
:class:`_Compiler` - once, however many launches share it. A pool thread (:func:`pool`) sends it
to one of the compile processes (:func:`processes`, :mod:`flashrun.compile_worker`), which compiles
it into Triton's cache on disk (or finds it there), then asks Triton for it here, which only
loads it from that cache; and then loads it onto the GPU (``CompiledKernel._init_handles``: the
launcher, the cubin), which the first launch would otherwise do in the caller's thread.
Processes, not threads, because most of a compile holds the GIL: sixteen threads compiled 109
kernels in 28 s on the H200's host. A kernel that is not a module attribute of flashrun's (or
whose source object does not travel, or ``FLASHRUN_COMPILE_PROCESSES=0``) compiles in the pool
thread itself, as before. :meth:`Batch.wait` blocks until the given kernels are ready and puts
them into their kernel's in-memory cache, where the real launches find them. Triton's caches
stay the store: nothing here is kept.

Before its first compile or cache lookup, each process hashes Triton's own installation
(``triton_key``: ~400-500 MB of libtriton, 0.3-1.5 s), and the first launch builds Triton's C
helpers for CUDA (gcc on a cold cache: 0.45 s on the H200's host). :func:`prime` starts both in
background threads when the kernels are imported (hashing and gcc release the GIL), so they
overlap the CUDA context's start and the first inputs instead of delaying the first kernel; a
batch waits for them rather than doing either a second time. Triton 3.6 also builds a C
launcher per kernel signature with gcc when a compiled kernel is first loaded: a pool thread
builds it while the kernel compiles (:func:`_build_launcher`). A forked child starts with none
of its parent's threads or processes.

The mode is entered in a copy of the caller's context, so launches the caller makes while
kernels compile (a run working through the cases whose kernels are ready) run as usual instead
of joining the mode (Triton 3.6 cannot launch inside it). A kernel that fails to compile here is
left alone: its real launch compiles it again and raises the error where it belongs. Loading in
a pool thread uses a Triton internal that 3.6 to 3.9 share; without it a kernel loads on its
first launch, as before.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import triton

from flashrun import compile_worker
from flashrun.kernels import tuning

log = logging.getLogger("flashrun.warmup")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_batches: weakref.WeakSet[Batch] = weakref.WeakSet()  # every batch of this process (:func:`settle`)


MAX_WORKERS = 32  # a compile process holds ~160 MB (Triton, LLVM; measured on the CPU machine)


def workers() -> int:
    """Kernels compiling at once: one per core of this machine, at most :data:`MAX_WORKERS` (a
    run's ~100 kernels gain little from more, and a 128-core host would hold 20 GB of them)."""
    return min(os.cpu_count() or 4, MAX_WORKERS)


def pool() -> ThreadPoolExecutor:
    """This process's compile threads (started on first use, :func:`workers` of them): each
    compiles one kernel, or waits for a process to compile it, then loads it."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="flashrun-compile")
    return _pool


class _Broken(Exception):
    """A compile process died (killed, out of memory): threads compile from now on."""


class _Processes:
    """:func:`workers` compile processes (``python -m flashrun.compile_worker``), each compiling
    one :class:`~flashrun.compile_worker.Job` at a time over its pipes; a pool thread takes an
    idle one, or waits for one."""

    def __init__(self, count: int, triton_key: str) -> None:
        import flashrun

        env = dict(os.environ)  # this checkout's flashrun, however this process found it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(flashrun.__file__)),
                                                        env.get("PYTHONPATH")) if p)
        self._idle: queue.SimpleQueue[subprocess.Popen | None] = queue.SimpleQueue()
        self._all = [subprocess.Popen([sys.executable, "-m", "flashrun.compile_worker", triton_key], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                     for _ in range(count)]
        for worker in self._all:
            self._idle.put(worker)
        self.pid = os.getpid()  # the process the workers answer
        atexit.register(self.close)

    def close(self) -> None:
        """At exit: close every worker's stdin (an idle one exits), stop any still compiling.
        In a forked child (its copy of this object) only the child's copies of the pipes close:
        the workers are its parent's."""
        self.forget()
        if os.getpid() != self.pid:
            return
        for worker in self._all:
            try:
                worker.wait(timeout=1)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    def forget(self) -> None:
        """Close this process's copies of the workers' pipes, leaving the workers alone."""
        for worker in self._all:
            for pipe in (worker.stdin, worker.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

    def compile(self, job: compile_worker.Job) -> float:
        """``job`` compiled into Triton's disk cache by an idle process; its seconds. Raises
        RuntimeError with the worker's message when it could not, :class:`_Broken` when the
        process died."""
        data = pickle.dumps(job)  # before taking a worker: a job that does not travel costs none
        worker = self._idle.get()
        if worker is None:  # another one died: so is the pool
            self._idle.put(None)
            raise _Broken("a compile process stopped")
        try:
            worker.stdin.write(data)
            worker.stdin.flush()
            ok, value = pickle.load(worker.stdout)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:  # ValueError: closed at exit
            worker.kill()
            self._idle.put(None)
            raise _Broken(f"a compile process stopped: {type(exc).__name__}: {exc}") from exc
        self._idle.put(worker)
        if not ok:
            raise RuntimeError(value)
        return value


_processes: _Processes | None = None
_processes_broken = False


def processes() -> _Processes | None:
    """This process's compile processes, started on the first call (they import Triton and the
    kernel modules, not torch, while the caller lists its launches); None where they are off
    (``FLASHRUN_COMPILE_PROCESSES=0``), cannot start here, or broke: threads compile then."""
    global _processes, _processes_broken
    if _processes_broken or os.environ.get("FLASHRUN_COMPILE_PROCESSES", "1") == "0":
        return None
    with _pool_lock:
        if _processes is None:
            try:
                from triton.runtime.cache import triton_key
            except ImportError:  # another Triton: no known way to hand it the installation's hash
                return None
            _primed()
            try:
                _processes = _Processes(workers(), triton_key())
            except OSError as exc:  # out of processes or memory
                log.info("no compile processes (%s); compiling in threads", exc)
                _processes_broken = True
                return None
    return _processes


def _after_fork_in_child() -> None:
    """A forked child starts without its parent's compile threads (they do not exist in it) and
    processes (they answer the parent): its first batch starts its own."""
    global _pool, _pool_lock, _processes
    _pool_lock = threading.Lock()
    _pool = None
    if _processes is not None:
        _processes.forget()
    _processes = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def compiled_in() -> str:
    """Where this process's batches compile now: ``"processes"`` or ``"threads"``."""
    return "processes" if _processes is not None and not _processes_broken else "threads"


class _Compiler(Executor):
    """Where Triton's ``AsyncCompileMode`` submits its compiles (a closure over Triton's source
    object, target, options and environment; Triton 3.6 to 3.9 name them alike): through a
    process when the closure describes a kernel of flashrun's, else in a pool thread as it is."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        cells = _closure(fn)
        job = _job(cells) if not args and not kwargs else None
        workers_ = processes() if job is not None else None
        if workers_ is None:
            compiling = pool().submit(_compile_here, fn, *args, **kwargs)
        else:
            compiling = pool().submit(_compile_elsewhere, workers_, job, fn)
        src = cells.get("src")
        if src is not None and per_kernel_launchers():
            pool().submit(_build_launcher, src)
        return compiling


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    """The variables Triton's compile closure ``fn`` holds, by name ({} for another callable)."""
    try:
        return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    except (AttributeError, TypeError, ValueError):  # not a closure, or an empty cell
        return {}


@functools.cache
def per_kernel_launchers() -> bool:
    """Whether this Triton builds a C launcher for each kernel signature (3.6, with gcc on a cold
    cache) rather than launching every kernel through one (3.9)."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:  # no CUDA backend in this Triton
        return False
    return hasattr(nvidia, "make_launcher")


def _build_launcher(src: Any) -> None:
    """In a pool thread, beside ``src``'s compile: the C launcher Triton 3.6 would build for it
    when the compiled kernel is first loaded, after its compile (gcc, ~0.35 s on the H200's host,
    one after the other on the path to the kernel being ready). Built from the signature and
    constants as ``CudaLauncher`` builds it, into Triton's cache, where the load finds it. A
    kernel that takes tensor descriptors is left to the load: its launcher also depends on what
    the compile says about them."""
    from triton.backends.nvidia import driver as nvidia

    signature = dict(src.signature)
    if any(str(kind).startswith("tensordesc") for kind in signature.values()):
        return
    constants = {(src.fn.arg_names.index(name),) if isinstance(name, str) else name: value
                 for name, value in src.constants.items()}
    began = time.perf_counter()
    try:
        nvidia.compile_module_from_src(src=nvidia.make_launcher(constants, signature, None), name="__triton_launcher",
                                       library_dirs=nvidia.library_dirs(), include_dirs=nvidia.include_dirs,
                                       libraries=nvidia.libraries)
    except Exception as exc:  # noqa: BLE001 - no compiler or CUDA library here: the load builds it and says so
        log.debug("%s's launcher not built ahead: %s: %s", src.name, type(exc).__name__, exc)
        return
    log.debug("%s's launcher built in %.2f s", src.name, time.perf_counter() - began)


def _compile_here(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In a pool thread: Triton's compile ``fn``, timed for ``-v``."""
    began = time.perf_counter()
    compiled = fn(*args, **kwargs)
    log.debug("%s compiled in a thread in %.2f s", getattr(compiled, "name", "a kernel"), time.perf_counter() - began)
    return compiled


def _job(cells: dict[str, Any]) -> compile_worker.Job | None:
    """What a process needs to compile what Triton's compile closure would, given its variables
    (:func:`_closure`; None: it cannot)."""
    try:
        src, target, options, env_vars = cells["src"], cells["target"], cells["options"], cells["env_vars"]
        function = src.fn.fn  # the Python function under the @triton.jit one
        module, qualname = function.__module__, function.__qualname__
        if not module.startswith("flashrun.") or "<" in qualname:
            return None
        return compile_worker.Job(type(src), module, qualname, dict(src.signature), dict(src.constants),
                                  dict(src.attrs), target, dict(options.__dict__), dict(env_vars),
                                  triton.knobs.cache.dir, src.hash(), _source_hash(src.fn),
                                  compile_worker.hash_parts(src))
    except (AttributeError, KeyError, ValueError, TypeError, RuntimeError):  # another Triton's closure, an empty cell
        return None


_source_hashes: dict[int, tuple[Any, str]] = {}  # id(kernel) -> (kernel, compile_worker.source_hash)


def _source_hash(kernel: Any) -> str:
    """:func:`compile_worker.source_hash`, once per kernel in this process."""
    known = _source_hashes.get(id(kernel))
    if known is None or known[0] is not kernel:
        known = _source_hashes[id(kernel)] = (kernel, compile_worker.source_hash(kernel))
    return known[1]


def _compile_elsewhere(workers_: _Processes, job: compile_worker.Job, fn: Callable[[], Any]) -> Any:
    """In a pool thread: ``job`` compiled by a process, then ``fn()``, Triton's compile here,
    which loads it from the disk cache (or compiles it, and raises its error, when the process
    could not)."""
    global _processes_broken
    try:
        seconds = workers_.compile(job)
        log.debug("%s compiled in a process in %.2f s", job.qualname, seconds)
    except _Broken as exc:
        _processes_broken = True
        log.info("%s; compiling in threads", exc)
    except Exception as exc:  # noqa: BLE001 - fn() below compiles it here and raises what is wrong
        log.debug("%s not compiled in a process: %s: %s", job.qualname, type(exc).__name__, exc)
    return fn()


_primers: list[threading.Thread] = []


def prime() -> None:
    """Start, once per process, in the background: hashing Triton's installation (its cache key),
    building Triton's C helpers for CUDA (``CudaUtils``: a gcc build on a cold cache, else a load
    from it) and importing Gluon (:func:`_gluon`), each of which a process's first compile or
    launch would otherwise wait for. The helpers are only built and loaded (no CUDA call); where
    they cannot be (no CUDA library here), the first launch builds them and reports what is
    wrong, as before."""
    if _primers or tuning.INTERPRETED:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first compile hashes what it hashes, as before
        return
    _primers.append(threading.Thread(target=triton_key, name="flashrun-triton-key", daemon=True))
    _primers.append(threading.Thread(target=_cuda_utils, name="flashrun-cuda-utils", daemon=True))
    _primers.append(threading.Thread(target=_gluon, name="flashrun-gluon", daemon=True))
    for thread in _primers:
        thread.start()


def _cuda_utils() -> None:
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()
    except Exception as exc:  # noqa: BLE001 - no CUDA library or compiler: the first launch says so
        log.debug("Triton's CUDA helpers not built ahead: %s: %s", type(exc).__name__, exc)


def _gluon() -> None:
    """Import what Triton's specializer imports on a process's first launch, whatever the kernel
    (Gluon's tensor descriptor type, to tell its arguments apart): in the profile of the API's
    first call on the H200 0.27 s of it, the image's Triton keeping no bytecode of Gluon's
    sources, ahead of the first compile."""
    try:
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no Gluon in this Triton (or it fails): the first launch says so
        log.debug("Gluon not imported ahead: %s: %s", type(exc).__name__, exc)


def _primed() -> None:
    for thread in _primers:
        thread.join()


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
        processes()  # start them while the caller lists its launches
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._context = contextvars.copy_context()
        self._mode = triton.AsyncCompileMode(_Compiler(), ignore_errors=True)
        self._context.run(self._mode.__enter__)
        self._open = True
        _batches.add(self)

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
        if isinstance(future, Future):  # compiling now: loaded by a pool thread once compiled, never
            # by the caller (a callback on a future already done runs in the caller's thread, and
            # loading builds Triton 3.6's C launcher with gcc: in the profile of the API's first
            # call on the H200, five builds of 0.35 s ran one after the other in the caller's)
            future.add_done_callback(lambda done: self._load_later(compile_, done))
        elif getattr(handle, "module", True) is None:  # in memory, not loaded yet
            pool().submit(self._loaded, compile_, handle)
        else:
            self._loaded(compile_, None)
        return compile_

    def _load_later(self, compile_: Compile, done: Future) -> None:
        try:
            pool().submit(self._loaded, compile_, _result(done))
        except RuntimeError:  # the pool is shut down: the process is exiting, and nothing waits for it
            log.debug("%s compiled after the compile threads stopped: not loaded", compile_.name)

    def _loaded(self, compile_: Compile, compiled: Any) -> None:
        if compiled is not None:
            _load(compiled, self._device)
        self.finished = time.perf_counter()
        log.debug("%s ready %.2f s into the compile step", compile_.name, self.finished - self.started)
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


def settle() -> float:
    """Block until every kernel that any batch of this process handed to the pool is ready; the
    seconds waited. A timing calls it first, so that no compile's loading (Triton 3.6's launcher
    build, under the GIL) shares the host with the timed calls: a forward's first call compiles
    its backward in the background (``attention._compile_ahead``), and on the H200 a flash decode
    call timed meanwhile took 107 us of host time a call against ~30 (NOTES v21)."""
    start = time.perf_counter()
    for batch in list(_batches):
        batch.wait(list(batch.kernels.values()))
    return time.perf_counter() - start


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
