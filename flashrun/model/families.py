"""The model families ``flashrun model`` builds, and how: transformers' own config classes and
modelling code, random weights, at two sizes.

Each family is chosen for what its attention exercises (research/models.md):

=========  ==============================================================================
llama      GQA, RoPE; no variant (the plain causal path)
mistral    a sliding window on every layer
qwen2      q/k/v biases, GQA 6:1 at 1b (head_dim 128); an odd head dim (80 = 64 + 16) at mini
gemma2     an attention softcap, a sliding window on every other layer, head_dim 256,
           ``query_pre_attn_scalar`` scaling; SDPA cannot run it faithfully (it drops the
           softcap), so its baseline is ``eager``
gemma3     sliding-window layers among global ones (no softcap), head_dim 256, q/k norms,
           ``query_pre_attn_scalar`` scaling, MQA at 1b; SDPA is its baseline
phi3       head_dim 96 (= 64 + 32), a fused qkv projection
=========  ==============================================================================

``mini`` is a 4-layer model of the family's config class (Liger-Kernel's convergence tests use
the same idea) small enough for Triton's CPU interpreter at short lengths (2 query heads on 1 KV
head, hidden 128; qwen2's head_dim is 80, gemma2's and gemma3's 256, phi3's 96); ``1b`` is a ~1B-parameter
shape of the family for the GPU (research/models.md section 4; vocabularies cut to 32000 so that
logits of 4 x 2048 tokens fit comfortably).

Random weights hide variants: at initialization std 0.02 the attention scores are ~0.1, so a
softcap of 50 or a window changes nothing measurable. :func:`build` therefore sharpens q and k
(:func:`_sharpen`: the q and k projections scaled so that scores have a standard deviation of
about :data:`SCORE_STD`), and the mini sizes use windows shorter than their default sequence and
a softcap of 5, so that every variant a mini model carries visibly changes its logits (a test
proves it). gemma3 normalizes q and k (RMSNorm) after their projections, which undoes the gain:
its scores keep the spread its head_dim and scaling give them (about 1), which its short window
still changes visibly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3")
SIZES = ("mini", "1b")
SCORE_STD = 3.0  # target std of the attention scores after sharpening q and k


@dataclass(frozen=True)
class Size:
    config: dict[str, Any]  # keyword arguments of the family's config class
    batch: int  # defaults of the run at this size
    seq_len: int
    gen_tokens: int
    lr: float  # the training check's AdamW learning rate


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # in transformers
    sizes: dict[str, Size]
    variants: tuple[str, ...]  # the attention variants its layers carry: "window", "softcap"
    faithful_sdpa: bool = True  # False: SDPA drops part of its attention (gemma2's softcap)
    common: dict[str, Any] = field(default_factory=dict)  # config keys of every size

    @property
    def baseline(self) -> str:
        """The transformers attention its kernel is measured against."""
        return "sdpa" if self.faithful_sdpa else "eager"


_MINI_RUN = dict(batch=1, seq_len=32, gen_tokens=16, lr=1e-3)
_1B_RUN = dict(batch=4, seq_len=2048, gen_tokens=64, lr=1e-4)  # bf16 at 1B: a gentler step
# mini: 4 layers, 2 query heads sharing 1 KV head (GQA 2:1), vocab 1024 - the interpreter's cost
# is per program (batch x heads x tiles), so few heads keep a 20-step training run under a minute
_MINI = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=1024)

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaConfig", {
        "mini": Size(_MINI, **_MINI_RUN),  # head_dim 64
        # Llama-3.2-1B's shape (hidden 2048, 16 layers, 32/8 heads, head_dim 64), vocab 32000
        "1b": Size(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True), **_1B_RUN),
    }, variants=()),
    "mistral": Family("mistral", "MistralConfig", {
        "mini": Size(dict(_MINI, head_dim=64, sliding_window=16), **_MINI_RUN),
        # TinyLlama-like widths with Mistral's 8 KV heads; a window of 1024 so that it binds at 2048 tokens
        "1b": Size(dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=32000, sliding_window=1024), **_1B_RUN),
    }, variants=("window",)),
    "qwen2": Family("qwen2", "Qwen2Config", {
        "mini": Size(dict(_MINI, hidden_size=160), **_MINI_RUN),  # head_dim 80 = 64 + 16: split column blocks
        # Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12/2 heads, head_dim 128), vocab 32000
        "1b": Size(dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True), **_1B_RUN),
    }, variants=()),
    "gemma2": Family("gemma2", "Gemma2Config", {
        "mini": Size(dict(_MINI, head_dim=256, query_pre_attn_scalar=256, sliding_window=16,
                          attn_logit_softcapping=5.0), **_MINI_RUN),
        # Gemma-2-2B's attention (head_dim 256, 8/4 heads, softcap 50, alternating windows) at ~1.1B:
        # hidden 2048, 18 layers; a window of 1024 so that it binds at 2048 tokens
        "1b": Size(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=18, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, vocab_size=32000,
                        sliding_window=1024), **_1B_RUN),
    }, variants=("window", "softcap"), faithful_sdpa=False),
    "gemma3": Family("gemma3", "Gemma3TextConfig", {
        "mini": Size(dict(_MINI, head_dim=256, query_pre_attn_scalar=256, sliding_window=16,
                          layer_types=["sliding_attention", "full_attention"] * 2), **_MINI_RUN),
        # Gemma-3-1B's shape (hidden 1152, 26 layers, 4 heads on 1 KV head, head_dim 256, five
        # sliding layers to a global one), vocab 32000; a window of 1024 so that it binds at 2048 tokens
        "1b": Size(dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=32000,
                        sliding_window=1024,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2),
             **_1B_RUN),
    }, variants=("window",)),
    "phi3": Family("phi3", "Phi3Config", {
        "mini": Size(dict(_MINI, hidden_size=192), **_MINI_RUN),  # head_dim 96 = 64 + 32
        # Phi-3's head_dim 96 at ~1B: hidden 2304 (24 heads on 8 KV heads), 18 layers, vocab 32000
        "1b": Size(dict(hidden_size=2304, intermediate_size=6144, num_hidden_layers=18, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=32000), **_1B_RUN),
    }, variants=(), common=dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),  # its defaults lie past 32000
}


def family(arch: str) -> Family:
    return FAMILIES[arch]


def build_config(arch: str, size: str, *, sliding_window: int | None = None, softcap: float | None = None) -> Any:
    """The family's transformers config at ``size``; ``sliding_window`` / ``softcap`` override the
    family's own (only families that carry them)."""
    import transformers

    fam = FAMILIES[arch]
    kwargs = {**fam.common, **fam.sizes[size].config}
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    if softcap is not None:
        kwargs["attn_logit_softcapping"] = softcap
    return getattr(transformers, fam.config_class)(**kwargs)


def _sharpen(model: Any, config: Any) -> float:
    """Scale every layer's q and k projection weights by one gain so that attention scores
    (q·k·scaling) have a standard deviation of about SCORE_STD at initialization: with both
    weights N(0, r²) over the hidden size h and normalized inputs, q·k over D dims has a std of
    sqrt(D)·h·r², times the scaling. Returns the gain."""
    import torch

    text = getattr(config, "text_config", config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    scaling = (getattr(text, "query_pre_attn_scalar", None) or head_dim) ** -0.5
    std = math.sqrt(head_dim) * text.hidden_size * text.initializer_range ** 2 * scaling
    gain = math.sqrt(SCORE_STD / std)
    q_rows = text.num_attention_heads * head_dim  # a fused qkv projection (phi3): q's rows, then k's
    k_rows = text.num_key_value_heads * head_dim
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(gain)
            elif name.endswith("qkv_proj.weight"):
                param[:q_rows + k_rows].mul_(gain)
    return gain


def build(config: Any, dtype: Any, device: str, seed: int) -> Any:
    """A random-init causal LM of ``config`` (same seed, same weights), q/k sharpened, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _sharpen(model, config)
    return model.to(dtype).eval()
