"""Scale-out: verify's checks and bench's shapes as Ray tasks, on local workers or a cluster.

ARCHITECTURE
  ``[cluster] workers = 1`` and no address (the default) never comes here: the commands run
  in-process and Ray is not even imported (:func:`wanted`). Otherwise :func:`connect` gives a
  :class:`Pool` for the length of one command:

  * ``workers = N`` alone: a local Ray cluster started by flashrun (on 127.0.0.1) and shut down
    when the command ends; N CPUs (through the interpreter) or, on a GPU machine, its GPUs;
  * ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``): an existing cluster, joined and
    left; ``workers``, when given, caps how many GPUs (or CPUs) run at once. The driver's
    ``flashrun`` package is shipped to the workers (``py_modules``), so the nodes need its
    dependencies (torch, triton), not flashrun itself;
  * a Ray already initialized in this process (a notebook, the tests) is used as it is.

  :meth:`Pool.map` runs one picklable unit per task - a :class:`~flashrun.harness.check.Job`
  through :func:`~flashrun.harness.check.run_job` (verify), a shape through
  :func:`~flashrun.harness.sweep.run_shape` (bench) - with one GPU per task on GPUs
  (``num_gpus=1``: Ray sets ``CUDA_VISIBLE_DEVICES``) or one CPU per task otherwise, at most
  ``slots`` at once, and yields each outcome as it finishes. The callers submit the longest
  work first (so the run does not end waiting on one long task) and sort the results by index,
  so the table, files and run record are those of a serial run.

  Faults: a task whose worker process dies (a segfault, ``os._exit``, the OOM killer) runs once
  more on a fresh worker (``max_retries=1``); a worker whose CUDA context a kernel broke (a
  sticky error: nothing after it in that process can be trusted) ends itself with the reason,
  which counts the same. A second death becomes a :class:`Fault` with the reason, and the run
  goes on. Ctrl-C cancels the tasks that have not finished and keeps the results that have.

  Compiles: a kernel should compile once per host, not once per worker. Workers on the
  driver's host (:attr:`Pool.same_host`) get the driver's ``TRITON_CACHE_DIR`` and
  ``FLASHRUN_CACHE_DIR`` (Triton's compiled kernels; tuned configs and first-use verdicts), and
  every worker the kernel switches (``FLASHRUN_TUNE``, ``FLASHRUN_HOPPER``, ...) as the driver has them
  when it submits (:meth:`Pool.map`). When the driver has a GPU and the pool's GPUs are on its
  host, verify and bench compile every kernel of flashrun's that the run launches in the driver,
  all at once, before the first task (:mod:`.precompile`): the workers then load them from
  Triton's cache. Workers on other hosts compile their own, as before.

  Ray's own chatter stays off the terminal: worker output is not forwarded
  (``log_to_driver=False``), Ray logs only errors, and the raylet's notes about dead workers
  (printed to *stdout* by Ray, where they would corrupt ``--json``) go to flashrun's debug log
  (``-v``), which is also where the reason a worker gave for ending itself is read back.
  Two of these hooks are Ray internals (``ray._private.worker.print_to_stdstream``,
  ``ray._raylet.raise_sys_exit_with_custom_error_message``, Ray 2.60): without them the notes
  reach the terminal and a fault's reason is generic, nothing else changes.

This module imports Ray only inside :func:`connect`; the workers import it to run
:func:`_execute`.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import site
import socket
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from flashrun.config import ClusterConfig
from flashrun.errors import ClusterError, GPUFault
from flashrun.limits import KERNEL_SWITCHES

log = logging.getLogger("flashrun.cluster")

INSTALL_HINT = "pip install 'flashrun[ray]'"
RETRIES = 1  # a task whose worker died runs once more, on a fresh worker
OBJECT_STORE_BYTES = 256 << 20  # results are small rows; Ray's default would claim 30% of RAM
REASON_WAIT_S = 2.0  # how long a died task waits for the reason its worker gave (it comes separately)
# The driver's switches every worker follows (read when tasks are submitted) ...
FORWARDED = KERNEL_SWITCHES
# ... and its cache folders, for workers on its own host (a path means nothing elsewhere)
HOST_CACHES = ("TRITON_CACHE_DIR", "FLASHRUN_CACHE_DIR")
_LEAVING = "flashrun task "  # how a worker that ends itself starts its last words

T = TypeVar("T")


def wanted(cfg: ClusterConfig) -> bool:
    """Whether a command runs on Ray at all (else in-process, without importing it)."""
    return cfg.address is not None or cfg.workers > 1


@dataclass(frozen=True)
class Fault:
    """A task that gave no result: its worker died twice, Ray ran out of memory, or it raised."""

    status: str  # "error" or "oom"
    reason: str


@dataclass
class Pool:
    """Ray, connected, for one command."""

    ray: Any
    slots: int  # tasks in flight at most
    gpus: bool  # one GPU per task (else one CPU, through the interpreter)
    gpu_types: list[str]  # the cluster's accelerator types (Ray's accelerator_type:* resources)
    description: str  # said to the user: what runs where
    task_env: dict[str, Any] | None = None  # per-task runtime_env (Ray initialized before us)
    notices: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # task label -> why its worker ended itself
    same_host: bool = False  # workers run on the driver's host: they share its caches on disk
    job_env: dict[str, str] = field(default_factory=dict)  # env_vars the job was started with (ours)

    def env(self) -> dict[str, str]:
        """The environment variables tasks get: the job's, the driver's cache folders for
        workers on its host, and its switches (:data:`FORWARDED`) as they are now."""
        names = FORWARDED + (HOST_CACHES if self.same_host else ())
        base = dict((self.task_env or {}).get("env_vars", {})) or dict(self.job_env)
        return {**base, **{name: os.environ[name] for name in names if os.environ.get(name)}}

    @property
    def kind(self) -> str:
        """What the workers run on: "cuda" or "cpu"."""
        return "cuda" if self.gpus else "cpu"

    def map(self, fn: Callable[[T], Any], items: Iterable[T], label: Callable[[T], str],
            resources: Callable[[T], dict[str, float]] | None = None,
            started: Callable[[T], None] | None = None) -> Iterator[tuple[T, Any]]:
        """``fn(item)`` as one Ray task per item, at most ``slots`` at once; yields ``(item,
        result or Fault)`` as tasks finish. ``label(item)`` names a task in fault reasons (no
        spaces); ``resources(item)`` adds custom resources (e.g. one accelerator type);
        ``started(item)`` is called as the task is submitted. Closing the iterator (or Ctrl-C
        while it waits) cancels every task still running."""
        remote = self.ray.remote(_execute)
        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1 if self.gpus else 0, "max_retries": RETRIES,
                                   "retry_exceptions": False}
        env = self.env()
        if self.task_env or env != self.job_env:  # a task env unlike the job's starts workers of its own
            options["runtime_env"] = {**(self.task_env or {}), "env_vars": env}
        queue = collections.deque(items)
        pending: dict[Any, T] = {}
        try:
            while queue or pending:
                while queue and len(pending) < self.slots:
                    item = queue.popleft()
                    if started is not None:
                        started(item)
                    extra = {"resources": resources(item)} if resources is not None else {}
                    pending[remote.options(**options, **extra).remote(fn, item, label(item))] = item
                done, _ = self.ray.wait(list(pending), num_returns=1)
                for ref in done:
                    item = pending.pop(ref)
                    yield item, self._outcome(ref, label(item))
        finally:
            for ref in pending:  # Ctrl-C, or the caller stopped early: what has not finished goes
                try:
                    self.ray.cancel(ref, force=True)
                except Exception as exc:  # noqa: BLE001 - already finished or gone: nothing to cancel
                    log.debug("cancelling a task: %s", exc)

    def _outcome(self, ref: Any, label: str) -> Any:
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref)
        except exceptions.OutOfMemoryError as exc:  # Ray's memory monitor killed the worker
            return Fault("oom", f"out of memory (CPU): Ray's memory monitor stopped the worker: {_first_line(exc)}")
        except exceptions.RayTaskError as exc:  # the unit raised: flashrun's own bug, or a user error
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return Fault("error", f"{type(cause).__name__}: {_first_line(cause)}")
        except exceptions.RayError as exc:  # the worker (or its node) died, also on the retry
            return Fault("error", self._died(label, exc))

    def _died(self, label: str, exc: BaseException) -> str:
        deadline = time.monotonic() + REASON_WAIT_S
        while label not in self.reasons and time.monotonic() < deadline:
            time.sleep(0.05)  # the raylet's note arrives on its own thread, maybe after the error
        why = self.reasons.get(label) or (
            "the kernel crashed it (a segfault, an abort, os._exit) or the system killed it"
            if isinstance(exc, self.ray.exceptions.WorkerCrashedError) else _first_line(exc))
        return f"its worker process died, and again when retried once on a fresh worker: {why}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# In the worker


def _execute(fn: Callable[[Any], Any], item: Any, label: str) -> Any:
    """One task, in a Ray worker: ``fn(item)``, then make sure this process can be trusted with
    the next task; if a kernel broke its CUDA context, end it (Ray retries on a fresh worker)."""
    try:
        result = fn(item)
    except GPUFault as exc:  # bench: a kernel left the GPU unusable
        _leave(label, exc.message)
    broken = _cuda_broken()
    if broken is not None:
        _leave(label, broken)
    return result


def _cuda_broken() -> str | None:
    """Why this process's CUDA context is unusable (a sticky error), or None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any failure here means the context is gone
        return f"the CUDA context is broken: {_first_line(exc)}"
    return None


def _leave(label: str, reason: str) -> None:
    """End this worker process, saying why: the driver reads it from the raylet's note."""
    try:
        from ray._raylet import raise_sys_exit_with_custom_error_message
    except ImportError:  # an older or newer Ray: die without last words
        os._exit(1)
    raise_sys_exit_with_custom_error_message(f"{_LEAVING}{label}: {reason}", 1)


# ---------------------------------------------------------------------------------------------
# Connecting


def _import_ray(local: bool) -> Any:
    """Ray, or a ClusterError saying how to install it. A cluster started here listens on the
    loopback interface only (Ray reads that choice when it is imported)."""
    loopback = local and "ray" not in sys.modules and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's switch for "this machine only"
    try:
        import ray
    except ImportError as exc:
        raise ClusterError(f"more than one worker needs Ray, which cannot be imported here ({exc})",
                           hint=f"{INSTALL_HINT}, or run with --workers 1") from None
    return ray


def _source_root() -> str | None:
    """The folder holding this ``flashrun`` package, when workers would not find it on their
    own (a source checkout run from its root); None when it is installed in site-packages."""
    import flashrun

    root = Path(flashrun.__file__).resolve().parent.parent
    installed = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if root in installed else str(root)


def _local_env() -> dict[str, Any]:
    """Workers on this machine import the driver's flashrun (its folder first on PYTHONPATH) and
    share its caches and switches (:data:`HOST_CACHES`, :data:`FORWARDED`)."""
    env = {name: os.environ[name] for name in FORWARDED + HOST_CACHES if os.environ.get(name)}
    root = _source_root()
    if root is not None:
        paths = [root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return {"env_vars": env} if env else {}


def _same_host(ray: Any) -> bool:
    """Whether a node of the cluster runs on this machine (the driver's node address)."""
    try:
        here = ray.util.get_node_ip_address()
        return any(node.get("Alive") and node.get("NodeManagerAddress") == here for node in ray.nodes())
    except Exception as exc:  # noqa: BLE001 - not knowing means not sharing
        log.debug("cannot tell whether the Ray nodes share this host: %s", exc)
        return False


def _check_reachable(address: str) -> None:
    """Fail in seconds, not minutes: Ray retries an unreachable address for a long time."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"cluster address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT",
                           hint="e.g. --cluster auto (a cluster started on this machine), --cluster 10.0.0.5:6379, "
                                "or --cluster ray://head:10001 (Ray Client)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise ClusterError(f"cannot reach a Ray cluster at {address}: {exc.strerror or exc}",
                           hint="start one with `ray start --head` (it prints the address), or check the host and "
                                "port (the head's GCS port, 6379 by default; ray://HOST:10001 for Ray Client)") from None


def _init(ray: Any, **kwargs: Any) -> None:
    address = kwargs.get("address")
    try:
        with _stderr_to_log() if address is not None else nullcontext():
            ray.init(include_dashboard=False if address is None else None, log_to_driver=False,
                     logging_level=logging.ERROR, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError, ...
        cause = exc.__cause__ or exc
        if address is None:
            raise ClusterError(f"could not start a local Ray cluster: {_first_line(cause)}",
                               hint="`flashrun verify -v` shows Ray's log; --workers 1 runs without Ray") from None
        if "InvalidAuthToken" in str(cause) or "AuthenticationError" in str(cause):
            raise ClusterError(f"the Ray cluster at {address} refused this process's authentication token",
                               hint="the cluster uses token authentication: export RAY_AUTH_MODE=token, with the "
                                    "cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN") from None
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {_first_line(cause)}",
                           hint="check the address; `ray status` on the head shows whether the cluster is up") from None


@contextmanager
def _stderr_to_log() -> Iterator[None]:
    """Ray's C++ core writes its connection retries straight to file descriptor 2 (a line a
    second for as long as it retries): keep them in the debug log instead."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (an embedding host): leave it alone
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode("utf-8", "replace").splitlines():
                log.debug("ray: %s", line)


def _accelerator_types(ray: Any) -> list[str]:
    types = {key.split(":", 1)[1] for node in ray.nodes() if node.get("Alive")
             for key in node.get("Resources", {}) if key.startswith("accelerator_type:")}
    return sorted(types)


@contextmanager
def connect(cfg: ClusterConfig, device: str, cap: bool) -> Iterator[Pool]:
    """Ray for one command (see the module doc). ``device`` is what the run asks for (auto,
    cuda, cpu): "cpu" keeps tasks off GPUs. ``cap``: ``cfg.workers`` was given, so it caps an
    existing cluster (a cluster started here always has that many workers)."""
    local = cfg.address is None
    ray = _import_ray(local)
    owned = not ray.is_initialized()
    task_env = None
    job_env: dict[str, str] = {}
    if not owned:
        where = "the Ray this process already runs"
        task_env = _local_env() or None
    elif local:
        # The CPUs are the workers (one task each); GPUs, if any, are Ray's to detect.
        runtime_env = _local_env()
        job_env = dict(runtime_env.get("env_vars", {}))
        _init(ray, num_cpus=cfg.workers, object_store_memory=OBJECT_STORE_BYTES, runtime_env=runtime_env)
        where = "a local Ray cluster"
    else:
        _check_reachable(cfg.address)
        import flashrun

        _init(ray, address=cfg.address, runtime_env={"py_modules": [str(Path(flashrun.__file__).resolve().parent)]})
        where = f"the Ray cluster at {cfg.address}"
    try:
        with _raylet_notes_to_log(ray) as reasons:
            resources = ray.cluster_resources()
            n_gpus = int(resources.get("GPU", 0))
            gpus = device != "cpu" and n_gpus > 0
            capacity = max(1, n_gpus if gpus else int(resources.get("CPU", 1)))
            slots = min(cfg.workers, capacity) if cap or (owned and local) else capacity
            unit = "GPU" if gpus else "CPU"
            pool = Pool(ray, slots, gpus, _accelerator_types(ray), f"{where}: {slots} {unit}{'s' if slots > 1 else ''} "
                        "at once", task_env, reasons=reasons, same_host=(owned and local) or _same_host(ray),
                        job_env=job_env)
            if cap and cfg.workers > capacity:
                pool.notices.append(f"{cfg.workers} workers asked, the cluster has {capacity} {unit}s: "
                                    f"{capacity} at once")
            if device == "cuda" and not gpus:
                pool.notices.append("the config asks for cuda, but the Ray cluster has no GPU: its workers run the "
                                     "kernels through Triton's interpreter")
            log.debug("%s; resources %s", pool.description, resources)
            yield pool
    finally:
        if owned:
            ray.shutdown()


@contextmanager
def _raylet_notes_to_log(ray: Any) -> Iterator[dict[str, str]]:
    """Route the raylet's notes (a worker died, ...) from the terminal to the debug log, and
    collect the reasons workers gave for ending themselves, by task label."""
    reasons: dict[str, str] = {}
    worker = sys.modules.get("ray._private.worker")
    original = getattr(worker, "print_to_stdstream", None)
    if original is None:  # Ray moved it: its notes reach the terminal, the reasons stay generic
        yield reasons
        return

    def to_log(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if data.get("pid") != "raylet":
            return original(data, *args, **kwargs)
        for line in data.get("lines", []):
            log.debug("ray: %s", line)
            said = re.search(re.escape(_LEAVING) + r"(\S+): (.+)", str(line))
            if said:
                reasons[said.group(1)] = said.group(2).strip()

    worker.print_to_stdstream = to_log
    try:
        yield reasons
    finally:
        worker.print_to_stdstream = original


# ---------------------------------------------------------------------------------------------
# verify's executor


def checks(pool: Pool, jobs: list[Any], reporter: Any, run_job: Callable[[Any], Any]) -> Iterator[Any]:
    """verify's checks on the pool, with the contract of verify's serial executor: each
    :class:`~flashrun.harness.check.CaseResult` is yielded as it finishes (in any order; the
    caller sorts by ``index``, and reports it once kept). A check whose worker died twice is an
    ``error`` (``oom`` when Ray's memory monitor stopped it) with the reason."""
    from flashrun.harness.check import CaseResult

    for job, outcome in pool.map(run_job, jobs, label=lambda job: f"check-{job.index}", started=reporter.started):
        if isinstance(outcome, Fault):
            outcome = CaseResult(job.kernel, job.case, outcome.status, message=outcome.reason, index=job.index)
        yield outcome
