"""Launch configurations for the attention kernels: pinned, fixed (interpreter), from a table,
guessed, or autotuned.

On the GPU the first call for a (kernel, dtype, head_dim, causal, GQA group, length bucket,
variants) looks the winner up in the tuned table shipped for this GPU and Triton minor version
(``kernels/tuned/``), then in the user's cache. On a miss it takes a heuristic config at once
(:func:`heuristic`: the winner of the table's nearest key of the same kernel, dtype, head-dim
class and masking, else the candidate list's head) - tuning costs 10-20 s of compiling and timing
per key, more than most first uses are worth. Tuning happens on request: ``launch="tune"``, or
``FLASHRUN_TUNE=1`` (``--tune``, ``[triton] tune``) for every call; it compiles a small pruned set
of configs in parallel, times them on the real inputs and keeps the fastest (in memory and on
disk). Tables and caches are keyed by GPU, Triton minor version and the version of the
launch-config space - not by a hash of the kernel source, which any edit would invalidate.
``[triton]`` in the config pins a config instead (unset fields fall back to the fixed default
for that kernel). In Triton's interpreter a small fixed config is used. :data:`CHOSEN` says what
the last launch of each kernel ran and where its config came from.

:func:`launch` is how the launchers start a kernel; inside :func:`compile_only` it hands the
launch to a compiler instead of running it (tuning's parallel compile of its candidates, and
:mod:`flashrun.kernels.warmup`'s compile of everything a run will launch).
"""

from __future__ import annotations

import json
import logging
import os
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import triton

from flashrun.device import interpreting

log = logging.getLogger("flashrun.tuning")

INTERPRETED = interpreting()  # fixed when the kernels are defined, as Triton fixes it


def _interpret_as_compiled() -> None:
    """Triton's interpreter checks every 32-bit integer add, subtract and multiply for overflow
    (its builder's ``sanitize_overflow``, on there; a compiled kernel checks only when built with
    debug): a device assert on 64-bit copies per operation, about a third of the interpreter's
    time in flashrun's kernels (NOTES v26). Off, as the GPU runs them."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False):
        builder.options = replace(options, sanitize_overflow=False)


if INTERPRETED:
    _interpret_as_compiled()


@dataclass(frozen=True)
class LaunchConfig:
    """BLOCK_M x BLOCK_N tile (queries x keys), warps per program, software-pipelining depth,
    and for the forward: tensor-descriptor (TMA) loads and, with them, warp specialization.

    Any field may be None in a user override; :meth:`filled` completes it from a default.
    """

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tma: bool | None = None  # forward only: load Q/K/V through tensor descriptors (Hopper TMA)
    ws: bool | None = None  # forward with tma only: producer/consumer warp specialization

    def filled(self, default: LaunchConfig) -> LaunchConfig:
        return replace(default, **{f.name: getattr(self, f.name) for f in fields(self)
                                   if getattr(self, f.name) is not None})

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}" + (" tma" if self.tma else "")
                + (" ws" if self.ws else ""))


C = LaunchConfig
# The launch-config space's version: bump it whenever a candidate list or the meaning of a config
# field changes, so tuned tables (shipped or cached) made for another space are not used. A new
# kernel kind (e.g. "bwd_fused") only adds keys: tables without them tune those on first use.
SPACE_VERSION = 3  # 2: the backward's candidates of NOTES v6; 3: two forward tiles for short sequences (v14)
# Tuned tables shipped with flashrun, one per GPU and Triton minor version
# (benchmarks/probes/tune_table.py regenerates them on the GPU): a hit compiles only the winner.
SHIPPED = Path(__file__).parent / "tuned"
USE_SHIPPED = True  # benchmarks/probes/tune_table.py turns it off to tune afresh
# How callers choose: None takes the table, else a heuristic config (tuning on a miss only with
# FLASHRUN_TUNE=1); "tune" takes the table, else tunes; "default" takes each kernel's default
# config; a LaunchConfig or {kernel: LaunchConfig} pins.
Launch = LaunchConfig | dict[str, LaunchConfig] | str | None
# Where a launch's config came from, as :data:`CHOSEN` and the results say it.
SOURCES = ("table", "tuned", "heuristic", "default", "pinned", "interpreter")
# The interpreter runs every program in numpy: fewer, larger tiles are faster, but tiles must stay
# small enough that short test sequences still cross block boundaries.
INTERPRETER = C(32, 32, 4, 1, False)

# Pruned candidate spaces, per kernel and head_dim class. Kernels: "fwd" (block_m = query tile),
# "bwd_fused" (the 5-matmul backward: dK/dV plus atomic dQ; block_m = query tile streamed past a
# block_n key tile it owns), and the deterministic backward's "bwd_dkdv" (the same tiles, no dQ)
# and "bwd_dq" (block_m query rows streaming block_n keys).
_SPACE: dict[tuple[str, str], list[LaunchConfig]] = {
    # The last of each forward list came from round 14's short-sequence probe (NOTES v14): at 512
    # causal keys a 2-stage 64x64 TMA tile at head_dim 64 and a 64x64 TMA tile at 128 (1.03x and
    # 1.13x the tuner's winners there).
    ("fwd", "small"): [C(128, 64, 4, 3, False), C(64, 64, 4, 3, False), C(128, 128, 8, 3, False),
                       C(128, 64, 4, 3, True), C(128, 128, 8, 3, True), C(64, 64, 4, 3, True),
                       C(64, 64, 4, 2, True)],
    ("fwd", "large"): [C(128, 64, 4, 3, False), C(64, 64, 4, 3, False), C(128, 128, 8, 3, False),
                       C(128, 64, 4, 3, True), C(128, 128, 8, 3, True), C(128, 64, 8, 3, True),
                       C(128, 128, 8, 3, True, ws=True), C(64, 64, 4, 3, True)],
    ("fwd", "huge"): [C(64, 64, 4, 2, False), C(128, 64, 8, 2, False), C(64, 32, 4, 2, False),
                      C(64, 64, 4, 2, True), C(128, 64, 8, 2, True)],
    # The backward (NOTES v6; registers and programs per SM from tests/compile_bwd.py
    # with triton 3.6's ptxas). First, FlexAttention's H100 tiles: a 128-key dK/dV block over two
    # warpgroups (each 64 keys: dK + dV accumulators 128 registers per thread), 64 query rows per
    # step, one 8-warp program per SM; dQ 128 rows x 64 keys. Then 4-warp, 2-stage tiles that fit two
    # programs per SM (<= 100 KB of shared memory, <= 255 registers x 128 threads), so one program's
    # softmax runs under the other's matmuls. Left out: tiles whose compiled loop spills in every
    # iteration or whose wgmmas ptxas serializes (C7515), e.g. 32x128 w4 (2.6 KB of spills at D = 128).
    ("bwd_fused", "small"): [C(64, 128, 8, 3), C(64, 64, 4, 2), C(64, 128, 8, 2)],
    ("bwd_fused", "large"): [C(64, 128, 8, 3), C(64, 64, 4, 2), C(64, 128, 8, 2)],
    ("bwd_fused", "huge"): [C(32, 64, 8, 2), C(64, 64, 8, 2), C(32, 64, 4, 2)],
    ("bwd_dkdv", "small"): [C(64, 128, 8, 3), C(64, 64, 4, 2), C(32, 64, 4, 2), C(64, 128, 8, 2)],
    ("bwd_dkdv", "large"): [C(64, 128, 8, 3), C(64, 64, 4, 2), C(32, 128, 8, 3), C(32, 64, 4, 2), C(64, 128, 8, 2)],
    ("bwd_dkdv", "huge"): [C(64, 64, 8, 2), C(32, 128, 8, 2), C(16, 64, 4, 2)],
    ("bwd_dq", "small"): [C(128, 64, 8, 3), C(64, 64, 4, 2), C(64, 32, 4, 2), C(128, 64, 8, 2)],
    ("bwd_dq", "large"): [C(128, 64, 8, 3), C(64, 64, 4, 2), C(64, 32, 4, 2), C(128, 64, 8, 2)],
    ("bwd_dq", "huge"): [C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 16, 4, 2), C(128, 32, 8, 2)],
}
# float32 (IEEE dots on CUDA cores) needs more registers per element: small tiles only.
_FP32 = [C(64, 32, 4, 2, False), C(32, 32, 4, 2, False)]


def _head_dim_class(head_dim: int) -> str:
    return "small" if head_dim <= 64 else "large" if head_dim <= 128 else "huge"


def candidates(kind: str, head_dim: int, dtype: torch.dtype) -> list[LaunchConfig]:
    if dtype == torch.float32:
        return list(_FP32)
    return list(_SPACE[(kind, _head_dim_class(head_dim))])


def default(kind: str, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The config used when tuning is skipped: the first candidate (the usual winner)."""
    return INTERPRETER if INTERPRETED else candidates(kind, head_dim, dtype)[0]


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function, whose wrapper costs a few
    microseconds per call from Python (Triton 3.6 and 3.9), on every launch."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for 0, as Triton's), without its wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _bucket(n: int) -> int:
    return min(max(16, next_power_of_2(n)), 1 << 16)


def _key(kind: str, dtype: torch.dtype, head_dim: int, causal: bool, group: int, n_q: int, n_k: int,
         variants: str) -> str:
    """The table key: ``bwd_dq|bfloat16|d128|causal|g1|nq1024|nk1024`` (``|window+softcap`` last)."""
    return "|".join((kind, str(dtype).removeprefix("torch."), f"d{head_dim}", "causal" if causal else "full",
                     f"g{group}", f"nq{_bucket(n_q)}", f"nk{_bucket(n_k)}", *([variants] if variants else [])))


def _fields(key: str) -> dict[str, Any] | None:
    """:func:`_key`'s fields back from a key (None for a key of another form)."""
    parts = key.split("|")
    if len(parts) not in (7, 8) or not parts[2][1:].isdigit():
        return None
    try:
        return {"kind": parts[0], "dtype": parts[1], "head_dim": int(parts[2][1:]), "causal": parts[3],
                "group": int(parts[4][1:]), "nq": int(parts[5][2:]), "nk": int(parts[6][2:]),
                "variants": parts[7] if len(parts) == 8 else ""}
    except ValueError:
        return None


_guessed: dict[str, LaunchConfig] = {}  # key -> heuristic config (never saved: it was not measured)


def heuristic(kind: str, key: str, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The config for a key the tables miss, without tuning: the winner of the nearest key in the
    tables for the same kernel, dtype, head-dim class and masking (causal or not) - nearest in
    log2 of the lengths, then variants, GQA group and head_dim - when that winner is among this
    key's candidates; else the candidate list's head (:func:`default`, what verify checks)."""
    if key in _guessed:
        return _guessed[key]
    want = _fields(key)
    allowed = candidates(kind, head_dim, dtype)
    best: tuple[float, LaunchConfig] | None = None
    for other, winner in _memory.items():
        have = _fields(other)
        if want is None or have is None or any(have[f] != want[f] for f in ("kind", "dtype", "causal")):
            continue
        if _head_dim_class(have["head_dim"]) != _head_dim_class(head_dim):
            continue
        cfg = LaunchConfig(**winner)
        if cfg not in allowed:
            continue
        distance = (abs(math.log2(have["nq"] / want["nq"])) + abs(math.log2(have["nk"] / want["nk"]))
                    + 0.5 * (have["variants"] != want["variants"]) + 0.25 * (have["group"] != want["group"])
                    + abs(have["head_dim"] - head_dim) / 1024)
        if best is None or distance < best[0]:
            best = (distance, cfg)
    _guessed[key] = best[1] if best is not None else default(kind, head_dim, dtype)
    return _guessed[key]


def tune_on_miss() -> bool:
    """``FLASHRUN_TUNE=1`` (set for a run by ``--tune`` / ``[triton] tune``; read at each call):
    a key the tables miss is tuned on first use instead of taking :func:`heuristic`'s config."""
    return os.environ.get("FLASHRUN_TUNE", "0").strip().lower() in ("1", "true", "yes", "on")


_table_names: dict[int, str] = {}  # device index -> table_name(); looked up on every launch


def table_name() -> str:
    """``<gpu>-triton<major.minor>``: what a tuned table is valid for (with SPACE_VERSION), for
    the current device."""
    device = torch.cuda.current_device()
    name = _table_names.get(device)
    if name is None:
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-").lower()
        name = _table_names[device] = f"{gpu}-triton{'.'.join(triton.__version__.split('.')[:2])}"
    return name


def cache_root() -> Path:
    """Where flashrun keeps what it learns about this machine: ``FLASHRUN_CACHE_DIR``, else
    ``~/.cache/flashrun`` (Triton keeps its compiled kernels in its own cache)."""
    return Path(os.environ.get("FLASHRUN_CACHE_DIR") or Path.home() / ".cache" / "flashrun")


_table_paths: dict[tuple[str | None, str | None, str], tuple[Path, Path]] = {}


def _paths() -> tuple[Path, Path]:
    """(the shipped table, the user's cache) for the current GPU, built once per GPU and cache
    folder: every launch looks them up, and building them (the device's name, the home folder,
    two Paths) took most of flashrun's own ~135 µs per forward call (CPU-measured, launch stubbed)."""
    key = (os.environ.get("FLASHRUN_CACHE_DIR"), os.environ.get("HOME"), table_name())
    paths = _table_paths.get(key)
    if paths is None:
        paths = _table_paths[key] = (SHIPPED / f"{key[2]}.json", cache_root() / f"tune-{key[2]}-space{SPACE_VERSION}.json")
    return paths


def _cache_path() -> Path:
    return _paths()[1]


_memory: dict[str, dict[str, int]] = {}
_origin: dict[str, str] = {}  # key -> "table" (shipped) or "tuned" (the user's cache, or tuned here)
_loaded_from: set[Path] = set()
# kind -> (config, source) of the last real launch of each kernel kind since chosen() last read
# it (compiling only records nothing)
CHOSEN: dict[str, tuple[LaunchConfig, str]] = {}


def chosen() -> dict[str, dict[str, str]]:
    """What the launches since the last call ran, per kernel kind (its last launch), as results
    show it - ``{"fwd": {"config": "128x64 w4 s3", "source": "table"}}`` - and forget it: call
    once before the calls of interest, once after."""
    said = {kind: {"config": str(cfg), "source": source} for kind, (cfg, source) in CHOSEN.items()}
    CHOSEN.clear()
    return said


def _chose(kind: str, cfg: LaunchConfig, source: str) -> LaunchConfig:
    if _compile_only is None:
        CHOSEN[kind] = (cfg, source)
    return cfg


def _load(path: Path, shipped: bool = False) -> None:
    """Merge a table into memory: the shipped one (a document with its space version), or the
    user's cache (winners only, its space version in the file name)."""
    if path in _loaded_from:
        return
    _loaded_from.add(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no table yet, or a damaged one: tune again
    if shipped:
        if data.get("space_version") != SPACE_VERSION:
            log.debug("ignoring %s: made for launch-config space %s, this is %s", path,
                      data.get("space_version"), SPACE_VERSION)
            return
        data = data.get("configs", {})
    _memory.update(data)
    _origin.update(dict.fromkeys(data, "table" if shipped else "tuned"))


def _save(path: Path) -> None:
    from flashrun.records.files import atomic_write_json

    try:
        atomic_write_json(path, _memory)
    except OSError as exc:  # a read-only home must not break a run
        log.warning("could not save tuning cache %s: %s", path, exc)


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or inside :func:`compile_only` its hand-over to the compiler."""
    if _compile_only is not None:
        _compile_only(kernel, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


# While set: what launch() does instead of launching, f(kernel, grid, args, kwargs)
_compile_only: Callable[[Any, Any, tuple, dict], None] | None = None


def compiling() -> bool:
    """Whether launches are being compiled, not run (:func:`compile_only`)."""
    return _compile_only is not None


@contextmanager
def compile_only(compile: Callable[[Any, Any, tuple, dict], None]) -> Iterator[None]:
    """Within: the launchers' launches go to ``compile(kernel, grid, args, kwargs)`` instead of
    running. Nothing is launched, so outputs hold whatever their allocations held; the
    launchers make the same decisions (configs, paths) as for a real call, without tuning."""
    global _compile_only
    previous, _compile_only = _compile_only, compile
    try:
        yield
    finally:
        _compile_only = previous


def _warmup(kernel, grid, args: tuple, kwargs: dict) -> None:
    kernel.warmup(*args, grid=grid, **kwargs)


def _precompile(configs: list[LaunchConfig], run: Callable[[LaunchConfig], None]) -> None:
    """Compile every candidate at once in a thread pool (Triton's AsyncCompileMode, 3.5+), so
    tuning waits for the slowest compile instead of their sum. Launchers go through
    :func:`launch`, which only compiles while this runs; a candidate that cannot compile is
    left for the timing loop to skip."""
    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None or len(configs) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(min(len(configs), os.cpu_count() or 4)) as pool:
        try:
            with mode(pool, ignore_errors=True), compile_only(_warmup):
                for cfg in configs:
                    try:
                        run(cfg)
                    except Exception as exc:  # noqa: BLE001 - e.g. a descriptor this shape cannot take
                        log.debug("not precompiling %s: %s", cfg, exc)
        except Exception as exc:  # noqa: BLE001 - precompiling is an optimisation, never fatal
            log.debug("parallel precompile failed: %s", exc)
    log.debug("precompiled %d configs in %.1fs", len(configs), time.perf_counter() - start)


_launchable_here: dict[str, LaunchConfig] = {}  # key -> the heuristic config that launched (not saved)


def _launchable(key: str, guess: LaunchConfig, configs: list[LaunchConfig],
                run: Callable[[LaunchConfig], None]) -> LaunchConfig:
    """``guess``, or where it cannot launch here (shared memory or registers: the limits differ
    per GPU, dtype and head_dim, e.g. float32 at head_dim 256) the first candidate that can. The
    first call of a key launches it once to find out; the answer is kept for the process."""
    if key in _launchable_here:
        return _launchable_here[key]
    if _compile_only is not None:
        return guess  # compiling ahead: nothing launches, the first real call finds out
    from triton.runtime.errors import OutOfResources

    for cfg in [guess, *(c for c in configs if c != guess)]:
        try:
            run(cfg)
        except OutOfResources as exc:
            log.debug("heuristic %s cannot launch here (%s); trying the next candidate", cfg, exc)
            continue
        _launchable_here[key] = cfg
        return cfg
    raise RuntimeError(f"no launch configuration fits this GPU for {key}")


def choose(kind: str, q: torch.Tensor, k: torch.Tensor, causal: bool,
           launch: Launch, run: Callable[[LaunchConfig], None], *, variants: str = "",
           lengths: tuple[int, int] | None = None) -> LaunchConfig:
    """The config to launch ``kind`` with; may time ``run(cfg)`` for each candidate first.

    ``launch``: None takes the tables, else :func:`heuristic` (tuning instead with
    :func:`tune_on_miss`); ``"tune"`` takes the tables, else tunes; ``"default"`` takes the
    default; a LaunchConfig pins every kernel (unset fields from the default); a dict pins kernels
    by name. ``variants`` (e.g. ``"window+softcap"``) keys those calls apart: a window leaves
    each tile a few key blocks, a softcap or ALiBi adds work per score, so another config may win.
    ``lengths``: (Nq, Nk) for packed sequences (the longest), whose q/k shapes are (total, heads,
    head_dim). Inside :func:`compile_only` nothing is timed: a key that would be tuned has every
    candidate compiled (the tuner then finds them compiled) and the heuristic config returned.
    """
    head_dim = q.shape[-1]
    if launch == "default":  # no tuning: each kernel's default config (what verify checks)
        return _chose(kind, default(kind, head_dim, q.dtype), "interpreter" if INTERPRETED else "default")
    if isinstance(launch, dict):  # per-kernel pins, e.g. {"fwd": LaunchConfig(128, 64, 4, 3)}
        launch = launch.get(kind)
    if isinstance(launch, LaunchConfig) and any(getattr(launch, f.name) is not None for f in fields(launch)):
        return _chose(kind, launch.filled(default(kind, head_dim, q.dtype)), "pinned")
    if INTERPRETED:
        return _chose(kind, INTERPRETER, "interpreter")
    n_q, n_k = lengths if lengths is not None else (q.shape[2], k.shape[2])
    key = _key(kind, q.dtype, head_dim, causal, q.shape[1] // k.shape[1], n_q, n_k, variants)
    path = _cache_path()
    if USE_SHIPPED:
        _load(_paths()[0], shipped=True)
    _load(path)  # the user's own winners override the shipped ones
    if key in _memory:
        return _chose(kind, LaunchConfig(**_memory[key]), _origin.get(key, "tuned"))
    guess = heuristic(kind, key, head_dim, q.dtype)
    configs = candidates(kind, head_dim, q.dtype)
    if not (launch == "tune" or tune_on_miss()):
        return _chose(kind, _launchable(key, guess, configs, run), "heuristic")
    if _compile_only is not None:  # compiling ahead: the tuner will time these
        for cfg in configs:
            try:
                run(cfg)
            except Exception as exc:  # noqa: BLE001 - as in _precompile
                log.debug("not precompiling %s: %s", cfg, exc)
        return guess

    start = time.perf_counter()
    timings: list[tuple[float, LaunchConfig]] = []
    _precompile(configs, run)
    for cfg in configs:
        try:
            run(cfg)  # compile + check it launches (shared memory limits differ per GPU)
            ms = triton.testing.do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - an unlaunchable candidate is skipped, not fatal
            log.debug("skipping %s %s: %s", kind, cfg, exc)
            continue
        log.debug("  %s %s: %.3f ms", kind, cfg, ms)
        timings.append((ms, cfg))
    if not timings:
        raise RuntimeError(f"no launch configuration of {kind} runs for head_dim={head_dim}, dtype={q.dtype}")
    best_ms, best = min(timings, key=lambda t: t[0])
    _memory[key] = {f.name: getattr(best, f.name) for f in fields(best)}
    _origin[key] = "tuned"
    _save(path)
    log.info("tuned %s (%s) in %.1fs over %d configs: %s (%.3f ms); cached in %s",
             kind, key, time.perf_counter() - start, len(timings), best, best_ms, path)
    return _chose(kind, best, "tuned")
