"""A user kernel that kills its worker process on one case (seq_len 97): the scale-out run must
report that case as an error (after one retry) and finish the others."""

import os

from flashrun.kernels import flash_attention


def attention(q, k, v, causal=False, sm_scale=None):
    if q.shape[2] == 97:
        os._exit(1)  # as a segfault or a sticky CUDA error would end it
    return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
