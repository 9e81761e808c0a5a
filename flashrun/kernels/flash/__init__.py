"""The FlashAttention-2 kernel family ("flash"), one module per concern:

``attention``  the maths (module docstring), launchers, autograd Function and public API
``args``       argument checks, :class:`Variant`, the TMA decisions
``jit``        the ``@triton.jit`` helpers shared by the kernels (masks, scores, loads)
``fwd``        the forward kernel
``decode``     few queries against many keys (flash-decoding, GQA packing, lean launches) and the
               KV-cache API; ``decode_jit`` its kernels
``bwd``        backward kernels
``hopper``     the sm_90 forward path (gate, first-use check, launcher); ``hopper_jit`` its Gluon kernel
``hopper_bwd`` the sm_90 backward path (dK/dV, or dQ too); ``hopper_bwd_jit`` its Gluon kernel
``fp8``        the e4m3 forward (and :func:`quantize_qkv`); ``fp8_jit`` its kernel
"""

from flashrun.kernels.flash.args import alibi_slopes
from flashrun.kernels.flash.attention import (
    attention_forward,
    attention_forward_varlen,
    flash_attention,
    flash_attention_varlen,
    forward_path,
)
from flashrun.kernels.flash.decode import flash_attention_with_kvcache
from flashrun.kernels.flash.fp8 import flash_attention_fp8, quantize_qkv

__all__ = ["alibi_slopes", "attention_forward", "attention_forward_varlen", "flash_attention", "flash_attention_fp8",
           "flash_attention_varlen", "flash_attention_with_kvcache", "forward_path", "quantize_qkv"]
