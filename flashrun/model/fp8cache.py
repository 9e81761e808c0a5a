"""Generation over an fp8 (e4m3) KV cache: transformers' cache holding e4m3 keys and values that
flashrun's KV-cache kernel reads, and its high-precision twin that the check judges it by.

transformers calls ``cache.update(k, v, layer)`` in each attention layer, then the attention
function with what ``update`` returned. :class:`Fp8Cache`'s layers keep the keys and values in
e4m3, one scale per key and kv head (vLLM's per-token-head scheme), in preallocated (B, capacity,
H_kv, D) buffers, the layout of :func:`~flashrun.kernels.flash_attention_with_kvcache`. Their
``update`` writes nothing: it hands the new keys and values on, marked as pending, and the swap
(:mod:`~flashrun.model.swap`) sees the mark and makes the one kernel call that quantizes them into
the cache and attends over it (:meth:`Fp8Layer.attend`). An attention function that ignores the
mark would see only the new keys; the next ``update`` of that layer raises instead.

:class:`HeldCache` is the yardstick's: a plain dynamic cache whose layers store exactly what the
fp8 cache holds - the same power-of-two token scales, applied to the keys in the queries' dtype
(:func:`~flashrun.harness.inputs.to_e4m3`) - dequantized, for the baseline attention in high
precision. A kernel that reads its fp8 cache right generates the tokens the baseline generates
from the held cache.

The queries of an fp8 cache are float16 or bfloat16 (:data:`QUERY_DTYPE`: float16 for a
float32 model, whose check wants the finer mantissa; else the model's).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from flashrun.harness.inputs import from_e4m3, to_e4m3
from flashrun.model.swap import PENDING, Unsupported, reference_attention

# the fp8 cache's query dtype per model dtype: e4m3 caches take 16-bit queries
QUERY_DTYPE = {torch.float32: torch.float16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}
E4M3 = torch.float8_e4m3fn
ROUNDED = "fr_reference_rounded"  # the yardstick's attention: the reference on inputs in the query dtype


class Fp8Layer(CacheLayerMixin):
    """One layer's e4m3 keys and values, (B, capacity, H_kv, D), their float32 token scales
    (B, capacity, H_kv) and the lengths (B,) int32 the kernel reads."""

    is_sliding = False  # a window is the kernel's mask: every key is kept

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.k_scale = self.v_scale = self.seqlens = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.keys, self.values = (torch.zeros(batch, self.capacity, kv_heads, head_dim, dtype=E4M3, device=self.device)
                                  for _ in range(2))
        self.k_scale, self.v_scale = (torch.ones(batch, self.capacity, kv_heads, device=self.device) for _ in range(2))
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is not None:
            raise Unsupported("the fp8 KV cache's keys were handed to an attention that did not write them",
                              hint="an fp8 KV cache is read by flashrun's swap (the fr_kernel attention) only")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.length + key_states.shape[2] > self.capacity:
            raise Unsupported(f"the fp8 KV cache holds {self.capacity} tokens; {self.length} cached + "
                              f"{key_states.shape[2]} new do not fit", hint="make the cache's capacity larger")
        self.pending = (key_states, value_states)
        PENDING[id(key_states)] = (key_states, self)
        return key_states, value_states

    def attend(self, query: torch.Tensor, causal: bool, sm_scale: float | None, variant: dict) -> torch.Tensor:
        """The swap's call for this layer: q (B, H, Nq, D) over the cache with the pending keys
        appended (quantized by the call) -> (B, Nq, H, D) in q's dtype."""
        from flashrun.kernels import flash_attention_with_kvcache

        key, value = self.pending
        self.pending = None
        PENDING.pop(id(key), None)
        dtype = QUERY_DTYPE[query.dtype]
        new = [t.transpose(1, 2).to(dtype) for t in (key, value)]  # (B, S_new, H_kv, D)
        out = flash_attention_with_kvcache(query.transpose(1, 2).to(dtype), self.keys, self.values, self.seqlens,
                                           k=new[0], v=new[1],
                                           k_scale=self.k_scale, v_scale=self.v_scale, causal=causal,
                                           sm_scale=sm_scale, **variant)
        self.seqlens += key.shape[2]
        self.length += key.shape[2]
        return out.to(query.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.pending is not None:
            PENDING.pop(id(self.pending[0]), None)
        self.length, self.pending = 0, None
        if self.is_initialized:
            self.seqlens.zero_()


class Fp8Cache(Cache):
    """``layers`` :class:`Fp8Layer` of ``capacity`` tokens each."""

    def __init__(self, layers: int, capacity: int) -> None:
        super().__init__(layers=[Fp8Layer(capacity) for _ in range(layers)])

    def bytes(self) -> int:
        """What the cache's keys, values and scales take on the device."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values, layer.k_scale, layer.v_scale))


class HeldLayer(DynamicLayer):
    """A dynamic layer that stores the keys and values as the fp8 cache holds them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        held = [held_as_fp8(t) for t in (key_states, value_states)]
        return super().update(*held, *args, **kwargs)


def held_as_fp8(x: torch.Tensor) -> torch.Tensor:
    """Keys or values (B, H_kv, N, D) as an fp8 cache with token scales holds them, in x's dtype:
    first in the cache's query dtype (as the swap hands them to the kernel), then each (key, kv
    head) row quantized by its own power-of-two scale."""
    return from_e4m3(*to_e4m3(x.to(QUERY_DTYPE[x.dtype]), "token"), x.dtype)


class HeldCache(Cache):
    def __init__(self, layers: int) -> None:
        super().__init__(layers=[HeldLayer() for _ in range(layers)])


def rounded_reference(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The checks' reference attention on q, k, v rounded to the fp8 cache's query dtype (what the
    kernel is handed), computed in the model's dtype: the yardstick of generation over the cache."""
    rounded = [t.to(QUERY_DTYPE[t.dtype]).to(t.dtype) for t in (query, key, value)]
    return reference_attention(module, *rounded, attention_mask, **kwargs)


def register() -> None:
    """Register :func:`rounded_reference` as :data:`ROUNDED` (process-wide, like the swap)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROUNDED, rounded_reference)
    AttentionMaskInterface.register(ROUNDED, eager_mask)


def capacity(prompt: int, new_tokens: int) -> int:
    """A cache that holds the prompt and the new tokens, rounded up to 64 keys."""
    return 64 * math.ceil((prompt + new_tokens) / 64)
