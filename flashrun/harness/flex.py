"""FlexAttention as a bench provider (``flex``): one compiled callable per shape, the variants as
its ``mask_mod`` (causal, window, packed documents) and ``score_mod`` (softcap, ALiBi), and the
compile settings a sweep of many shapes needs. The reference's semantics, in FlexAttention's
terms (:mod:`flashrun.harness.providers` for the contract)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager

import torch

from flashrun.errors import KernelError
from flashrun.harness import kvcache
from flashrun.harness.inputs import slopes
from flashrun.harness.provider import Attention, sequences, unpacked
from flashrun.harness.reference import expand_kv
from flashrun.harness.shapes import Shape


def preparer() -> Callable[[Shape, torch.device], Attention]:
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
        if shape.kvcache and shape.page_size:
            return kvcache.flex_paged(shape, device, flex, mods)
        if shape.kvcache:
            return kvcache.gathered(prepare)(shape, device)
        mask_mod, score_mod = mods(shape, device)
        block_mask = block_mask_of(shape, device, mask_mod, create_block_mask)
        gqa = shape.num_kv_heads != shape.num_heads
        native_gqa = gqa and "enable_gqa" in inspect.signature(flex_attention).parameters
        kwargs = {"enable_gqa": True} if native_gqa else {}

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if gqa and not native_gqa:
                k, v = expand_kv(k, shape.num_heads), expand_kv(v, shape.num_heads)
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, **kwargs)

        return Attention(unpacked(fn, shape), note="" if native_gqa or not gqa else "k/v expanded for GQA")

    return prepare


def mods(shape: Shape, device: torch.device) -> tuple[Callable | None, Callable | None]:
    """``(mask_mod, score_mod)`` for ``shape``, the reference's semantics in FlexAttention's terms
    (None where every pair is allowed, or no score changes).

    Positions are per sequence: a packed batch is one long sequence of documents, and each
    query/key index is mapped to its document and its position in it (attention-gym's document
    mask), so the bottom-right offset, the window and the ALiBi distance are the sequence's own.
    A window side at least as wide as the sequence's keys is unbounded, as in the reference."""
    spans = sequences(shape)
    unbounded = 1 << 30
    doc_q = torch.tensor([b for b, (_, n, _, _) in enumerate(spans) for _ in range(n)], device=device)
    doc_k = torch.tensor([b for b, (_, _, _, n) in enumerate(spans) for _ in range(n)], device=device)
    start_q = torch.tensor([s[0] for s in spans], device=device)
    start_k = torch.tensor([s[2] for s in spans], device=device)
    offset = torch.tensor([n_k - n_q for _, n_q, _, n_k in spans], device=device)  # bottom-right, per sequence
    left, right = shape.window
    lefts = torch.tensor([unbounded if left < 0 or left >= n_k else left for *_, n_k in spans], device=device)
    rights = torch.tensor([0 if shape.causal else unbounded if right < 0 or right >= n_k else right
                           for *_, n_k in spans], device=device)
    alibi = slopes(shape, device)
    packed = shape.seqlens is not None

    def where(q_idx, kv_idx):  # (the query's document, its row + offset, the key's position)
        b = doc_q[q_idx] if packed else 0
        row = q_idx - (start_q[b] if packed else 0) + offset[b]
        col = kv_idx - (start_k[doc_k[kv_idx]] if packed else 0)
        return b, row, col

    def mask_mod(batch, head, q_idx, kv_idx):
        b, row, col = where(q_idx, kv_idx)
        keep = (col >= row - lefts[b]) & (col <= row + rights[b])
        return keep & (doc_k[kv_idx] == b) if packed else keep

    def score_mod(score, batch, head, q_idx, kv_idx):
        if shape.softcap:
            score = shape.softcap * torch.tanh(score / shape.softcap)
        if alibi is not None:
            _, row, col = where(q_idx, kv_idx)
            score = score - alibi[head] * (row - col).abs()
        return score

    masked = shape.causal or shape.window != (-1, -1) or packed
    return mask_mod if masked else None, score_mod if shape.softcap or alibi is not None else None


def block_mask_of(shape: Shape, device: torch.device, mask_mod: Callable | None, create_block_mask: Callable):
    """The block mask of ``mask_mod`` over the (packed) scores; None when every pair is allowed."""
    if mask_mod is None:
        return None
    spans = sequences(shape)
    return create_block_mask(mask_mod, None, None, sum(s[1] for s in spans), sum(s[3] for s in spans), device=device)


def compile_settings(n_shapes: int) -> ContextManager:
    """Settings for FlexAttention (the one compiled provider) over a sweep of ``n_shapes``:

    * dynamo keeps one compiled FlexAttention per shape (see :func:`preparer`);
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
