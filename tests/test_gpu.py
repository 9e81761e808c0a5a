"""The GPU correctness suite: big shapes, bf16, GQA 8:1, every launch config the tuner may pick.

Skipped without a CUDA device. On a GPU machine run it with the interpreter off (compiling
dominates its time, so spread it over processes; they share Triton's kernel cache):

    TRITON_INTERPRET=0 python -m pytest tests/test_gpu.py -q -n 4
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU with TRITON_INTERPRET unset", allow_module_level=True)

from flashrun.harness.inputs import Inputs, make_inputs  # noqa: E402
from flashrun.harness.judge import Reference  # noqa: E402
from flashrun.harness.shapes import Shape  # noqa: E402
from flashrun.kernels import LaunchConfig, flash_attention  # noqa: E402
from flashrun.kernels.tuning import candidates, default  # noqa: E402

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
# (Z, H, H_kv, N_q, N_k, D, dtype, causal)
CASES = [
    (2, 8, 8, 1024, 1024, 64, FP16, False),
    (2, 8, 8, 1024, 1024, 64, BF16, True),
    (2, 8, 8, 1024, 1024, 128, FP16, True),
    (2, 8, 8, 1024, 1024, 128, BF16, False),
    (1, 8, 1, 16384, 16384, 128, BF16, True),  # GQA 8:1, long
    (1, 8, 1, 16384, 16384, 64, FP16, False),
    (1, 4, 4, 4096, 4096, 256, BF16, True),
    (1, 4, 4, 4096, 4096, 256, FP16, False),
    (1, 4, 2, 1000, 3000, 64, FP16, True),  # Nq < Nk, bottom-right causal
    (1, 4, 2, 3000, 1000, 128, BF16, True),  # Nq > Nk: 2000 rows see no key
    (2, 4, 4, 1, 16384, 128, FP16, True),  # decode-like
    (2, 4, 1, 1, 8191, 64, BF16, False),
    (1, 8, 2, 64, 16384, 128, FP16, True),  # flash-decoding splits: GQA, causal, a full query tile
    (4, 8, 8, 16, 4096, 64, BF16, False),
    (1, 4, 4, 33, 5000, 96, FP16, True),
    (1, 4, 4, 777, 777, 40, FP16, True),
    (1, 4, 4, 777, 777, 80, BF16, False),
    (1, 4, 2, 777, 777, 96, FP16, False),
    (1, 4, 4, 777, 777, 112, BF16, True),
    (1, 2, 2, 1, 1, 64, FP16, True),
    (1, 2, 2, 513, 513, 64, FP32, True),
    (1, 2, 1, 257, 1025, 128, FP32, False),
]


def _inputs(z, h, h_kv, n_q, n_k, d, dtype, seed=0):
    shape = Shape(z, h, h_kv, n_q, n_k, d, str(dtype).removeprefix("torch."), False)
    drawn = make_inputs(shape, seed, "cuda", requires_grad=True)[0]
    return drawn.q, drawn.k, drawn.v, drawn.dout


def _check(q, k, v, do, causal, launch=None):
    out = flash_attention(q, k, v, causal=causal, launch=launch)
    grads = torch.autograd.grad(out, (q, k, v), do)
    reference = Reference(Inputs(q, k, v, do), causal=causal, grads=True)  # float32 on the GPU
    failures = [c.reason() for c in reference.judge(out, grads) if not c.passed]
    torch.cuda.empty_cache()
    assert not failures, "; ".join(failures)


def _defaults(head_dim, dtype):
    """Pin each kernel to its default config: the shapes are checked here, the tuner's whole
    space in test_every_tunable_config_is_correct (tuning every case would only add compiles)."""
    return {kind: default(kind, head_dim, dtype) for kind in ("fwd", "bwd_dkdv", "bwd_dq")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_flash_on_gpu(case):
    *shape, dtype, causal = case
    _check(*_inputs(*shape, dtype), causal, launch=_defaults(shape[-1], dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_autotuned_path(causal):
    _check(*_inputs(2, 8, 2, 2048, 2048, 64, BF16), causal)


def _space():
    for kind in ("fwd", "bwd_dkdv", "bwd_dq"):
        for head_dim in (64, 128, 256):
            for cfg in candidates(kind, head_dim, FP16):
                yield kind, head_dim, cfg


# ragged: lengths that are multiples of no tile size, Nq != Nk, GQA. aligned: the benchmark
# convention (heads = 2048 / head_dim, lengths a multiple of 16), which Triton compiles as its own
# specialization - so this test also leaves in Triton's cache kernels that `flashrun bench` tunes.
SHAPES = {"ragged": lambda d: (1, 4, 2, 1000, 1037, d), "aligned": lambda d: (1, 2048 // d, 2048 // d, 1024, 1024, d)}
# Every pair of (dtype, causal, shape) values in 4 runs per config instead of all 8 (a half
# fraction of the 2x2x2 design): compiling dominates this test's time on the GPU.
VARIANTS = [(FP16, False, "ragged"), (FP16, True, "aligned"), (BF16, False, "aligned"), (BF16, True, "ragged")]


@pytest.mark.parametrize("dtype,causal,shape", VARIANTS,
                         ids=lambda x: {FP16: "fp16", BF16: "bf16", False: "full", True: "causal"}.get(x, x))
@pytest.mark.parametrize("kind,head_dim,cfg", list(_space()), ids=lambda x: str(x))
def test_every_tunable_config_is_correct(kind, head_dim, cfg, dtype, causal, shape):
    pins = {**_defaults(head_dim, dtype), kind: cfg}
    try:
        _check(*_inputs(*SHAPES[shape](head_dim), dtype), causal, launch=pins)
    except Exception as exc:  # a config that cannot launch on this GPU is skipped by the tuner too
        if "out of resource" in str(exc).lower() or "OutOfResources" in type(exc).__name__:
            pytest.skip(f"{cfg} does not fit this GPU: {exc}")
        raise


def test_float32_configs():
    for cfg in candidates("fwd", 64, FP32):
        pins = {kind: cfg for kind in ("fwd", "bwd_dkdv", "bwd_dq")}
        _check(*_inputs(1, 2, 2, 300, 333, 64, FP32), True, launch=pins)


def test_pinned_partial_override_from_config():
    # [triton] num_warps/num_stages only: block sizes come from the default
    _check(*_inputs(1, 4, 4, 1000, 1000, 64, FP16), True, launch=LaunchConfig(num_warps=4, num_stages=2))
