"""The registry of ``flashrun bench``'s attention providers, by exact name.

A :class:`~flashrun.harness.provider.Provider` prepares, for one
:class:`~flashrun.harness.shapes.Shape`, an :class:`~flashrun.harness.provider.Attention`: a
function ``fn(q, k, v) -> out`` in the (batch, heads, seq, head_dim) layout, with k/v possibly
holding fewer heads (GQA), plus a ``scope`` entered around checking and timing (the forced SDPA
backend). Everything that can be built once per shape (masks, block masks,
compiled callables) is built in ``prepare``, outside the timed region.

A provider that cannot serve a shape raises :class:`~flashrun.errors.KernelError` from
``prepare``; a backend that refuses a shape at call time raises whatever it raises, and the
bench turns both into an ``n/a`` cell with the reason (see :func:`failure_reason`).

Semantics shared with the reference: ``sm_scale = 1/sqrt(head_dim)``; causal with Nq != Nk
is bottom-right aligned (query i sees keys j <= i + Nk - Nq).

Variant shapes (window, softcap, ALiBi, packed sequences; see :mod:`~flashrun.harness.shapes`)
get the same inputs as verify: packed ones ``(total, heads, head_dim)``. Who runs what:

  * ``flash``, ``flash-attn`` and ``flex``: every variant (flash and flash-attn natively, flex
    through ``score_mod`` for softcap/ALiBi and a ``block_mask`` for the window, the causal mask
    and, packed, the sequences as documents of one long sequence);
  * ``flash-fp8`` (flashrun's e4m3 forward, bf16 shapes): plain, causal and windowed attention;
  * ``cudnn-fp8`` (cuDNN's e4m3 forward through ``nvidia-cudnn-frontend``, bf16 shapes): plain and
    causal attention (:mod:`~flashrun.harness.cudnn_fp8`);
  * ``torch-naive``: every variant (the scores are materialized anyway);
  * ``sdpa``, ``sdpa-math``, ``sdpa-efficient``: window, ALiBi and packing as one explicit
    float mask (-inf outside, the ALiBi bias inside; packed: block-diagonal over the packed
    sequence); not softcap, which transforms the scores and no additive mask can express;
  * ``sdpa-flash``, ``sdpa-cudnn``: no variant (these backends refuse an explicit mask);
  * a user's kernel: the variants its signature takes (:meth:`flashrun.kernels.Kernel.missing`).

KV-cache shapes (``cache_seqlens``): :mod:`~flashrun.harness.kvcache` says who reads the cache
and who runs on it gathered. ``NAME+graph`` (any name above) replays NAME's forward from a CUDA
graph (:mod:`~flashrun.harness.graphs`); the row's provider says which ran.

What a provider cannot run is ``n/a`` with the reason.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
import warnings
from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from flashrun.errors import InputError, KernelError
from flashrun.harness import graphs, kvcache
from flashrun.harness.inputs import Inputs, slopes
from flashrun.harness.provider import Attention, Provider, sequences, unpacked, variant_args
from flashrun.harness.reference import alibi_bias, allowed, causal_mask, expand_kv
from flashrun.harness.shapes import Shape
from flashrun.limits import BUILTIN_KERNELS, FP8_PROVIDERS

KERNELS = BUILTIN_KERNELS  # flash (the faster backward per call), flash-deterministic, flash-atomic
# SDPA providers and the backend each one forces (None: PyTorch's own dispatch).
SDPA = {
    "sdpa": None,
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
NAMES = (*KERNELS, *FP8_PROVIDERS, "torch-naive", *SDPA, "flex", "flash-attn")
# What a `--device cpu` run times: plain PyTorch only. Triton kernels would run through the
# interpreter, whose timings mean nothing.
CPU_PROVIDERS = ("torch-naive", "sdpa", "sdpa-math")
# Materializing the (B, H, Nq, Nk) scores beyond this on the CPU risks the OOM killer, which
# would take the whole run (and the rows already measured) with it.
CPU_SCORES_LIMIT_BYTES = 2 << 30

_KERNEL_SPEC = re.compile(r".+\.py:[A-Za-z_][A-Za-z0-9_]*")


def is_kernel_spec(name: str) -> bool:
    return name in KERNELS or bool(_KERNEL_SPEC.fullmatch(name))


def check_names(names: list[str]) -> None:
    """Refuse unknown provider names before anything runs."""
    for name in names:
        base = name.removesuffix(graphs.SUFFIX)
        if base in NAMES or is_kernel_spec(base):
            continue
        close = difflib.get_close_matches(name, NAMES, n=1)
        raise InputError(
            f"unknown provider {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            hint=f"providers: {', '.join(NAMES)}, or PATH.py:FUNCTION for your own kernel; NAME{graphs.SUFFIX} "
                 "replays NAME's forward from a CUDA graph",
        )


def resolve(name: str, device: torch.device) -> Provider:
    """The provider called ``name`` on ``device`` ("cuda" or "cpu").

    On the CPU only :data:`CPU_PROVIDERS` are timed; the others come back as providers whose
    every cell is n/a with the reason. A kernel that cannot be loaded raises KernelError:
    a wrong path or function is the user's mistake, reported before any timing.
    """
    check_names([name])
    if name.endswith(graphs.SUFFIX):
        base = resolve(name.removesuffix(graphs.SUFFIX), device)
        return graphs.graphed(base) if device.type == "cuda" else Provider(name, _refuse(
            "CUDA graphs need a CUDA GPU"), is_kernel=base.is_kernel)
    if device.type == "cpu" and name not in CPU_PROVIDERS:
        reason = ("Triton kernels are not timed on the CPU: the interpreter's timings mean nothing"
                  if is_kernel_spec(name) or name == "flash-fp8" else
                  f"not timed on the CPU (a --device cpu run times only {', '.join(CPU_PROVIDERS)})")
        return Provider(name, _refuse(reason), is_kernel=is_kernel_spec(name) or name == "flash-fp8")
    if is_kernel_spec(name):
        return _kernel(name)
    if name == "flash-fp8":
        return Provider(name, _flash_fp8, backward=False, is_kernel=True, fp8=True)
    if name == "cudnn-fp8":
        from flashrun.harness import cudnn_fp8

        return Provider(name, cudnn_fp8.prepare, backward=False, fp8=True)
    if name == "torch-naive":
        return Provider(name, _dense_only(_naive))
    if name in SDPA:
        return Provider(name, _dense_only(functools.partial(_sdpa, name)))
    if name == "flex":
        from flashrun.harness import flex

        return Provider(name, flex.preparer())
    return Provider(name, _flash_attn)  # the one name left: flash-attn


def _dense_only(prepare: Callable[[Shape, torch.device], Attention]) -> Callable[[Shape, torch.device], Attention]:
    """A provider that reads no KV cache: it runs a KV-cache shape on the gathered cache."""
    cached = kvcache.gathered(prepare)
    return lambda shape, device: cached(shape, device) if shape.kvcache else prepare(shape, device)


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
        args = variant_args(shape, device)
        missing = kernel.missing({**args, **dict.fromkeys(("k_scale", "v_scale") if shape.kv_scale else ())})
        if missing:
            raise KernelError(f"{kernel.name} does not take {', '.join(missing)}, which this shape needs")
        return Attention(lambda q, k, v, **per_set: kernel(q, k, v, causal=shape.causal, **args, **per_set),
                         path=kernel.path, backward_path=kernel.backward_path, configs=kernel.configs)

    return Provider(spec, prepare, backward=kernel.supports_backward, is_kernel=True)


# -- flash-fp8: ours in e4m3 ----------------------------------------------------------------------------
def _flash_fp8(shape: Shape, device: torch.device) -> Attention:
    """flash_attention_fp8 on the shape's bf16 inputs quantized by quantize_qkv (descales per batch
    and kv head), once per input set and outside the timing; judged by FlashAttention-3's rule
    against the dequantized inputs (:class:`~flashrun.harness.judge.Reference` with ``fp8``)."""
    from flashrun import kernels  # after device.select: Triton reads TRITON_INTERPRET at import
    from flashrun.harness.judge import Reference

    if shape.dtype != "bfloat16":
        raise KernelError("flash-fp8 writes bf16: time it on bfloat16 shapes (--dtype bf16)")
    if shape.softcap or shape.alibi or shape.varlen or shape.kvcache:
        raise KernelError(f"flash-fp8 runs plain, causal and windowed attention, not {shape.variant_label}")
    quantized: dict[int, tuple] = {}

    def inputs_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        if q.data_ptr() not in quantized:
            with torch.no_grad():
                quantized[q.data_ptr()] = kernels.quantize_qkv(q, k, v)
        return quantized[q.data_ptr()]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernels.flash_attention_fp8(*inputs_of(q, k, v), causal=shape.causal, window=shape.window)

    def reference(inputs: Inputs) -> Reference:
        q8, k8, v8, *descales = inputs_of(inputs.q, inputs.k, inputs.v)
        held = replace(inputs, q=q8, k=k8, v=v8, descales=tuple(descales))
        return Reference.for_shape(held, shape, grads=False, edges=True)

    return Attention(fn, note="e4m3 inputs quantized once per input set, outside the timing; bf16 out",
                     reference=reference)


# -- torch-naive: scores materialized -------------------------------------------------------------
def _score_elements(shape: Shape) -> int:
    """Elements of the materialized (B, H, Nq, Nk) scores; packed: (1, H, total_q, total_k)."""
    if shape.seqlens is not None:
        return shape.num_heads * sum(shape.seqlens) * sum(shape.key_lengths)
    return shape.batch_size * shape.num_heads * shape.seq_len * shape.seq_len_k


def _check_cpu_scores(shape: Shape, device: torch.device, itemsize: int) -> None:
    size = _score_elements(shape) * itemsize
    if device.type == "cpu" and size > CPU_SCORES_LIMIT_BYTES:
        raise KernelError(f"the scores would take {size / 2**30:.1f} GiB: too large for a CPU run")


def _variant_mask(shape: Shape, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(keep, bias)`` over the (packed) scores, made with the reference's own mask and bias:
    ``keep`` bool ``(Nq, Nk)`` (block-diagonal when packed; None when every pair is allowed),
    ``bias`` float32 ``(1, H, Nq, Nk)`` ALiBi (None without ALiBi)."""
    total_q = sum(n for _, n, _, _ in sequences(shape))
    total_k = sum(n for _, _, _, n in sequences(shape))
    masked = shape.causal or shape.window != (-1, -1) or shape.seqlens is not None
    keep = torch.zeros(total_q, total_k, dtype=torch.bool, device=device) if masked else None
    bias = torch.zeros(1, shape.num_heads, total_q, total_k, device=device) if shape.alibi else None
    alibi = slopes(shape, device)
    for q0, n_q, k0, n_k in sequences(shape):
        if not n_q or not n_k:
            continue
        if keep is not None:
            keep[q0:q0 + n_q, k0:k0 + n_k] = allowed(n_q, n_k, device, shape.causal, shape.window)
        if bias is not None:
            bias[:, :, q0:q0 + n_q, k0:k0 + n_k] = alibi_bias(alibi, n_q, n_k)
    return keep, bias


def _naive(shape: Shape, device: torch.device) -> Attention:
    _check_cpu_scores(shape, device, getattr(torch, shape.dtype).itemsize)
    scale = 1.0 / math.sqrt(shape.head_dim)
    if shape.plain:
        hidden = ~causal_mask(shape.seq_len, shape.seq_len_k, device) if shape.causal else None  # once per shape
        bias = None
    else:
        keep, bias = _variant_mask(shape, device)
        hidden = None if keep is None else ~keep
        bias = None if bias is None else bias.to(getattr(torch, shape.dtype))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk)
        if shape.softcap:
            scores = shape.softcap * torch.tanh(scores / shape.softcap)
        if bias is not None:
            scores = scores + bias
        if hidden is not None:  # masked_fill, not an added -inf: no gradient reaches a hidden score
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if not shape.plain:  # a window or packing can leave a query no key: its row is 0, not NaN
            probs = torch.nan_to_num(probs, nan=0.0)
        return torch.matmul(probs, v)

    return Attention(unpacked(fn, shape))


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
    if shape.softcap:
        raise KernelError("SDPA has no softcap: it transforms the scores (c·tanh(s/c)), which no additive mask "
                          "can express")
    if not shape.plain and name in ("sdpa-flash", "sdpa-cudnn"):
        raise KernelError(f"the SDPA {_SDPA_LABEL[name]} backend refuses an explicit mask, which this shape's "
                          f"{shape.variant_label} needs")
    if shape.plain:
        is_causal, mask, note = _sdpa_causal(shape)
    else:  # window, ALiBi, packing: one float mask, materialized once per shape
        _check_mask_size(shape, device)
        keep, bias = _variant_mask(shape, device)
        mask = torch.zeros(1, 1, *keep.shape, device=device) if bias is None else bias
        if keep is not None:
            mask = mask.masked_fill(~keep, float("-inf"))
        is_causal, mask = False, mask.to(getattr(torch, shape.dtype))
        note = "the window, ALiBi and packing as one explicit float mask"
    gqa = shape.num_kv_heads != shape.num_heads
    native_gqa = gqa and _sdpa_has_gqa()
    kwargs = {"enable_gqa": True} if native_gqa else {}
    if gqa and not native_gqa:
        note = "; ".join(filter(None, [note, "k/v expanded for GQA (torch without enable_gqa)"]))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if gqa and not native_gqa:
            k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)

    fn = unpacked(fn, shape)
    if backend_name is None:
        return Attention(fn, note=note)
    backend = getattr(SDPBackend, backend_name)
    return Attention(fn, scope=lambda: sdpa_kernel([backend]), note=note)


MASK_LIMIT_BYTES = 4 << 30  # an explicit mask beyond this is refused (n/a), on any device


def _check_mask_size(shape: Shape, device: torch.device) -> None:
    heads = shape.num_heads if shape.alibi else 1
    size = _score_elements(shape) // shape.num_heads * heads * getattr(torch, shape.dtype).itemsize
    if size > MASK_LIMIT_BYTES or (device.type == "cpu" and size > CPU_SCORES_LIMIT_BYTES):
        raise KernelError(f"the explicit mask for {shape.variant_label} would take {size / 2**30:.1f} GiB")


# -- flash-attn (Tri Dao's package) ---------------------------------------------------------------
def _flash_attn(shape: Shape, device: torch.device) -> Attention:
    if shape.kvcache:
        return kvcache.flash_attn_kvcache(shape, device)
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as exc:
        if exc.name == "flash_attn":
            raise KernelError("flash-attn not installed (pip install flash-attn)") from None
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None
    except OSError as exc:  # a compiled extension built for another torch or CUDA
        raise KernelError(f"flash-attn could not be loaded: {exc}") from None
    args = variant_args(shape, device)
    # its own names: window_size; softcap needs flash-attn >= 2.6, alibi_slopes >= 2.4, window >= 2.3
    kwargs = {"window_size" if name == "window" else name: value for name, value in args.items()
              if name in ("window", "softcap", "alibi_slopes")}
    func = flash_attn_varlen_func if shape.seqlens is not None else flash_attn_func
    params = inspect.signature(func).parameters
    lacking = [name for name in kwargs if name not in params]
    if lacking:
        raise KernelError(f"this flash-attn has no {', '.join(lacking)} (upgrade flash-attn)")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash-attn wants (B, N, H, D); transposed views cost nothing (it needs only the last
        # dimension contiguous). It takes GQA, bottom-right causal and the variants natively.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=shape.causal, **kwargs)
        return out.transpose(1, 2)

    def fn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # packed (total, H, D) is flash-attn's own varlen layout
        return flash_attn_varlen_func(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], args["max_seqlen_q"],
                                      args["max_seqlen_k"], causal=shape.causal, **kwargs)

    return Attention(fn_varlen if shape.seqlens is not None else fn)


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
