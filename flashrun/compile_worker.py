"""The process side of flashrun's compile pool (:mod:`flashrun.kernels.warmup`).

Much of a Triton compile holds the GIL (the front end walks the kernel's AST in Python, and the
MLIR passes do not release it), so threads of one process compile barely faster than one
thread. Processes do. This module is what such a process runs, and it imports only Triton and
the module of the kernel it is asked for: never torch, nor the ``flashrun.kernels`` packages'
``__init__`` (:func:`start` stands empty packages in for them; the modules that hold
``@triton.jit`` kernels - ``flash.jit``, ``fwd``, ``bwd``, ``decode_jit``, ``hopper_jit`` - need
only Triton).

A worker is ``python -m flashrun.compile_worker TRITON_KEY`` (a plain subprocess, not
multiprocessing's: that would import the parent's ``__main__`` again in each worker, a user's
script included). It reads pickled :class:`Job` s from stdin and answers each on stdout with
``(True, seconds)`` or ``(False, "what went wrong")``, one at a time, until stdin closes.

For one specialization the parent sends a :class:`Job`: where the kernel is defined, Triton's
source object's parts (signature, constants, attributes), the target and the options. The worker
rebuilds the source object, checks that it hashes as the parent's did (same kernel source, same
specialization), and compiles it into Triton's cache on disk.

One part of Triton's key depends on the process's history, not on the kernel: a kernel's
``cache_key`` ends with the constexpr globals its callees were seen to use, and that list grows
as the process compiles other kernels (on the H200 with Triton 3.6, 41 of the 109 kernels of a
verify run hashed differently in a fresh worker). So the worker checks the part that is the
kernel - its source and its callees' keys (:func:`source_hash`) - against the parent's, and then
takes the parent's ``cache_key`` as its own, so that what it compiles lands under the key the
parent will look up. The parent then asks Triton for
the same compile, which finds it there and only loads it: Triton's cache stays the store, and
the kernel the parent launches is Triton's own object, built in the parent.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pickle
import signal
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

# packages whose __init__ imports torch; a worker imports their kernel modules without them
_PACKAGES = ("flashrun.kernels", "flashrun.kernels.flash")


@dataclass(frozen=True)
class Job:
    """One specialization to compile, as the parent's Triton would have compiled it."""

    source: type  # the class of Triton's source object: ASTSource, or Gluon's
    module: str  # where the @triton.jit function is a module attribute
    qualname: str
    signature: dict[str, Any]
    constants: dict[Any, Any]
    attrs: dict[Any, Any]
    target: Any  # triton's GPUTarget
    options: dict[str, Any]
    env_vars: dict[str, Any]  # Triton's cache-invalidating environment in the parent
    cache_dir: str
    hash: str  # the source object's hash in the parent
    kernel_source: str  # :func:`source_hash` of the kernel in the parent
    parts: dict[str, str]  # what went into it (:func:`hash_parts`), to say what differs when a worker's does not match


def source_hash(kernel: Any, _known: dict[int, str] | None = None) -> str:
    """A @triton.jit function's source and, recursively, its callees' sources, hashed as Triton's
    ``cache_key`` hashes them (its dependency finder, Triton 3.6 to 3.9) but without the
    constexpr globals seen so far, which Triton appends to every function's key, callees'
    included, and which depend on what the process compiled before."""
    known = {} if _known is None else _known
    if id(kernel) not in known:
        known[id(kernel)] = f"recursion:{kernel._fn_name}"  # a function that calls itself
        finder = _finder()(name=kernel._fn_name, globals=kernel.__globals__,
                           nonlocals=inspect.getclosurevars(kernel.fn).nonlocals, src=kernel.src)
        finder.known = known
        finder.visit(kernel.parse())
        known[id(kernel)] = finder.ret + str(kernel.starting_line_number)
    return known[id(kernel)]


@functools.cache
def _finder() -> type:
    from triton.runtime.jit import DependenciesFinder

    class SourceFinder(DependenciesFinder):
        known: dict[int, str]

        def _update_hash(self, func: Any) -> None:  # a callee: its source hash, not its cache_key
            self.hasher.update((source_hash(func, self.known) + str(getattr(func, "noinline", False))).encode())

    return SourceFinder


def hash_parts(src: Any) -> dict[str, str]:
    """The parts of a Triton source object's hash (``ASTSource.hash`` in Triton 3.6 to 3.9)."""
    constants = [v.cache_key if hasattr(v, "cache_key") else str(v) for _, v in sorted(src.constants.items())]
    return {"kernel source": src.fn.cache_key, "attributes": str(src.attrs),
            "signature": str([v for _, v in sorted(src.signature.items())]), "constants": "-".join(constants)}


def serve(triton_key: str) -> None:
    """A worker's life: answer the jobs on stdin until it closes."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever prints to stdout (a compiler's chatter) stays out of the replies
    start(triton_key)
    jobs = sys.stdin.buffer
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:  # the parent is done (or gone)
            return
        try:
            reply: tuple[bool, Any] = (True, compile_job(job))
        except Exception as exc:  # noqa: BLE001 - the parent compiles it again and raises it there
            reply = (False, f"{type(exc).__name__}: {exc}")
        replies.write(pickle.dumps(reply))
        replies.flush()


def start(triton_key: str) -> None:
    """Before the first job: the parent's hash of Triton's installation (instead of hashing
    ~500 MB of libtriton again), empty stand-ins for the torch-importing packages, Triton
    imported, and Ctrl-C left to the parent (which stops sending jobs; stdin closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import flashrun

    root = os.path.dirname(flashrun.__file__)
    for name in _PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = package
    import triton.runtime.cache

    triton.runtime.cache.triton_key = lambda: triton_key


def compile_job(job: Job) -> float:
    """Compile ``job`` into Triton's cache on disk; the seconds it took. Raises what Triton
    raises, or RuntimeError when the kernel here is not the parent's."""
    import triton
    from triton.runtime.jit import JITFunction

    began = time.perf_counter()
    kernel: Any = importlib.import_module(job.module)
    for part in job.qualname.split("."):
        kernel = getattr(kernel, part)
    while not isinstance(kernel, JITFunction) and hasattr(kernel, "fn"):  # autotuner, heuristics
        kernel = kernel.fn
    if source_hash(kernel) != job.kernel_source:
        raise RuntimeError(f"{job.module}.{job.qualname}'s source here is not the parent's")
    kernel.hash = job.parts["kernel source"]  # Triton's cached cache_key: the parent's (see the module's doc)
    src = job.source(kernel, job.signature, job.constants, job.attrs)
    if src.hash() != job.hash:
        ours = hash_parts(src)
        differ = "; ".join(f"{name}: {job.parts.get(name, '')[:300]!r} in the parent, {ours[name][:300]!r} here"
                           for name in ours if ours[name] != job.parts.get(name))
        raise RuntimeError(f"{job.module}.{job.qualname} hashes differently in a worker than in its parent ({differ})")
    triton.knobs.cache.dir = job.cache_dir
    triton.compile(src, target=job.target, options=job.options, _env_vars=job.env_vars)
    return time.perf_counter() - began


if __name__ == "__main__":
    serve(sys.argv[1])
