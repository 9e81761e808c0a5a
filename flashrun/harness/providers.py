"""Attention providers for ``flashrun bench``, by exact name.

A :class:`Provider` prepares, for one :class:`~flashrun.harness.shapes.Shape`, an :class:`Attention`:
a function ``fn(q, k, v) -> out`` in the (batch, heads, seq, head_dim) layout, with k/v
possibly holding fewer heads (GQA), plus a ``scope`` entered around checking and timing (the
forced SDPA backend). Everything that can be built once per shape (masks, block masks,
compiled callables) is built in ``prepare``, outside the timed region.

A provider that cannot serve a shape raises :class:`~flashrun.errors.KernelError` from
``prepare``; a backend that refuses a shape at call time raises whatever it raises, and the
bench turns both into an ``n/a`` cell with the reason (see :func:`failure_reason`).

Semantics shared with the reference: ``sm_scale = 1/sqrt(head_dim)``; causal with Nq != Nk
is bottom-right aligned (query i sees keys j <= i + Nk - Nq).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from flashrun.errors import InputError, KernelError
from flashrun.harness.reference import causal_mask, expand_kv
from flashrun.harness.shapes import Shape
from flashrun.limits import BUILTIN_KERNELS

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

KERNELS = BUILTIN_KERNELS  # flash-deterministic: flash with the atomic-free backward
# SDPA providers and the backend each one forces (None: PyTorch's own dispatch).
SDPA = {
    "sdpa": None,
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
NAMES = (*KERNELS, "torch-naive", *SDPA, "flex", "flash-attn")
# What a `--device cpu` run times: plain PyTorch only. Triton kernels would run through the
# interpreter, whose timings mean nothing.
CPU_PROVIDERS = ("torch-naive", "sdpa", "sdpa-math")
# Materializing the (B, H, Nq, Nk) scores beyond this on the CPU risks the OOM killer, which
# would take the whole run (and the rows already measured) with it.
CPU_SCORES_LIMIT_BYTES = 2 << 30

_KERNEL_SPEC = re.compile(r".+\.py:[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Attention:
    fn: AttnFn
    scope: Callable[[], ContextManager] = contextlib.nullcontext
    note: str = ""  # said in the results (e.g. how causal was expressed)


@dataclass(frozen=True)
class Provider:
    name: str
    prepare: Callable[[Shape, torch.device], Attention] = field(repr=False)
    backward: bool = True  # False: bwd and fwd_bwd cells are n/a
    is_kernel: bool = False  # one of ours (or the user's), as opposed to a PyTorch baseline


def is_kernel_spec(name: str) -> bool:
    return name in KERNELS or bool(_KERNEL_SPEC.fullmatch(name))


def check_names(names: list[str]) -> None:
    """Refuse unknown provider names before anything runs."""
    for name in names:
        if name in NAMES or is_kernel_spec(name):
            continue
        close = difflib.get_close_matches(name, NAMES, n=1)
        raise InputError(
            f"unknown provider {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            hint=f"providers: {', '.join(NAMES)}, or PATH.py:FUNCTION for your own kernel",
        )


def resolve(name: str, device: torch.device) -> Provider:
    """The provider called ``name`` on ``device`` ("cuda" or "cpu").

    On the CPU only :data:`CPU_PROVIDERS` are timed; the others come back as providers whose
    every cell is n/a with the reason. A kernel that cannot be loaded raises KernelError:
    a wrong path or function is the user's mistake, reported before any timing.
    """
    check_names([name])
    if device.type == "cpu" and name not in CPU_PROVIDERS:
        reason = ("Triton kernels are not timed on the CPU: the interpreter's timings mean nothing"
                  if is_kernel_spec(name) else
                  f"not timed on the CPU (a --device cpu run times only {', '.join(CPU_PROVIDERS)})")
        return Provider(name, _refuse(reason), is_kernel=is_kernel_spec(name))
    if is_kernel_spec(name):
        return _kernel(name)
    if name == "torch-naive":
        return Provider(name, _naive)
    if name in SDPA:
        return Provider(name, functools.partial(_sdpa, name))
    if name == "flex":
        return Provider(name, _flex_preparer())
    return Provider(name, _flash_attn)  # the one name left: flash-attn


def _refuse(reason: str) -> Callable[[Shape, torch.device], Attention]:
    def prepare(shape: Shape, device: torch.device) -> Attention:
        raise KernelError(reason)

    return prepare


# -- ours: flashrun.kernels ---------------------------------------------------------------------
def _kernel(spec: str) -> Provider:
    try:
        from flashrun import (
            kernels,  # after device.select: Triton reads TRITON_INTERPRET at import
        )
    except ImportError as exc:
        raise KernelError(f"cannot import flashrun.kernels: {exc}",
                          hint="`flashrun check-env` checks the install") from None
    kernel = kernels.get(spec)

    def prepare(shape: Shape, device: torch.device) -> Attention:
        return Attention(lambda q, k, v: kernel(q, k, v, causal=shape.causal))

    return Provider(spec, prepare, backward=kernel.supports_backward, is_kernel=True)


# -- torch-naive: scores materialized -------------------------------------------------------------
def _check_cpu_scores(shape: Shape, device: torch.device, itemsize: int) -> None:
    size = shape.batch_size * shape.num_heads * shape.seq_len * shape.seq_len_k * itemsize
    if device.type == "cpu" and size > CPU_SCORES_LIMIT_BYTES:
        raise KernelError(f"the scores would take {size / 2**30:.1f} GiB: too large for a CPU run")


def _naive(shape: Shape, device: torch.device) -> Attention:
    _check_cpu_scores(shape, device, getattr(torch, shape.dtype).itemsize)
    scale = 1.0 / math.sqrt(shape.head_dim)
    hidden = ~causal_mask(shape.seq_len, shape.seq_len_k, device) if shape.causal else None  # once per shape

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    return Attention(fn)


# -- PyTorch SDPA, one backend forced -------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sdpa_has_gqa() -> bool:
    """``enable_gqa`` arrived in torch 2.5; SDPA is a builtin, so try it rather than inspect it."""
    t = torch.zeros(1, 2, 1, 8)
    try:
        F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def _sdpa_causal(shape: Shape) -> tuple[bool, object | None, str]:
    """(is_causal, attn_mask, note) expressing bottom-right causal attention for SDPA.

    SDPA's ``is_causal`` is top-left aligned, which equals bottom-right only when Nq == Nk.
    One query against Nk keys sees every key, so that is plain full attention. Otherwise a
    lower-right CausalBias: the flash and efficient backends take it natively; the others
    get it as a materialized mask.
    """
    if not shape.causal or shape.seq_len == 1:
        return False, None, ""
    if shape.seq_len == shape.seq_len_k:
        return True, None, ""
    from torch.nn.attention.bias import causal_lower_right

    return False, causal_lower_right(shape.seq_len, shape.seq_len_k), "bottom-right causal as a CausalBias"


def _sdpa(name: str, shape: Shape, device: torch.device) -> Attention:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend_name = SDPA[name]
    if name == "sdpa-math":
        _check_cpu_scores(shape, device, 4)  # the math backend materializes float32 scores
    if backend_name is not None and not hasattr(SDPBackend, backend_name):
        needs = "; cuDNN attention needs torch>=2.5 with cuDNN 9 on sm80+" if name == "sdpa-cudnn" else ""
        raise KernelError(f"this torch ({torch.__version__}) has no SDPA {backend_name} backend{needs}")
    is_causal, mask, note = _sdpa_causal(shape)
    gqa = shape.num_kv_heads != shape.num_heads
    native_gqa = gqa and _sdpa_has_gqa()
    kwargs = {"enable_gqa": True} if native_gqa else {}
    if gqa and not native_gqa:
        note = "; ".join(filter(None, [note, "k/v expanded for GQA (torch without enable_gqa)"]))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if gqa and not native_gqa:
            k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)

    if backend_name is None:
        return Attention(fn, note=note)
    backend = getattr(SDPBackend, backend_name)
    return Attention(fn, scope=lambda: sdpa_kernel([backend]), note=note)


# -- FlexAttention ----------------------------------------------------------------------------------
def _flex_preparer() -> Callable[[Shape, torch.device], Attention]:
    """FlexAttention through one ``torch.compile(dynamic=False)`` wrapper, created on first use.

    Dynamo keys its cache on the function's code, so every shape adds one entry to the same
    cache; ``bench`` raises the recompile limit for the sweep (:func:`compile_settings`), else
    the 9th shape would silently fall back to slow eager FlexAttention. Each shape compiles
    exactly once because the sweep is shape-major and its block mask is built once.
    """
    compiled: list[Callable] = []

    def prepare(shape: Shape, device: torch.device) -> Attention:
        try:
            from torch.nn.attention.flex_attention import (
                create_block_mask,
                flex_attention,
            )
        except ImportError:
            raise KernelError(f"FlexAttention needs torch>=2.5 (this is {torch.__version__})") from None
        if not compiled:
            compiled.append(torch.compile(flex_attention, dynamic=False))
        flex = compiled[0]
        block_mask = None
        if shape.causal:
            offset = shape.seq_len_k - shape.seq_len  # bottom-right alignment

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(mask_mod, None, None, shape.seq_len, shape.seq_len_k, device=device)
        gqa = shape.num_kv_heads != shape.num_heads
        native_gqa = gqa and "enable_gqa" in inspect.signature(flex_attention).parameters
        kwargs = {"enable_gqa": True} if native_gqa else {}

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if gqa and not native_gqa:
                k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
            return flex(q, k, v, block_mask=block_mask, **kwargs)

        return Attention(fn, note="" if native_gqa or not gqa else "k/v expanded for GQA")

    return prepare


def compile_settings(n_shapes: int) -> ContextManager:
    """Settings for FlexAttention (the one compiled provider) over a sweep of ``n_shapes``:

    * dynamo keeps one compiled FlexAttention per shape (see _flex_preparer);
    * compiled backward graphs stay re-runnable: bench times the backward alone, repeatedly on
      one graph (``retain_graph=True``), which AOTAutograd's donated buffers forbid (seen on
      the H200 with torch 2.11: "compiled with non-empty donated buffers").
    """
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    limit = 2 * n_shapes + 8  # one entry per shape; twice that leaves room for guard variants
    patch = {}
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(dynamo_config, n)), None)
        if name is not None and getattr(dynamo_config, name) < limit:
            patch[name] = limit
    stack = contextlib.ExitStack()
    if patch:
        stack.enter_context(dynamo_config.patch(**patch))
    if getattr(functorch_config, "donated_buffer", False):
        stack.enter_context(functorch_config.patch(donated_buffer=False))
    return stack


# -- flash-attn (Tri Dao's package) ---------------------------------------------------------------
def _flash_attn(shape: Shape, device: torch.device) -> Attention:
    try:
        from flash_attn import flash_attn_func
    except ImportError as exc:
        if exc.name == "flash_attn":
            raise KernelError("flash-attn not installed (pip install flash-attn)") from None
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None
    except OSError as exc:  # a compiled extension built for another torch or CUDA
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash-attn wants (B, N, H, D); transposed views cost nothing (it needs only the last
        # dimension contiguous). It takes GQA and bottom-right causal natively.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=shape.causal)
        return out.transpose(1, 2)

    return Attention(fn)


# -- why a call failed -------------------------------------------------------------------------------
_REFUSED = ("No available kernel", "No viable backend")
_SDPA_LABEL = {"sdpa": "default", "sdpa-flash": "flash", "sdpa-cudnn": "cuDNN",
               "sdpa-efficient": "memory-efficient", "sdpa-math": "math"}


def failure_reason(name: str, exc: BaseException, caught: list[warnings.WarningMessage]) -> str:
    """One line saying why ``name`` failed. SDPA explains a refusal only through warnings
    ("Flash attention kernel not used because: ..."), so those are folded in."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if name in SDPA and any(marker in text for marker in _REFUSED):
        details = []
        for message in caught:
            line = re.sub(r"\s*\(Triggered internally at .*", "", str(message.message), flags=re.S).strip()
            if line and not line.endswith("because:") and line not in details:
                details.append(line)
        why = f": {'; '.join(details)}" if details else ""
        return _shorten(f"SDPA {_SDPA_LABEL[name]} backend refused this case{why}")
    return _shorten(f"{type(exc).__name__}: {text}")


def _shorten(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
