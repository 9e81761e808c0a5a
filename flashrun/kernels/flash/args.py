"""The flash launchers' preconditions and plans: input checks, FlashAttention-2's variant arguments
checked into a :class:`Variant`, the TMA decisions."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import (
    TensorDescriptor,  # host-side TMA descriptors (triton >= 3.4)
)

from flashrun.errors import ArgumentError, KernelError
from flashrun.kernels.flash.jit import (
    LOG2E,
    SOFTCAP_FAST,
    SOFTCAP_FAST_CAP,
    SOFTCAP_FAST_PTX,
    SOFTCAP_PRECISE,
    UNBOUNDED,
)
from flashrun.kernels.tuning import (
    INTERPRETED,
    INTERPRETER,
    LaunchConfig,
    next_power_of_2,
)
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ---------------------------------------------------------------------------------------------
# Python launchers


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool = False) -> None:
    """Preconditions shared by every kernel here, with messages that say what to change.

    ``packed``: varlen's (total, heads, head_dim) layout (sequences along the rows; the
    cu_seqlens are checked apart) instead of (batch, heads, seq, head_dim)."""
    dims, layout = (3, "(total, heads, head_dim)") if packed else (4, "(batch, heads, seq, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise KernelError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise KernelError(f"dtype {q.dtype} is not supported", hint="use float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise KernelError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise KernelError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise KernelError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise KernelError(f"head_dim differs: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise KernelError(
            f"q's {q.shape[1]} heads are not a multiple of k/v's {k.shape[1]} heads",
            hint="GQA/MQA needs num_heads % num_kv_heads == 0",
        )
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise KernelError(f"head_dim must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.shape[1] == 0 or (not packed and (q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] == 0)):
        raise KernelError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise KernelError(
            "tensors are on the CPU but Triton is set up for the GPU",
            hint="move them to cuda, or set TRITON_INTERPRET=1 before flashrun.kernels is imported",
        )


def _rows_collapse(t: torch.Tensor) -> bool:
    """(batch, heads, seq) strides nest, so the tensor is one (batch*heads*seq, head_dim) matrix."""
    z, h, n, _ = t.shape
    sz, sh, sn, sd = t.stride()
    return sd == 1 and (h == 1 or sh == n * sn) and (z == 1 or sz == h * n * sn)


def tma_aligned(t: torch.Tensor) -> bool:
    """A (batch, heads, seq, head_dim) tensor a 4-D TMA descriptor can take as it lies: last dim
    contiguous, base and the other strides positive multiples of 16 bytes (an expanded GQA k/v,
    stride 0, is not). Any nesting of the strides: a model's (B, N, H, D) projection seen as
    (B, H, N, D) is one."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * size) % 16 == 0 for s in t.stride()[:3]))


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA needs a Hopper-class GPU (or the interpreter), 16-bit inputs and :func:`tma_aligned`
    tensors."""
    if q.dtype == torch.float32:
        return False
    if not INTERPRETED and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    return all(tma_aligned(t) for t in (q, k, v))


def _dq_tma_ok(dq: torch.Tensor) -> bool:
    """The atomic backward's float32 dQ buffer (contiguous, dense) can take TMA reduce-adds: a
    Hopper-class GPU (the interpreter has no descriptor reductions), an unsplit head dim (one
    descriptor per tile), 16-byte rows, int32 rows."""
    if INTERPRETED or torch.cuda.get_device_capability(dq.device)[0] < 9:
        return False
    return (_split_head_dim(dq.shape[-1])[1] == 0 and (dq.stride(2) * dq.element_size()) % 16 == 0
            and _rows_collapse(dq) and dq.shape[:3].numel() < 2**31)


def _rows_descriptors(t: torch.Tensor, block_rows: int) -> tuple:
    """TMA descriptors over ``t``'s (batch*heads*seq, head_dim) rows (the atomic backward's dQ
    buffer), one per column block of :func:`_split_head_dim` (the second None when the head dim
    is not split). Both span the same rows and all head_dim columns: the second block loads at
    column BLOCK_D0, and the copy engine zero-fills its columns past head_dim as it does rows past
    the tensor."""
    z, h, n, d = t.shape
    return tuple(TensorDescriptor(t, shape=[z * h * n, d], strides=[t.stride(2), 1], block_shape=[block_rows, width])
                 if width else None for width in _split_head_dim(d))


def _head_descriptors(t: torch.Tensor, block_rows: int) -> tuple:
    """4-D TMA descriptors over ``t`` (batch, heads, seq, head_dim) with its own strides, one
    per column block of :func:`_split_head_dim` (the second None when the head dim is not split),
    each loading a (1, 1, block_rows, width) box: one head's rows. The copy engine zero-fills rows
    past the head's seq and columns past head_dim."""
    return tuple(TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()),
                                  block_shape=[1, 1, block_rows, width])
                 if width else None for width in _split_head_dim(t.shape[-1]))


def aligned_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The head dim rounded up to whole 16-byte rows (fp16/bf16: a multiple of 8; float32: of 4).
    A tensor whose rows are not (bf16 D = 111: 222 bytes) is loaded one element at a time, each
    with its own 64-bit address (sm_90 compile, Triton 3.6, the D = 111 forward and backward at
    1024 keys: 255 registers and 48-296 B spilled against 157-255 and 0-72 B at 112), so the API
    pads such inputs with zero columns (:func:`.attention.flash_attention`), as FlashAttention-2
    and SDPA do."""
    unit = 16 // dtype.itemsize
    return -(-head_dim // unit) * unit


def _block_d(head_dim: int) -> int:
    """The head dim padded to one power-of-two tile (flash-decoding's combine still pads)."""
    return max(16, next_power_of_2(head_dim))


def _split_head_dim(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D0, BLOCK_D1): the head dim as two power-of-two column blocks, 192 = 128 + 64,
    80 = 64 + 16, 40 = 32 + 16 (8 columns padded), so that no matmul runs over a padded 256-,
    128- or 64-wide tile. BLOCK_D0 is the largest power of two <= head_dim, BLOCK_D1 covers the
    rest (at least 16: tl.dot's minimum). Where two blocks would be as wide as one padded block
    (powers of two; 24 = 16 + 16 or 112 = 64 + 64), one block: (next power of two, 0)."""
    padded = _block_d(head_dim)
    d0 = 1 << (head_dim.bit_length() - 1)
    d1 = max(16, next_power_of_2(head_dim - d0)) if head_dim > d0 else 0
    return (d0, d1) if d1 and d0 + d1 < padded else (padded, 0)


ADD_SPLIT = True  # benchmarks/probes/gqa_bwd_split.py turns it off to time the partials against the adds


def split_outputs(k: torch.Tensor, split: int, repeatable: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(dk, dv buffers, adds) of a dK/dV kernel that spreads each k/v head's GQA group over
    ``split`` > 1 programs. ``adds``: float32 zeros shaped like k that every part adds into
    (atomics; the sum stays in L2) - where the backward need not be repeatable, or with two parts,
    whose one addition onto zero is exact in either order (0 + a + b = 0 + b + a). Otherwise one
    float32 partial per part, (B, H_KV x split, N_K, D), summed in a fixed order by
    :func:`split_result` (NOTES v15: the partials and their sum cost qwen2-1b's backward ~50 us a
    layer of DRAM traffic)."""
    z, h_kv, n_k, d = k.shape
    adds = split_adds(split, repeatable)
    shape = (z, h_kv if adds else h_kv * split, n_k, d)
    make = torch.zeros if adds else torch.empty
    return make(shape, dtype=torch.float32, device=k.device), make(shape, dtype=torch.float32, device=k.device), adds


def split_adds(split: int, repeatable: bool) -> bool:
    """Whether :func:`split_outputs` gives ``split`` parts one float32 head to add into."""
    return split > 1 and ADD_SPLIT and (not repeatable or split == 2)


def split_result(buf: torch.Tensor, out: torch.Tensor, split: int, adds: bool) -> torch.Tensor:
    """``out`` (dK or dV, k's shape and dtype) from one of :func:`split_outputs`' buffers."""
    return out.copy_(buf if adds else buf.view(*out.shape[:2], split, *out.shape[2:]).sum(2))


# A causal or windowed grid starts every head's heaviest tiles first (jit.tile_of's ACROSS) where
# the operand its programs re-read - K/V in the forward and dQ kernels, Q and dO in dK/dV's - fits
# in these many bytes over all heads; else head by head, so that a head's tiles share it in L2
# while they run. Measured on the H200 (50 MB of L2; NOTES v18),
# across all heads against head by head: the forward 4 % faster at llama-1b's prefill (K/V 16 MB),
# 55 % slower at 32 x 16 heads x 1024 keys (256 MB), and in sections of 24 MB still 4 % slower
# there; the Gluon dK/dV 3-5 % faster at qwen2's and llama's prefill (Q/dO 48 and 64 MB), 23 % at
# 16 heads x 2048 keys, 2 % at 16 x 8192 (64 MB), 18-29 % slower at 256 MB.
ACROSS_BYTES = {"kv": 24 << 20, "qdo": 64 << 20}
ACROSS_OVERRIDE: bool | None = None  # the tests force an order (then drop the plans)


def across_heads(heads: int, rows: int, head_dim: int, dtype: torch.dtype, share: float, operand: str) -> int:
    """1 where a grid over ``heads`` should start every head's heaviest tiles first (else 0): its
    programs of one head re-read ``rows`` rows of two (B, heads, N, head_dim) tensors, ``share``
    of a head's each (a GQA group of g query heads shares its K/V: 1/g; a dK/dV program of a k/v
    head reads Q and dO of g query heads: g), and all of it fits in ACROSS_BYTES[operand]."""
    if ACROSS_OVERRIDE is not None:
        return int(ACROSS_OVERRIDE)
    return int(heads * 2 * rows * head_dim * dtype.itemsize * share <= ACROSS_BYTES[operand])


def dot_options(dtype: torch.dtype) -> dict:
    """Constexprs for ``_dot``: bf16 upcast only in the interpreter; IEEE fp32 dots for float32."""
    return {
        "UPCAST": INTERPRETED and dtype == torch.bfloat16,
        "PRECISION": "ieee" if dtype == torch.float32 else None,  # None: the dtype's own MMA
    }



def _check_device(q: torch.Tensor) -> None:
    """Tensors on the CPU need the interpreter (TRITON_INTERPRET=1 when the kernels were loaded)."""
    if q.device.type == "cpu" and not INTERPRETED:
        raise KernelError("tensors are on the CPU but Triton is set up for the GPU",
                          hint="move them to cuda, or set TRITON_INTERPRET=1 before flashrun.kernels is imported")

# -- variants: checked arguments, in the kernels' terms --------------------------------------------


@dataclass(frozen=True)
class Variant:
    """What one call asks beyond plain attention, as the kernels take it (built by ``_variant``).

    The mask is exactly one of plain, ``causal`` (the CAUSAL path: keys up to the diagonal) or
    ``window`` (WINDOW: ``(left, right)``, an unbounded side given as UNBOUNDED). Packed
    sequences (VARLEN) carry their int32 offsets and longest lengths (the grid's extent)."""

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0  # > 0: SOFTCAP
    alibi_slopes: torch.Tensor | None = None  # float32 (H,) or (B, H): ALIBI
    cu_seqlens_q: torch.Tensor | None = None  # VARLEN: (B + 1,) int32
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def tuning(self, n_q: int, n_k: int) -> dict:
        """How :func:`choose` tells these calls apart from plain ones of the same shape."""
        flags = (("window", self.window is not None), ("softcap", self.softcap > 0),
                 ("alibi", self.alibi_slopes is not None), ("varlen", self.varlen))
        return {"variants": "+".join(name for name, on in flags if on), "lengths": (n_q, n_k)}

    def kernel_args(self, sm_scale: float, dtype: torch.dtype) -> dict:
        """The runtime arguments and constexprs every kernel here takes for the variants, for
        inputs of ``dtype``."""
        slopes = self.alibi_slopes
        left, right = self.window if self.window is not None else (0, 0)  # read only under WINDOW
        return {
            # with a softcap the tanh needs natural units: log2 e comes in after it, via softcap2
            "qk_scale": sm_scale / self.softcap if self.softcap else sm_scale * LOG2E,
            "softcap2": self.softcap * LOG2E,
            "ALIBI_SLOPES": slopes,
            "stride_az": slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,  # (H,): one row for all
            "stride_ah": slopes.stride(-1) if slopes is not None else 0,
            "win_left": left,
            "win_right": right,
            "CU_SEQLENS_Q": self.cu_seqlens_q,
            "CU_SEQLENS_K": self.cu_seqlens_k,
            "CAUSAL": self.causal,
            "WINDOW": self.window is not None,
            "SOFTCAP": self.softcap_kind(dtype),
            "ALIBI": slopes is not None,
            "VARLEN": self.varlen,
        }

    def softcap_kind(self, dtype: torch.dtype) -> int:
        """The SOFTCAP constexpr: 0 without a softcap; the fast tanh where its error (the cap
        times 3e-7) stays far below the rounding of float16/bfloat16 P (compiled: its PTX form);
        else the precise one."""
        if not self.softcap:
            return 0
        if dtype in (torch.float16, torch.bfloat16) and self.softcap <= SOFTCAP_FAST_CAP:
            return (SOFTCAP_FAST if INTERPRETED else SOFTCAP_FAST_PTX).value
        return SOFTCAP_PRECISE.value

    def key_span(self, n_q: int, n_k: int) -> tuple[int, int]:
        """Keys [first, n_k) that some of queries 0..n_q-1 may see (the last query faces the last
        key, so only a window's left side narrows it)."""
        if self.window is None:
            return 0, n_k
        return max(n_k - n_q - self.window[0], 0), n_k  # query 0 faces key n_k - n_q

    def with_sequences(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                       max_seqlen_q: int, max_seqlen_k: int) -> Variant:
        return replace(self, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def plain_options(causal, window, softcap, sm_scale) -> bool:
    """Whether a call's options are of the plain types a plan's key may hold as they are (a bool,
    a tuple of two ints, numbers): anything else is checked on every call."""
    return (type(causal) is bool and type(window) is tuple and len(window) == 2 and type(window[0]) is int
            and type(window[1]) is int and type(softcap) in (float, int) and type(sm_scale) in (float, int, type(None)))


def _window_arg(window) -> tuple[int, int]:
    if type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int \
            and window[0] >= -1 and window[1] >= -1:  # the usual call, without the ABC checks below (~4 us)
        return window
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ArgumentError(f"window must be a pair of ints >= -1, (left, right), got {window!r}",
                            hint="-1 leaves a side unbounded: (-1, -1) is full attention, (W, 0) a causal "
                                 "sliding window of W keys before the diagonal")
    return int(window[0]), int(window[1])


def _softcap_arg(softcap) -> float:
    if type(softcap) in (float, int) and 0 <= softcap < math.inf:  # the usual call (NaN fails both tests)
        return float(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ArgumentError(f"softcap must be a finite number >= 0, got {softcap!r}",
                            hint="0 turns it off; Gemma-2 caps attention logits at 50.0")
    return float(softcap)


def _alibi_arg(slopes, q: torch.Tensor, batch: int) -> torch.Tensor | None:
    heads = q.shape[1]  # (B, H, N, D) and packed (total, H, D) alike
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise ArgumentError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}",
                            hint="flashrun.kernels.alibi_slopes(num_heads) gives the standard ones")
    if slopes.dtype != torch.float32:
        raise ArgumentError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if slopes.device != q.device:
        raise ArgumentError(f"alibi_slopes is on {slopes.device}, q on {q.device}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ArgumentError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (heads, or batch x "
                            f"heads), got {tuple(slopes.shape)}")
    return slopes


def _cu_seqlens_arg(cu, name: str, rows: int, tensor: str, device: torch.device) -> list[int]:
    """Check one cu_seqlens; returns its offsets (the check reads them on the host, one sync)."""
    if not isinstance(cu, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ArgumentError(f"{name} must be int32, got {cu.dtype}", hint=f"pass {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ArgumentError(f"{name} must be 1-D, (batch + 1,) with batch >= 1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ArgumentError(f"{name} is on {cu.device}, q on {device}")
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ArgumentError(f"{name} must start at 0, got {offsets[0]}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ArgumentError(f"{name} must be non-decreasing: entry {b + 1} ({offsets[b + 1]}) < entry {b} "
                                f"({offsets[b]})")
    if offsets[-1] != rows:
        raise ArgumentError(f"{name} must end at {tensor}'s number of rows, {rows}, got {offsets[-1]}")
    return offsets


def _max_seqlen_arg(max_seqlen, name: str, longest: int) -> int:
    if max_seqlen is None:
        return longest
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < longest:
        raise ArgumentError(f"{name} must be None or an int >= the longest sequence ({longest}), got {max_seqlen!r}")
    return int(max_seqlen)


def _variant(q: torch.Tensor, batch: int, n_k: int, causal, window, softcap, alibi_slopes) -> Variant:
    """Check FlashAttention-2's arguments and fold them into one mask: ``causal`` is right = 0,
    and a side that is -1 or at least ``n_k`` keys wide is unbounded (n_k: the longest key sequence)."""
    left, right = _window_arg(window)
    if causal:
        right = 0
    left = -1 if left >= n_k else left
    right = -1 if right >= n_k else right
    if left < 0 and right < 0:
        mask = {}
    elif left < 0 and right == 0:
        mask = {"causal": True}
    else:
        mask = {"window": (UNBOUNDED if left < 0 else left, UNBOUNDED if right < 0 else right)}
    return Variant(**mask, softcap=_softcap_arg(softcap), alibi_slopes=_alibi_arg(alibi_slopes, q, batch))


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.), float32 (num_heads,): for n a power of two,
    2^(-8h/n) for h = 1..n; otherwise those of the largest power of two p < n, then every other
    slope of 2p heads' for the remaining n - p heads."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
        raise ArgumentError(f"num_heads must be a positive int, got {num_heads!r}")

    def powers_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 1 << (int(num_heads).bit_length() - 1)  # largest power of two <= num_heads
    slopes = powers_of_two(p) + powers_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


