"""Rung 1 of the ladder: the article's "minimal Flash Attention forward", with its bugs fixed.

One program per BLOCK_M rows of Q loads *one* BLOCK_N block of K and V, computes S = Q Kᵀ ·
sm_scale, applies the causal mask, a plain (not online) softmax and P V. There is no loop over
key blocks, so it is right only when every key fits in that one block: the launcher refuses
longer sequences instead of returning wrong numbers. The article's version also left out the
``1/sqrt(head_dim)`` scale its own reference applied; here the scale is applied.

Rung 2 is ``flash/``: the same program streams K/V block by block with an online softmax
(running max and sum), so any length works and memory stays linear in the sequence.
Forward only: no backward.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashrun.errors import KernelError
from flashrun.kernels.flash.args import check_inputs, dot_options
from flashrun.kernels.flash.jit import _dot
from flashrun.kernels.tuning import cdiv, launch, next_power_of_2

BLOCK_M = 64
BLOCK_N = 64  # the single key block: the longest key sequence this kernel can compute


@triton.jit
def _minimal_fwd(Q, K, V, O,
                 stride_qz, stride_qh, stride_qm, stride_qk,
                 stride_kz, stride_kh, stride_kn, stride_kk,
                 stride_vz, stride_vh, stride_vn, stride_vk,
                 stride_oz, stride_oh, stride_om, stride_ok,
                 H, N_Q, N_K, sm_scale,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = off_hz % H
    off_hkv = off_h // GROUP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)  # all the keys there are (N_K <= BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM

    q = tl.load(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                mask=(offs_m[:, None] < N_Q) & d_ok, other=0.0)
    k = tl.load(K + off_z * stride_kz + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk,
                mask=(offs_n[:, None] < N_K) & d_ok, other=0.0)
    v = tl.load(V + off_z * stride_vz + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vk,
                mask=(offs_n[:, None] < N_K) & d_ok, other=0.0)

    s = _dot(q, tl.trans(k), None, UPCAST, PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N): the scale the article forgot
    keep = offs_n[None, :] < N_K
    if CAUSAL:  # bottom-right aligned: query i sees keys j <= i + N_K - N_Q
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + (N_K - N_Q))
    s = tl.where(keep, s, float("-inf"))

    # plain softmax over the one block; subtracting the row max keeps exp() from overflowing
    row_max = tl.max(s, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row that sees no key
    p = tl.exp(s - row_max[:, None])
    denom = tl.sum(p, 1)
    p = p / tl.where(denom > 0.0, denom, 1.0)[:, None]  # no key: p is all 0 -> output 0, not NaN

    o = _dot(p.to(v.dtype), v, None, UPCAST, PRECISION)
    tl.store(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok,
             o.to(O.dtype.element_ty), mask=(offs_m[:, None] < N_Q) & d_ok)


def minimal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale) v for key sequences of at most 64; forward only."""
    check_inputs(q, k, v)
    Z, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    if N_K > BLOCK_N:
        raise KernelError(
            f"minimal computes at most {BLOCK_N} keys (one block, no online softmax), got seq_len {N_K}",
            hint="use the tiled kernel `flash` for longer sequences (it streams K/V with an online softmax)",
        )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    o = torch.empty((Z, H, N_Q, D), dtype=q.dtype, device=q.device)
    grid = (cdiv(N_Q, BLOCK_M), Z * H)
    launch(_minimal_fwd, grid, q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
           H, N_Q, N_K, float(sm_scale), GROUP=H // H_KV, HEAD_DIM=D,
           BLOCK_D=max(16, next_power_of_2(D)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
           CAUSAL=bool(causal), num_warps=4, **dot_options(q.dtype))
    return o
