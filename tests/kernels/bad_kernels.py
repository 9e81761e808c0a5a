"""Deliberately wrong attention kernels: verify must fail each one for the right reason."""

import math

import torch
import triton
import triton.language as tl


def _expand(k, heads):
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def _attention(q, k, v, causal, scale, flip_mask=False):
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        s = s.masked_fill(keep if flip_mask else ~keep, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ v.float()).to(q.dtype)


def correct(q, k, v, causal, sm_scale):
    return _attention(q, k, v, causal, sm_scale)


def no_scale(q, k, v, causal, sm_scale):
    return _attention(q, k, v, causal, 1.0)


def wrong_mask(q, k, v, causal, sm_scale):
    return _attention(q, k, v, causal, sm_scale, flip_mask=True)


def unwritten_row(q, k, v, causal, sm_scale):
    out = torch.empty_like(q)
    full = _attention(q, k, v, causal, sm_scale)
    out[:, :, 1:] = full[:, :, 1:]  # row 0 is never written
    return out


def returns_nan(q, k, v, causal, sm_scale):
    out = _attention(q, k, v, causal, sm_scale)
    out[..., 0, 0] = float("nan")
    return out


def raises(q, k, v, causal, sm_scale):
    raise RuntimeError("boom: this kernel always fails")


def qkv_only(q, k, v):
    """The article's signature: judged against the case's causal flag and default scale."""
    return _attention(q, k, v, False, 1.0 / math.sqrt(q.shape[-1]))


def too_many_args(q, k, v, causal, sm_scale, extra):
    return q


@triton.jit
def _fails_inside(Q, O, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    q = tl.load(Q + offs, mask=offs < N)
    tl.store(O + offs, q * not_defined, mask=offs < N)  # noqa: F821 - the bug verify must point at


def jit_error(q, k, v, causal, sm_scale):
    """Raises inside a Triton kernel: the interpreter re-raises it as its own error."""
    o = torch.empty_like(q)
    _fails_inside[(1,)](q, o, q.numel(), BLOCK=16)
    return o
