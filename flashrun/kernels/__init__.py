"""Attention kernels and their registry.

``get("flash")`` (its backward as ``deterministic`` says, by default the faster per call:
:data:`flashrun.limits.DETERMINISTIC_BACKWARD`; ``launch`` as :func:`flashrun.kernels.tuning.choose` takes it),
``get("flash-deterministic")`` (always), ``get("flash-atomic")`` (the 5-matmul backward that sums
dQ with atomics), ``get("minimal")`` or ``get("experiments/my_attn.py:attention")`` returns a
:class:`Kernel` called as ``kernel(q, k, v, causal=False, sm_scale=None) -> o``.

A user's function may take ``(q, k, v)`` - the article's signature, accepted as is; it is then
judged against the case's causal flag and the default ``1/sqrt(head_dim)`` scale - or
``(q, k, v, causal, sm_scale)`` (positional or keyword).

FlashAttention-2's variant arguments (:data:`VARIANT_ARGS`: ``window``, ``softcap``,
``alibi_slopes``, and for packed sequences ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k``) reach a kernel as keyword arguments, and only those its function accepts
(:attr:`Kernel.accepts`, read off the signature; ``**kwargs`` accepts all). A case that needs an
argument the kernel does not accept is not run (:meth:`Kernel.missing`). ``flash`` takes them
all and routes packed inputs to :func:`flash_attention_varlen`; ``minimal`` takes none.

A KV-cache case calls the kernel as ``kernel(q, k_cache, v_cache, causal, sm_scale,
cache_seqlens=..., [block_table=...], [k_new=..., v_new=...], [k_scale=..., v_scale=...])`` in
FlashAttention's (batch, seq, heads, head_dim) layout (:func:`flash_attention_with_kvcache`'s
arguments, an fp8 cache's scales among them; the new keys and values are ``k_new``/``v_new``
here, as ``k``/``v`` are the caches). ``flash`` routes it to :func:`flash_attention_with_kvcache`.

An e4m3 case calls it as ``kernel(q8, k8, v8, causal, sm_scale, q_descale=..., k_descale=...,
v_descale=...)``: float8_e4m3fn tensors standing for ``x8 · descale`` (float32 (B, H_kv)
descales, FlashAttention-3's names), a bf16 output expected. ``flash`` routes it to
:func:`flash_attention_fp8`.

Import this package only after :func:`flashrun.device.select`: Triton decides between
compiling and interpreting when the kernels are defined.

Comments here cite the measurements behind a choice as "NOTES vN": section vN of the lab notebook
``benchmarks/NOTES.md``, kept in git at the tag ``lab-notebook-final``
(``git show lab-notebook-final:benchmarks/NOTES.md``); ``docs/design/`` has the condensed story.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from flashrun.errors import ArgumentError, KernelError
from flashrun.kernels.flash import (
    alibi_slopes,
    attention_forward,
    attention_forward_varlen,
    flash_attention,
    flash_attention_fp8,
    flash_attention_varlen,
    flash_attention_with_kvcache,
    hopper,
    hopper_bwd,
    quantize_qkv,
)
from flashrun.kernels import tuning, warmup
from flashrun.kernels.minimal import minimal_attention
from flashrun.kernels.tuning import Launch, LaunchConfig
from flashrun.limits import BUILTIN_KERNELS, DETERMINISTIC_BACKWARD

warmup.prime()  # Triton hashes its own installation before its first compile: start that now

__all__ = ["VARIANT_ARGS", "Kernel", "LaunchConfig", "alibi_slopes", "attention_forward", "attention_forward_varlen",
           "flash_attention", "flash_attention_fp8", "flash_attention_varlen", "flash_attention_with_kvcache", "get",
           "minimal_attention", "quantize_qkv"]

BUILTIN = BUILTIN_KERNELS
# Keyword arguments a case may pass beyond (q, k, v, causal, sm_scale), FlashAttention-2's names.
VARIANT_ARGS = ("window", "softcap", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                "cache_seqlens", "block_table", "k_new", "v_new", "k_scale", "v_scale",
                "q_descale", "k_descale", "v_descale")
# Of those, the ones a kernel may go without: the longest lengths are read off cu_seqlens otherwise.
OPTIONAL_ARGS = ("max_seqlen_q", "max_seqlen_k")


@dataclass(frozen=True)
class Kernel:
    name: str
    fn: Callable[..., torch.Tensor] = field(repr=False)
    supports_backward: bool  # False: forward only (users' kernels: decided by trying autograd)
    takes_causal: bool = True  # False for the (q, k, v) signature
    accepts: frozenset[str] = frozenset()  # the VARIANT_ARGS its function takes
    # which of its implementations the last call's forward ran (flash: "gluon-sm90" or "triton"),
    # and its backward (flash: "gluon-sm90+dq", "gluon-sm90" (dK/dV) or "triton"); None for kernels with one
    path: Callable[[], str | None] | None = None
    backward_path: Callable[[], str | None] | None = None
    # the launch config each of its Triton kernels ran with since the last time this was asked,
    # and where it came from (flash: tuning.chosen(), e.g. {"fwd": {"config": "128x64 w4 s3",
    # "source": "table"}}); None: not said
    configs: Callable[[], dict[str, dict[str, str]]] | None = None

    def missing(self, variant_args: dict) -> list[str]:
        """The arguments a case needs (``variant_args``) that this kernel does not take."""
        return [name for name in variant_args if name not in self.accepts and name not in OPTIONAL_ARGS]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 sm_scale: float | None = None, **variant_args) -> torch.Tensor:
        passed = {name: value for name, value in variant_args.items() if name in self.accepts}
        if self.takes_causal:
            return self.fn(q, k, v, causal=causal, sm_scale=sm_scale, **passed)
        return self.fn(q, k, v, **passed)


def get(spec: str, launch: Launch = None, deterministic: bool | None = DETERMINISTIC_BACKWARD) -> Kernel:
    """Resolve a kernel name or ``PATH.py:FUNCTION``. ``launch``: how flash picks its launch config;
    ``deterministic``: flash's atomic-free backward (``flash-deterministic`` always runs it,
    ``flash-atomic`` never; None: the faster per call, see flashrun.limits)."""
    if spec in ("flash", "flash-deterministic", "flash-atomic"):
        deterministic = {"flash": deterministic, "flash-deterministic": True, "flash-atomic": False}[spec]

        def flash(q, k, v, causal=False, sm_scale=None, *, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, cache_seqlens=None,
                  block_table=None, k_new=None, v_new=None, k_scale=None, v_scale=None, q_descale=None, k_descale=None,
                  v_descale=None):
            if q.dtype == torch.float8_e4m3fn:  # e4m3 q, k, v: the fp8 forward (dense; bf16 out)
                if softcap or alibi_slopes is not None or cu_seqlens_q is not None or cache_seqlens is not None:
                    raise ArgumentError("the fp8 forward runs dense attention (causal, window, GQA): no softcap, "
                                        "ALiBi, packed sequences or KV cache")
                return flash_attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal=causal, sm_scale=sm_scale,
                                           window=window)
            if cache_seqlens is not None:  # a KV cache, (batch, seq, heads, head_dim)
                return flash_attention_with_kvcache(q, k, v, cache_seqlens, k=k_new, v=v_new, block_table=block_table,
                                                    causal=causal, window=window, softcap=softcap,
                                                    alibi_slopes=alibi_slopes, sm_scale=sm_scale, k_scale=k_scale,
                                                    v_scale=v_scale)
            if cu_seqlens_q is not None:  # packed (total, heads, head_dim)
                return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                              sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                              launch=launch, deterministic=deterministic)
            return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, launch=launch, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
        return Kernel(spec, flash, supports_backward=True, accepts=frozenset(VARIANT_ARGS),
                      path=lambda: hopper.LAST_PATH, backward_path=lambda: hopper_bwd.LAST_PATH,
                      configs=tuning.chosen)
    if spec == "minimal":
        return Kernel("minimal", minimal_attention, supports_backward=False)
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not func:
        raise KernelError(
            f"unknown kernel {spec!r}",
            hint=f"use one of {', '.join(BUILTIN)}, or PATH.py:FUNCTION for your own (e.g. experiments/my_attention.py:attention)",
        )
    return _load_user_kernel(Path(path), func, spec)


def _load_user_kernel(path: Path, func: str, spec: str) -> Kernel:
    if not path.is_file():
        raise KernelError(f"kernel file {path} not found", hint="paths in a config are relative to the config's folder")
    module_name = f"flashrun_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise KernelError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # Triton's @jit reads the module's source and globals
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise KernelError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any failure in the user's file becomes one message
        sys.modules.pop(module_name, None)
        raise KernelError(f"importing {path} failed at {_where(exc, path)}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise KernelError(
            f"{path} has no function {func!r}",
            hint=f"functions there: {', '.join(found) or 'none'}",
        )
    return Kernel(f"{path.name}:{func}", fn, supports_backward=True, takes_causal=_takes_causal(fn, spec),
                  accepts=_accepts(fn))


def _where(exc: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f"line {frames[-1].lineno}" if frames else str(path)


def _takes_causal(fn: Callable, spec: str) -> bool:
    """True for (q, k, v, causal, sm_scale), False for (q, k, v); anything else is an error."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise KernelError(f"cannot read the signature of {spec}") from None
    names = list(params)
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    extra = {p.name for p in required[3:]} - {"causal", "sm_scale"}  # required beyond the contract
    if {"causal", "sm_scale"} <= set(names) and len(positional) >= 3 and not extra:
        return True
    if len(positional) >= 3 and len(required) <= 3 and not {"causal", "sm_scale"} & set(names):
        return False
    raise KernelError(
        f"{spec} has signature {inspect.signature(fn)}",
        hint="a kernel takes (q, k, v) or (q, k, v, causal, sm_scale); variant arguments (window, softcap, "
             "alibi_slopes, cu_seqlens_q, ...) need defaults",
    )


def _accepts(fn: Callable) -> frozenset[str]:
    """The variant arguments ``fn`` takes by name (all of them with ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return frozenset(VARIANT_ARGS)
    return frozenset(name for name, p in params.items() if name in VARIANT_ARGS and p.kind is not p.POSITIONAL_ONLY)
