"""The FlashAttention-2 kernel family ("flash"), one module per concern:

``attention``  the maths (module docstring), launchers, autograd Function and public API
``args``       argument checks, :class:`Variant`, the TMA and flash-decoding decisions
``jit``        the ``@triton.jit`` helpers shared by the kernels (masks, scores, loads)
``fwd``        forward kernels (+ flash-decoding's split and combine)
``bwd``        backward kernels
``hopper``     the sm_90 forward path (gate, first-use check, launcher); ``hopper_jit`` its Gluon kernel
"""

from flashrun.kernels.flash.args import alibi_slopes
from flashrun.kernels.flash.attention import (
    attention_forward,
    attention_forward_varlen,
    flash_attention,
    flash_attention_varlen,
    forward_path,
)

__all__ = ["alibi_slopes", "attention_forward", "attention_forward_varlen", "flash_attention",
           "flash_attention_varlen", "forward_path"]
