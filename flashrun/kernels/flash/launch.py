"""Lean launches: a kernel launched through its ``CompiledKernel`` directly, not through
Triton's per-call ``JITFunction.run``.

``JITFunction.run`` binds every argument, works out the specialization and looks the kernel up
on every call: tens of microseconds for a kernel with fifty arguments, more than the kernel
itself at short lengths (round 7's H200 metrics: flash's forward at N = 512 is launch-bound). A
caller that knows the specialization cannot change between calls - a plan keyed on the shapes,
strides, dtypes and 16-byte alignment Triton specializes on - launches through :class:`_Launch`:
the first call goes through Triton (and compiles), later ones call ``CompiledKernel.run`` with
integer pointers, the calling convention ``JITFunction.run`` itself uses in Triton 3.6 and 3.9.
Whatever watches launches (a profiler's launch hook, ``bench --metrics``' recorder) gets Triton's
own path (:func:`_hooked`).

Under Triton 3.6 a direct launch goes one step further down (:class:`_CLaunch`): to the C launch
that Triton's ``CudaLauncher`` wraps, with each TMA descriptor expanded once per base pointer. On
the H200's host Triton's launcher took 17-29 us of a Gluon forward's ~52 (NOTES v16), of which
the C launch is 5-8: the rest is its Python, six ``make_tensordesc_arg`` calls and their
CUtensorMap fills per launch. A CUtensorMap encodes the base pointer and the layout alone, and a
plan's launch fixes the layout, so one made for a pointer serves every later launch over it.
Another Triton release (3.9's launcher takes its arguments differently) keeps ``CompiledKernel.run``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
from triton import knobs  # triton >= 3.4 (3.6 and 3.9 alike): the launch hooks
from triton.compiler.compiler import CompiledKernel

from flashrun.kernels.tuning import INTERPRETED, LaunchConfig

log = logging.getLogger("flashrun.launch")

_LAUNCH_METADATA = CompiledKernel.launch_metadata  # Triton's own, as imported
_TENSOR = torch.Tensor  # a module global: a launch's argument check, without the attribute lookup


def _hooked() -> bool:
    """Whether something watches launches and so wants Triton's own launch path: a launch hook (a
    profiler such as Proton), or a wrapped ``CompiledKernel.launch_metadata`` (``bench
    --metrics``' recorder, :func:`flashrun.harness.probe.launches`, which a direct launch skips:
    round 7's H200 metrics listed no kernels for flash's decode rows)."""
    hook = knobs.runtime.launch_enter_hook
    return (hook is not None and bool(getattr(hook, "calls", True))) or CompiledKernel.launch_metadata is not _LAUNCH_METADATA


class _Launch:
    """One kernel at one grid with every argument after the per-call ones fixed (``tail``, in the
    kernel's parameter order, constexprs included). The first call goes through Triton
    (``kernel[grid]``: specializes, compiles, launches) and on a GPU keeps the CompiledKernel;
    later calls launch it directly, tensors passed as integer pointers. The plan's key holds
    everything that specialization reads (shapes, strides, dtypes, 16-byte alignment), and the
    per-call integers are ``do_not_specialize``, so the kernel kept is the one Triton would pick."""

    __slots__ = ("kernel", "grid", "tail", "options", "compiled", "c_launch")
    direct = True  # False once a launcher refused the direct call (then for every launch)

    def __init__(self, kernel, grid: tuple[int, ...], tail: tuple, cfg: LaunchConfig | dict[str, int]) -> None:
        """``cfg``: the launch's warps and stages, or its launch options as given to Triton
        (a Gluon kernel's: warps and ``maxnreg``; other options would specialize another kernel)."""
        self.kernel, self.tail = kernel, tail
        self.grid = (*grid, 1, 1)[:3]  # the launcher takes three (a 1-D grid would shift every argument)
        self.options = dict(cfg) if isinstance(cfg, dict) else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        self.compiled = self.c_launch = None

    def __call__(self, stream: int | None, *args) -> None:
        ck = self.compiled
        if ck is not None and self.direct and not _hooked():
            try:
                if self.c_launch is not None:
                    self.c_launch(stream, args)
                else:
                    ck.run(*self.grid, stream, ck.function, ck.packed_metadata, None, None, None,
                           *[a.data_ptr() if isinstance(a, _TENSOR) else a for a in args], *self.tail)
                return
            except TypeError as exc:  # a Triton whose launcher takes other arguments: its own path from now on
                log.warning("flash launches through Triton's own path: a compiled kernel's launcher refused "
                            "the direct call (%s)", exc)
                _Launch.direct = False
        compiled = self.kernel[self.grid](*args, *self.tail, **self.options)
        if self.direct and not INTERPRETED and hasattr(compiled, "packed_metadata"):
            self.compiled = compiled
            self.c_launch = _CLaunch.of(compiled, self.grid, self.tail)


class _CLaunch:
    """Triton 3.6's C launch of one compiled kernel at one grid, under its ``CudaLauncher``
    (``triton/backends/nvidia/driver.py``: ``__call__`` allocates no scratch for these kernels,
    then ``wrap_handle_tensordesc`` expands each tensor descriptor argument into its CUtensorMap,
    shape and strides and calls the C ``launch``). Here the expansion of each descriptor
    argument is Triton's own ``make_tensordesc_arg``, kept per base pointer (a plan's descriptors
    differ from call to call in their base alone)."""

    __slots__ = ("launch", "grid", "fixed", "tail", "expanders")
    POINTERS = 256  # expansions kept per descriptor argument (a model's layers each have their own tensors)

    def __init__(self, launch, grid: tuple, fixed: tuple, tail: tuple, expanders: dict[int, Any]) -> None:
        self.launch, self.grid, self.fixed, self.tail, self.expanders = launch, grid, fixed, tail, expanders

    @classmethod
    def of(cls, ck: CompiledKernel, grid: tuple[int, int, int], tail: tuple) -> _CLaunch | None:
        """The C launch of ``ck``, or None where its launcher is not Triton 3.6's as described above
        (then ``CompiledKernel.run`` launches)."""
        run = ck.run
        try:
            params = list(inspect.signature(type(run).__call__).parameters)
        except (TypeError, ValueError):
            return None
        if (type(run).__name__ != "CudaLauncher" or params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
                or run.global_scratch_size or run.profile_scratch_size or run.num_ctas != 1):
            return None
        launch, expanders = run.launch, {}
        if getattr(launch, "__closure__", None) is not None:  # wrap_handle_tensordesc's inner: descriptor arguments
            cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__)))
            metas = cells.get("tensordesc_meta")
            if (set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or not metas
                    or any(meta is None for meta in metas)):  # (no TMA: the expansion would hold the tensor)
                return None
            expand = getattr(sys.modules[type(run).__module__], "make_tensordesc_arg", None)
            if expand is None:
                return None
            launch = cells["launcher"]
            expanders = {index: _Expander(expand, meta) for index, meta in zip(sorted(cells["tensordesc_indices"]), metas)}
        # after the stream: the function, cooperative grid, PDL, the two scratch buffers (none), the
        # kernel's metadata, the launch metadata and the enter and exit hooks (none)
        fixed = (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None, ck.packed_metadata, None, None, None)
        return cls(launch, grid, fixed, tail, expanders)

    def __call__(self, stream: int | None, args: tuple) -> None:
        if not self.expanders:  # (no descriptor arguments: decode's kernels)
            self.launch(*self.grid, stream, *self.fixed, *[a.data_ptr() if isinstance(a, _TENSOR) else a for a in args],
                        *self.tail)
            return
        expanded = []
        for index, arg in enumerate(args):
            if index in self.expanders:
                expanded += self.expanders[index](arg)
            else:
                expanded.append(arg.data_ptr() if isinstance(arg, _TENSOR) else arg)
        self.launch(*self.grid, stream, *self.fixed, *expanded, *self.tail)


class _Expander:
    """One descriptor argument of a :class:`_CLaunch`: Triton's expansion (CUtensorMap, shape,
    strides) per base pointer. (An absent optional descriptor, None, is a constexpr to Triton,
    not a descriptor argument.)"""

    __slots__ = ("expand", "meta", "kept")

    def __init__(self, expand, meta: dict) -> None:
        self.expand, self.meta, self.kept = expand, meta, {}

    def __call__(self, descriptor: Any) -> list:
        pointer = descriptor.base.data_ptr()
        expansion = self.kept.get(pointer)
        if expansion is None:
            if len(self.kept) >= _CLaunch.POINTERS:
                del self.kept[next(iter(self.kept))]
            expansion = self.kept[pointer] = self.expand(descriptor, self.meta)
        return expansion


_stream_of = None  # Triton's own current-stream getter (the raw CUstream), bound on first use


def _current_stream(device: torch.device) -> int | None:
    global _stream_of
    if INTERPRETED:
        return None
    if _stream_of is None:
        from triton.runtime import driver

        _stream_of = driver.active.get_current_stream
    return _stream_of(device.index)


# -- plans and their keys -----------------------------------------------------------------------
PLANS = 512  # plans a cache keeps (the oldest dropped)


def keep(plans: dict, key: tuple, plan: Any) -> Any:
    """``plan`` kept in ``plans`` under ``key`` (at most PLANS of them: the oldest goes)."""
    if len(plans) >= PLANS:
        del plans[next(iter(plans))]
    plans[key] = plan
    return plan

def _meta(t: torch.Tensor | None) -> tuple | None:
    """What a plan depends on in a tensor argument: its layout, type, place, and the 16-byte
    alignment Triton specializes a pointer on."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def template(descriptor: Any) -> Any:
    """A TMA descriptor (Triton's or Gluon's ``TensorDescriptor``) made by a plan's first call,
    kept without its tensor (a plan must not hold a model's activations alive): what
    :func:`rebased` copies."""
    return None if descriptor is None else rebased(descriptor, None)


def rebased(template: Any, base: torch.Tensor) -> Any:
    """``template`` over ``base``: a tensor of the layout the template was made for (the plan's key
    holds shape, strides, dtype and 16-byte alignment: everything the descriptor's constructor
    checks, so the copy skips the checks - ~3 us of Python per descriptor on the H200's host)."""
    descriptor = object.__new__(type(template))
    descriptor.__dict__.update(template.__dict__, base=base)
    return descriptor


def _hashable(x: Any) -> Any:
    """An argument as part of a plan's key (a bad value only has to fail its check, once)."""
    if isinstance(x, (tuple, list)):
        return tuple(_hashable(v) for v in x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x
