"""Kernels that are right as attention calls go but wrong for a model in one way each:
``flashrun model`` must fail the model and say where (tests/test_model.py)."""

import torch

from flashrun.kernels import flash_attention, flash_attention_varlen


def _flash(q, k, v, causal, sm_scale, window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
           max_seqlen_q=None, max_seqlen_k=None):
    if cu_seqlens_q is not None:
        return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      sm_scale, window=window, softcap=softcap)
    return flash_attention(q, k, v, causal, sm_scale, window=window, softcap=softcap)


def everything(q, k, v, causal, sm_scale, window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q=None, max_seqlen_k=None):
    """flash, passed through: a user kernel that takes every argument a model sends."""
    return _flash(q, k, v, causal, sm_scale, window, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k)


def ignores_window(q, k, v, causal, sm_scale, window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None):
    return _flash(q, k, v, causal, sm_scale, (-1, -1), softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k)


def ignores_softcap(q, k, v, causal, sm_scale, window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None):
    return _flash(q, k, v, causal, sm_scale, window, 0.0, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def leaks_future(q, k, v, causal, sm_scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None):
    """Never causal: every position sees the whole sequence."""
    return _flash(q, k, v, False, sm_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def plain(q, k, v, causal, sm_scale):
    """No variant or packed arguments at all."""
    return flash_attention(q, k, v, causal, sm_scale)


class _HalfGradient(torch.autograd.Function):
    """The identity forward; the backward halves the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


def half_dq(q, k, v, causal, sm_scale, window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None):
    """The right output, and a backward that hands back half of dQ."""
    return _flash(_HalfGradient.apply(q), k, v, causal, sm_scale, window, softcap, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k)
