"""FP8 attention, forward only: :func:`flash_attention_fp8` over e4m3 q, k, v with descales, a
bf16 output, and :func:`quantize_qkv`, which makes those inputs from bf16/fp16 ones in one call.

On Hopper the fp8 tensor cores run twice as fast as the bf16 ones, so a prefill whose products
run in e4m3 can pass a bf16 kernel's roof (research/fp8.md). The maths, as FlashAttention-3's
FP8 forward does it:

  * q, k, v are e4m3; what they stand for is ``x8 · descale``, with one descale per (batch, kv
    head) (FlashAttention-3's layout) or one for the whole tensor. S = (q8 k8ᵀ) · sm_scale ·
    q_descale · k_descale: the descales fold into the softmax's one multiplier.
  * P is formed as exp2(s - m + 8), in [0, 256], before its cast to e4m3 (FA3's Max_offset): in
    [0, 1] more probabilities would flush to zero. The row sum adds the same (rounded) values,
    so the 256 cancels, and v_descale multiplies the normalization.
  * P·V is an fp8 product too, with float32 accumulation; O is written in bf16.

The kernel is the portable Triton one (:mod:`.fp8_jit`): any GPU with fp8 tensor cores, and the
CPU interpreter, where the cast of P to e4m3 is emulated (the interpreter's own rounds wrongly).
Causal (bottom-right), sliding windows and GQA/MQA are supported; packed sequences, softcap and
ALiBi are not (an ArgumentError says so). No backward: a call that would need one raises.
"""

from __future__ import annotations

import math

import torch

from flashrun.errors import ArgumentError, KernelError
from flashrun.kernels.flash.args import _check_device, _variant
from flashrun.kernels.flash.fp8_jit import _attn_fwd_fp8
from flashrun.kernels.tuning import INTERPRETED, cdiv, next_power_of_2
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Not tuned on a GPU yet: of the configs compiled for sm_90 (64/128 x 64/128 tiles, 4/8 warps, 2/3
# stages) this one spills least at head_dim 128 (the pointer loads' 64-bit addresses take registers;
# TMA loads, as the bf16 forward's, are the next step)
BLOCK_M, BLOCK_N, WARPS, STAGES = 64, 64, 8, 2


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, per_head: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16/fp16/fp32 ``q, k, v`` (B, H, N, D) (k, v with H_kv heads) as e4m3 and their descales:
    ``(q8, k8, v8, q_descale, k_descale, v_descale)``. The descales are float32 (B, H_kv) -
    amax / 448 over each kv head's group of q heads, and over k's and v's own heads - or, without
    ``per_head``, one each for the whole tensor (shape ()). v8 comes laid out seq-contiguous (a
    (B, H_kv, N, D) view of (B, H_kv, D, N) memory, each row of N keys padded to 16 bytes for TMA),
    the layout the fp8 product P·V wants on the GPU; written in the same pass as its quantization."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point() or t.element_size() < 2:
            raise ArgumentError(f"{name} must be a 4-D (batch, heads, seq, head_dim) float16/bfloat16/float32 tensor")
    batch, heads, _, _ = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or v.shape[1] != kv_heads:
        raise ArgumentError(f"q's {heads} heads are not a multiple of k and v's {kv_heads}")

    def scale(x: torch.Tensor, groups: int) -> torch.Tensor:
        """amax / 448 per (batch, kv head) over the heads of each group (or of the whole tensor)."""
        if not per_head:
            return (x.abs().amax().float() / E4M3_MAX).clamp_min(1e-12)
        amax = x.abs().amax(dim=(2, 3)).float().view(batch, kv_heads, groups).amax(-1)
        return (amax / E4M3_MAX).clamp_min(1e-12)

    def cast(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
        expand = descale if descale.dim() == 0 else descale.repeat_interleave(x.shape[1] // kv_heads, 1)[..., None, None]
        return (x.float() / expand).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)

    q_descale, k_descale, v_descale = scale(q, heads // kv_heads), scale(k, 1), scale(v, 1)
    # seq-contiguous, each (head dim) row of N keys padded to 16 bytes: a TMA descriptor can read Vᵀ tiles
    rows = torch.empty(v.shape[0], kv_heads, v.shape[3], -(-v.shape[2] // 16) * 16, dtype=E4M3, device=v.device)
    v8 = rows[..., : v.shape[2]]
    v8.copy_(cast(v, v_descale).transpose(2, 3))
    return cast(q, q_descale), cast(k, k_descale), v8.transpose(2, 3), q_descale, k_descale, v_descale


def _descale(x: float | torch.Tensor | None, name: str, batch: int, kv_heads: int, device: torch.device
             ) -> tuple[torch.Tensor, int, int]:
    """A descale as the kernel takes it: a float32 tensor and its (batch, kv head) strides (0, 0
    for one value)."""
    if x is None:
        x = 1.0
    if not isinstance(x, torch.Tensor):
        if isinstance(x, bool) or not (isinstance(x, (int, float)) and x > 0):
            raise ArgumentError(f"{name} must be a positive number or a float32 tensor, got {x!r}")
        return torch.full((), float(x), dtype=torch.float32, device=device), 0, 0
    if x.dtype != torch.float32 or x.device != device or tuple(x.shape) not in ((), (1,), (batch, kv_heads)):
        raise ArgumentError(f"{name} must be float32 on {device}, one value or ({batch}, {kv_heads}) (batch, kv "
                            f"head), got {x.dtype} {tuple(x.shape)} on {x.device}")
    return (x, 0, 0) if x.numel() == 1 else (x, x.stride(0), x.stride(1))


def flash_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_descale: float | torch.Tensor | None = None, k_descale: float | torch.Tensor | None = None,
                        v_descale: float | torch.Tensor | None = None, causal: bool = False,
                        sm_scale: float | None = None, window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Attention of e4m3 ``q`` (B, H, Nq, D) over e4m3 ``k``, ``v`` (B, H_kv, Nk, D), any strides
    (:func:`quantize_qkv` makes them), read as ``x8 · descale`` (descales: float32 (B, H_kv), one
    value, or None for 1). ``causal`` is bottom-right aligned, ``window`` as in
    :func:`~flashrun.kernels.flash_attention`. Returns bf16 (B, H, Nq, D). Forward only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise KernelError(f"{name} must be a 4-D (batch, heads, seq, head_dim) tensor")
        if t.dtype != E4M3:
            raise KernelError(f"{name} must be float8_e4m3fn, got {t.dtype}", hint="flashrun.kernels.quantize_qkv "
                              "makes e4m3 inputs and their descales from bf16 ones")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ArgumentError("the fp8 forward has no backward", hint="train in bf16/fp16; use fp8 for inference")
    batch, heads, n_q, head_dim = q.shape
    _, kv_heads, n_k, _ = k.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise KernelError(f"k and v must be ({batch}, kv_heads, Nk, {head_dim}), got {tuple(k.shape)} and "
                          f"{tuple(v.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise KernelError(f"q's {heads} heads are not a multiple of the {kv_heads} kv heads")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise KernelError(f"head_dim must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {head_dim}")
    if q.device != k.device or q.device != v.device:
        raise KernelError("q, k and v must be on one device")
    _check_device(q)
    variant = _variant(q, batch, n_k, causal, window, 0.0, None)
    descales = [_descale(x, name, batch, kv_heads, q.device)
                for x, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
    strides = {s[1:] for s in descales if s[0].numel() > 1}
    if len(strides) > 1:
        raise ArgumentError("the (batch, kv head) descales must share one layout")
    stride_dz, stride_dh = strides.pop() if strides else (0, 0)
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if n_q == 0 or batch == 0:
        return o
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    var = variant.kernel_args(scale, torch.bfloat16)
    grid = (cdiv(n_q, BLOCK_M), batch * heads)
    _attn_fwd_fp8[grid](q, k, v, o, descales[0][0], descales[1][0], descales[2][0],
                        *q.stride(), *k.stride(), *v.stride(), *o.stride(), stride_dz, stride_dh,
                        heads, n_q, n_k, scale, var["win_left"], var["win_right"],
                        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=var["CAUSAL"], WINDOW=var["WINDOW"],
                        INTERPRETED=INTERPRETED, num_warps=WARPS, num_stages=STAGES)
    return o
