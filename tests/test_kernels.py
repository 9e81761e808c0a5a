"""The Triton kernels against the float64 reference, through the interpreter on the CPU.

Every comparison goes through flashrun.harness.judge (one judge for verify, bench and tests).
Shapes stay small: the interpreter runs every program in numpy.
"""

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrun.env import smoke
from flashrun.errors import KernelError
from flashrun.harness.check import POISON, _poisoned_allocations
from flashrun.harness.inputs import Inputs, make_inputs
from flashrun.harness.judge import Reference
from flashrun.harness.reference import attention_ref
from flashrun.harness.shapes import Shape
from flashrun.kernels import (
    LaunchConfig,
    alibi_slopes,
    attention_forward,
    flash_attention,
    get,
    minimal_attention,
)
from flashrun.kernels.flash import attention as flash
from flashrun.kernels.flash.bwd import _attn_bwd_preprocess
from flashrun.kernels.flash import args as flash_args, jit as flash_jit
from flashrun.kernels.flash.fwd import _attn_fwd
from flashrun.kernels.flash.launch import rebased, template
from flashrun.kernels import tuning
from flashrun.kernels.tuning import candidates
from flashrun.limits import DETERMINISTIC_BACKWARD, MAX_HEAD_DIM, MIN_HEAD_DIM

KERNELS = Path(__file__).parent / "kernels"

# (Z, H, H_kv, N_q, N_k, D): awkward lengths, Nq != Nk (incl. rows that see no key when causal),
# head dims split into two column blocks (40 = 32 + 16 padded to 48, 80 = 64 + 16, 96 = 64 + 32,
# 192 = 128 + 64), rows that are not whole 16-byte units (37: the API pads them to 40), GQA and MQA.
SHAPES = [
    (1, 2, 2, 1, 1, 64),
    (2, 2, 2, 17, 17, 16),
    (1, 2, 2, 64, 64, 64),
    (1, 2, 2, 97, 97, 40),
    (1, 2, 2, 130, 130, 128),
    (1, 4, 2, 97, 97, 64),
    (1, 4, 1, 64, 130, 40),
    (1, 2, 2, 1, 130, 64),
    (1, 2, 2, 130, 17, 16),  # causal: the first 113 rows see no key
    (1, 2, 2, 33, 70, 80),
    (1, 2, 1, 17, 97, 192),
    (1, 2, 2, 97, 33, 96),  # causal: the first 64 rows see no key
    (1, 2, 1, 33, 70, 37),
    (1, 2, 1, 17, 97, 256),  # Gemma's head dim: one 256-wide block, MQA
    (2, 2, 2, 1, 33, 256),
]


def _inputs(shape, dtype, seed=0, requires_grad=True):
    """(Z, H, H_kv, N_q, N_k, D) -> [q, k, v, do] from the harness's one input generator."""
    z, h, h_kv, n_q, n_k, d = shape
    drawn = make_inputs(Shape(z, h, h_kv, n_q, n_k, d, str(dtype).removeprefix("torch."), False), seed, "cpu",
                        requires_grad=requires_grad)[0]
    return [drawn.q, drawn.k, drawn.v, drawn.dout]


def _judge(out, grads, q, k, v, do, causal, sm_scale=None, **variants):
    """The harness's one judge: out (and grads) against the reference built from these inputs;
    ``variants``: window, softcap, alibi_slopes, cu_seqlens_q/cu_seqlens_k for packed inputs."""
    reference = Reference(Inputs(q, k, v, do), causal=causal, sm_scale=sm_scale, grads=grads is not None, **variants)
    for result in reference.judge(out, grads, POISON):
        assert result.passed, result.reason()


def _check_fwd_bwd(q, k, v, do, causal, sm_scale=None, launch=None, deterministic=True, **variants):
    """flash against the float64 reference, forward and backward (``deterministic``: the
    atomic-free backward); ``variants``: window, softcap, alibi_slopes. Fresh allocations are
    poisoned, so an element never written cannot pass."""
    with _poisoned_allocations():
        out = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, launch=launch, deterministic=deterministic,
                              **variants)
        grads = torch.autograd.grad(out, (q, k, v), do)
    _judge(out, grads, q, k, v, do, causal, sm_scale, **variants)


# the default (deterministic) backward in both dtypes; the atomic one, the same dK/dV kernel
# adding dQ with atomics, in fp16
DTYPES = [(torch.float32, True), (torch.float16, True), (torch.float16, False)]


@pytest.mark.parametrize("dtype,deterministic", DTYPES, ids=["fp32", "fp16", "fp16-atomic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_matches_reference(shape, causal, dtype, deterministic):
    q, k, v, do = _inputs(shape, dtype)
    _check_fwd_bwd(q, k, v, do, causal, deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16(causal):
    # The interpreter's bf16 tl.dot is wrong (triton 3.9): flash upcasts those operands there,
    # so this checks everything but the bf16 MMA itself (which the GPU suite covers).
    q, k, v, do = _inputs((1, 4, 2, 97, 97, 64), torch.bfloat16)
    _check_fwd_bwd(q, k, v, do, causal)


def test_interpreter_bf16_probe_sees_the_fault():
    # If a future Triton fixes its interpreter, the probe says so and verify stops skipping.
    import triton

    from flashrun.harness.check import interpreter_bf16_dot_ok

    bf16 = smoke.run("cpu", torch.bfloat16)
    if triton.__version__.startswith("3.9"):
        assert bf16.max_error > 1.0
    assert interpreter_bf16_dot_ok() == bf16.ok
    assert smoke.run("cpu", torch.float16).ok  # the fault is bf16's alone


def test_the_interpreter_runs_kernels_without_overflow_asserts():
    # as a compiled kernel runs (without debug): Triton's interpreter would assert after every
    # 32-bit integer add, subtract and multiply, about a third of its time in these kernels
    from triton.runtime import interpreter

    if not tuning.INTERPRETED:
        pytest.skip("compiled kernels: no interpreter")
    assert interpreter.interpreter_builder.options.sanitize_overflow is False


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(causal):
    # (B, N, H, D) storage viewed as (B, H, N, D): no contiguous copy is needed
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 70, 4, 40, generator=gen).transpose(1, 2) for _ in range(4))
    assert not q.is_contiguous()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _check_fwd_bwd(q, k, v, do, causal)


def test_custom_scale_and_lse():
    q, k, v, _ = _inputs((1, 2, 2, 70, 90, 64), torch.float32, requires_grad=False)
    o, lse = attention_forward(q, k, v, causal=True, sm_scale=0.3)
    ref_o, ref_lse = attention_ref(q, k, v, causal=True, sm_scale=0.3, return_lse=True)
    assert torch.allclose(o.double(), ref_o, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_rows_that_see_no_key_are_zero_not_nan(deterministic):
    q, k, v, do = _inputs((1, 2, 2, 40, 8, 16), torch.float32)
    o, lse = attention_forward(q.detach(), k.detach(), v.detach(), causal=True)
    blind = 40 - 8  # query i sees keys j <= i - 32
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert torch.isinf(lse[:, :, :blind]).all() and (lse[:, :, :blind] < 0).all()
    out = flash_attention(q, k, v, causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, :blind], torch.zeros_like(grads[0][:, :, :blind]))


def test_deterministic_backward_is_bitwise_repeatable():
    # GQA 4:1 (dK/dV summed over the group), 4 key and 4 query blocks of the interpreter's 32x32
    # tiles. (Through the interpreter the atomic backward is repeatable too - its programs run one
    # after another - so only a GPU could show the difference; this proves the deterministic path
    # keeps no order-dependent sum, and that it runs the two-kernel backward.)
    q, k, v, do = _inputs((1, 4, 1, 97, 97, 64), torch.float16)
    with _spy_kernels() as launched:
        first = torch.autograd.grad(flash_attention(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    second = torch.autograd.grad(flash_attention(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert launched == DETERMINISTIC_KERNELS


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("waves, split", [(0, 1), (2, 2), (4, 4), (1000, 4)],
                         ids=["whole", "to-2-waves", "to-4-waves", "every-head"])
def test_a_gqa_group_split_over_programs_gives_the_gradients(waves, split, deterministic, monkeypatch):
    # GQA 4:1 with 4 key blocks: 4 dK/dV programs. The interpreter counts 4 SMs, so 4 waves want
    # 16 programs: the group of 4 is split over 4. The parts add into one float32 head where the
    # backward need not be repeatable or there are two of them (exact in either order), else each
    # part's partial dK/dV is summed by the launcher
    monkeypatch.setattr(flash, "SPLIT_WAVES", waves)
    launches = []
    real = flash.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        if kernel.fn.__name__ == "_attn_bwd_dkdv":
            launches.append((kwargs["KV_SPLIT"], kwargs["ADD_KV"], args[6].shape[1]))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(flash, "launch_kernel", spy)
    q, k, v, do = _inputs((1, 4, 1, 97, 97, 64), torch.float16)
    _check_fwd_bwd(q, k, v, do, True, deterministic=deterministic)
    adds = split > 1 and (not deterministic or split == 2)
    assert launches == [(split, adds, 1 if adds or split == 1 else split)]  # (split, adds, heads of DK)


@triton.jit
def _order_probe(OUT, ACROSS):
    """OUT[t] = (head, rank) of program t, t in the order programs start (x fastest)."""
    t = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    head, rank = flash_jit.tile_of(t, tl.num_programs(1), tl.num_programs(0), ACROSS)
    tl.store(OUT + 2 * t, head)
    tl.store(OUT + 2 * t + 1, rank)


@pytest.mark.parametrize("across", [0, 1], ids=["head-by-head", "across-heads"])
@pytest.mark.parametrize("heads, blocks", [(5, 4), (1, 3), (3, 1), (1, 1)])
def test_tile_order_visits_every_tile_once_heaviest_first(heads, blocks, across):
    out = torch.full((heads * blocks, 2), -1, dtype=torch.int32)
    _order_probe[(blocks, heads)](out, across)
    order = [tuple(pair) for pair in out.tolist()]
    if across:  # rank r of every head before rank r + 1 of any
        assert order == [(h, r) for r in range(blocks) for h in range(heads)]
    else:
        assert order == [(h, r) for h in range(heads) for r in range(blocks)]


@pytest.mark.parametrize("heads, rows, head_dim, group, operand, across", [
    (4 * 12, 2048, 128, 6, "kv", 1),  # qwen2-1b's prefill forward: K/V 8 MB
    (32 * 16, 1024, 128, 1, "kv", 0),  # 32 x 16 heads x 1024 keys: 256 MB
    (4 * 8 * 2, 2048, 64, 4 // 2, "qdo", 1),  # llama-1b's dK/dV, the group split in 2: Q and dO 64 MB
    (8 * 32, 4096, 64, 1, "qdo", 0)])  # 256 MB
def test_a_grid_goes_across_heads_where_their_operand_fits(heads, rows, head_dim, group, operand, across):
    share = 1 / group if operand == "kv" else group
    assert flash_args.across_heads(heads, rows, head_dim, torch.bfloat16, share, operand) == across


@pytest.mark.parametrize("across", [True, False], ids=["across-heads", "head-by-head"])
@pytest.mark.parametrize("variant", [{"causal": True}, {"window": (20, 3)}], ids=["causal", "window"])
@pytest.mark.parametrize("shape", [(1, 5, 5, 97, 97, 16), (2, 3, 1, 70, 97, 16)], ids=lambda s: "x".join(map(str, s)))
def test_causal_tiles_in_either_order_give_the_attention(shape, variant, across, monkeypatch):
    monkeypatch.setattr(flash_args, "ACROSS_OVERRIDE", across)
    q, k, v, do = _inputs(shape, torch.float16)
    variants = dict(variant)  # (the parameter itself is shared by every test of it)
    causal = variants.pop("causal", False)
    _check_fwd_bwd(q, k, v, do, causal, **variants)
    _check_fwd_bwd(q, k, v, do, causal, deterministic=False, **variants)


DETERMINISTIC_KERNELS = [("_attn_bwd_dkdv", False), ("_attn_bwd_dq", None)]
ATOMIC_KERNELS = [("_attn_bwd_dkdv", True)]


def test_backward_paths_and_the_default():
    # the default is whichever backward measured faster on the H200 (limits.DETERMINISTIC_BACKWARD);
    # None: the Gluon kernel with dQ inside where it applies (never here), else the deterministic ones
    q, k, v, do = _inputs((1, 4, 2, 40, 70, 16), torch.float16)
    with _spy_kernels() as launched:
        torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do)
    assert launched == (ATOMIC_KERNELS if DETERMINISTIC_BACKWARD is False else DETERMINISTIC_KERNELS)
    for deterministic, kernels in ((True, DETERMINISTIC_KERNELS), (False, ATOMIC_KERNELS)):
        with _spy_kernels() as launched:
            torch.autograd.grad(flash_attention(q, k, v, deterministic=deterministic), (q, k, v), do)
        assert launched == kernels


@contextlib.contextmanager
def _spy_kernels():
    """The backward kernels launched (after the preprocess), with their ATOMIC_DQ."""
    launched = []
    real = flash.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        launched.append((kernel.fn.__name__, kwargs.get("ATOMIC_DQ")))
        return real(kernel, grid, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash, "launch_kernel", spy)
        yield launched
    launched[:] = [entry for entry in launched
                   if entry[0].startswith("_attn_bwd") and entry[0] != "_attn_bwd_preprocess"]


def far_below_zero(n_q, n_k):
    """q, k, v, do (fp32, 2 heads, D=64) whose scores q·kᵀ/8 all lie below -90: exp underflows."""
    gen = torch.Generator().manual_seed(3)
    q = (-(torch.randn(1, 2, n_q, 64, generator=gen).abs() + 1) * 5).requires_grad_()
    k = (torch.randn(1, 2, n_k, 64, generator=gen).abs() + 1).requires_grad_()
    v = torch.randn(1, 2, n_k, 64, generator=gen).requires_grad_()
    do = torch.randn(1, 2, n_q, 64, generator=gen)
    assert (torch.matmul(q, k.transpose(-2, -1)) / 8).max() < -90
    return q, k, v, do


def test_atomic_dq_ignores_keys_past_the_end():
    # scores near -100 everywhere: against that LSE a padded key (k = 0, score 0) of the last,
    # partial key block would get P = exp2(0 - lse2) = inf, and inf · 0 = NaN in dQ unless its
    # dS is masked. 40 keys = one full block of 32 and 8 past the end.
    _check_fwd_bwd(*far_below_zero(33, 40), False, deterministic=False)


# Every backward tile shape the tuner may pick on a GPU, here in the interpreter: the loop plans
# (unmasked blocks, then the masked ones in one loop, GQA heads folded in) depend only on the
# tiles. GQA 2:1 with Nq != Nk, causal (rows that see no key included) and a window with softcap
# and ALiBi (both masked ranges); the atomic dQ on the causal case.
BWD_TILES = sorted({(cfg.block_m, cfg.block_n) for kind in ("bwd_fused", "bwd_dkdv", "bwd_dq")
                    for head_dim in (64, 128, 256) for cfg in candidates(kind, head_dim, torch.float16)})


@pytest.mark.parametrize("case", ["causal", "window-softcap-alibi", "causal-atomic"])
@pytest.mark.parametrize("tiles", BWD_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_backward_tile_shape(tiles, case):
    q, k, v, do = _inputs((1, 4, 2, 150, 97, 40), torch.float16)
    cfg = LaunchConfig(*tiles, 4, 1)
    pins = {"bwd_dkdv": cfg, "bwd_dq": cfg, "bwd_fused": cfg}
    variants = {"window": (70, 20), "softcap": 30.0, "alibi_slopes": alibi_slopes(4)} if "window" in case else {}
    _check_fwd_bwd(q, k, v, do, "causal" in case, launch=pins, deterministic="atomic" not in case, **variants)


@pytest.mark.parametrize("launch", [LaunchConfig(block_m=16, block_n=16), LaunchConfig(64, 16, 4, 2)], ids=str)
def test_launch_override(launch):
    q, k, v, do = _inputs((1, 2, 1, 97, 50, 40), torch.float16)
    _check_fwd_bwd(q, k, v, do, True, launch=launch)


# The TMA forward reads one head's rows through 4-D descriptors: a tile that runs past a head's
# last row must come back zero, not the next head's rows. Batch 2 makes a leak visible.
TMA = {"fwd": LaunchConfig(32, 32, 4, 1, tma=True, ws=True)}


def _model_layout(t):
    """``t`` (B, H, N, D) re-laid as a model hands it over: a (B, N, H, D) projection seen as
    (B, H, N, D), heads interleaved along the rows."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 97, 70, 40), (2, 2, 1, 33, 130, 64), (1, 2, 2, 1, 1, 16),
                                   (2, 2, 1, 33, 47, 160)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["dense", "model"])
def test_tensor_descriptor_path(shape, causal, layout):
    q, k, v, do = _inputs(shape, torch.float16)
    if layout == "model":
        q, k, v = (_model_layout(t) for t in (q, k, v))
        assert q.shape[2] == 1 or q.stride(2) == q.shape[1] * q.shape[3]  # rows H·D apart: no (B·H·N, D) matrix
    assert flash._tma_ok(q, k, v)  # the descriptors, not the pointers, read these
    _check_fwd_bwd(q, k, v, do, causal, launch=TMA)


@pytest.mark.parametrize("layout", ["dense", "model"])
@pytest.mark.parametrize("launch", [TMA, "default"], ids=["tma", "pointers"])
def test_heads_do_not_leak_into_each_other(launch, layout):
    # NaN in every input of one head (batch 0, head 1) must leave the other heads exact
    q, k, v, do = (t.detach() for t in _inputs((2, 2, 2, 33, 47, 40), torch.float16))
    if layout == "model":
        q, k, v = (_model_layout(t) for t in (q, k, v))
    for t in (q, k, v, do):
        t[0, 1] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, causal=True, launch=launch)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for z, h in [(0, 0), (1, 0), (1, 1)]:
        head = [t[z:z + 1, h:h + 1].detach() for t in (out, *grads, q, k, v, do)]
        _judge(head[0], tuple(head[1:4]), *head[4:], causal=True)


# Flash-decoding: a few queries against many keys split the keys over programs, then merge.
# 1x1x4x64x513: row 0 sees no key of the last split (its partial result must weigh nothing).
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 1, 300, 64), (1, 2, 2, 20, 517, 40), (1, 1, 1, 64, 513, 16),
                                   (1, 3, 1, 7, 700, 128), (1, 2, 1, 3, 300, 192), (1, 2, 1, 3, 300, 37)],
                         ids=lambda s: "x".join(map(str, s)))
def test_flash_decoding_splits_the_keys(shape, causal):
    q, k, v, do = _inputs(shape, torch.float16)
    assert flash.decode.plan(q, k, v, 0.125, flash.Variant(causal=causal)).splits > 1  # the split path is checked
    _check_fwd_bwd(q, k, v, do, causal)


@settings(max_examples=12, deadline=None)
@given(
    n_q=st.integers(1, 80), n_k=st.integers(1, 80), head_dim=st.sampled_from([16, 24, 27, 40, 48, 64, 96]),
    group=st.sampled_from([(2, 2), (2, 1), (4, 2)]), causal=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_random_shapes(n_q, n_k, head_dim, group, causal, seed):
    q, k, v, do = _inputs((1, group[0], group[1], n_q, n_k, head_dim), torch.float32, seed=seed)
    _check_fwd_bwd(q, k, v, do, causal)


# -- head dims that are not powers of two: two power-of-two column blocks, no padded matmuls -----
def test_split_head_dim_plan():
    for d in range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1):
        d0, d1 = flash._split_head_dim(d)
        padded = max(16, triton.next_power_of_2(d))
        assert d0 + d1 >= d and d0 + d1 <= padded, d
        assert d0 & (d0 - 1) == 0 and d0 >= 16, d
        if d1:  # a split: a real gain over the padded tile, the first block all real columns
            assert d1 & (d1 - 1) == 0 and d1 >= 16 and d0 + d1 < padded and d0 < d, d
        else:
            assert d0 == padded, d
    assert all(flash._split_head_dim(d) == (d, 0) for d in (16, 32, 64, 128, 256))  # the fast path
    assert [flash._split_head_dim(d) for d in (40, 48, 80, 96, 160, 192, 24, 112, 200)] == [
        (32, 16), (32, 16), (64, 16), (64, 32), (128, 32), (128, 64), (32, 0), (128, 0), (256, 0)]


@pytest.mark.parametrize("head_dim,blocks", [(192, (128, 64)), (64, (64, 0)), (112, (128, 0))])
def test_launchers_plan_the_split(head_dim, blocks):
    # every flash kernel of a forward and both backwards gets the plan (the combine has no matmul)
    q, k, v, do = _inputs((1, 1, 1, 1, 1, head_dim), torch.float32)
    seen = []
    real = flash.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        seen.append((kernel.fn.__name__, kwargs["BLOCK_D0"], kwargs["BLOCK_D1"]))
        return real(kernel, grid, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash, "launch_kernel", spy)
        for deterministic in (True, False):
            torch.autograd.grad(flash_attention(q, k, v, deterministic=deterministic), (q, k, v), do)
    # the second forward and preprocess are the first ones' plans (lean launches, not through launch_kernel)
    assert [name for name, *_ in seen] == ["_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq",
                                           "_attn_bwd_dkdv"]
    assert {tuple(b) for _, *b in seen} == {blocks}
    (plan,) = flash._forward_plans.values()
    names = _attn_fwd.arg_names[flash.PER_CALL:]
    assert (plan.launch.tail[names.index("BLOCK_D0")], plan.launch.tail[names.index("BLOCK_D1")]) == blocks
    (plan,) = flash._delta_plans.values()
    names = _attn_bwd_preprocess.arg_names[3:]
    assert (plan.tail[names.index("BLOCK_D0")], plan.tail[names.index("BLOCK_D1")]) == blocks


# fp16 rows of 37 or 38 elements, float32 rows of 38, are not whole 16-byte units: the kernels
# get them padded to 40 (zero columns); flash-decoding's shapes keep theirs
@pytest.mark.parametrize("dtype,head_dim,width", [(torch.float16, 37, 40), (torch.float16, 38, 40),
                                                  (torch.float32, 38, 40), (torch.float32, 36, 36),
                                                  (torch.float16, 40, 40)])
@pytest.mark.parametrize("n_q,n_k,layout", [(33, 47, "dense"), (33, 47, "model"), (2, 300, "dense")],
                         ids=["dense", "model-layout", "decode"])
def test_rows_reach_the_kernels_in_whole_16_byte_units(dtype, head_dim, width, n_q, n_k, layout):
    q, k, v, do = _inputs((1, 2, 1, n_q, n_k, head_dim), dtype)
    if layout == "model":  # a (B, N, H, D) projection seen as (B, H, N, D)
        q, k, v = (_model_layout(t) for t in (q, k, v))
    seen = []
    real = flash.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        seen.append(kwargs["HEAD_DIM"])
        return real(kernel, grid, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash, "launch_kernel", spy)
        out = flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), do)
        o, _ = flash.attention_forward(q.detach(), k.detach(), v.detach(), causal=True)
    assert set(seen) == {width if n_q == 33 else head_dim}
    assert out.shape == o.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _judge(out, grads, q, k, v, do, causal=True)
    _judge(o, None, q.detach(), k.detach(), v.detach(), do, causal=True)


# -- minimal: right where it claims to be, refuses elsewhere -------------------------------------
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (17, 17), (64, 64), (100, 40), (10, 64)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_minimal_where_it_applies(n_q, n_k, causal):
    q, k, v, _ = _inputs((1, 2, 1, n_q, n_k, 40), torch.float16, requires_grad=False)
    _judge(minimal_attention(q, k, v, causal=causal), None, q, k, v, torch.zeros_like(q), causal)


def test_minimal_refuses_long_sequences():
    q, k, v, _ = _inputs((1, 1, 1, 65, 65, 16), torch.float16, requires_grad=False)
    with pytest.raises(KernelError, match="at most 64 keys") as info:
        minimal_attention(q, k, v)
    assert "flash" in info.value.hint


# -- preconditions ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shapes,dtype,match",
    [
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), torch.float16, "4 dims"),
        (((1, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), torch.float16, "batch sizes differ"),
        (((1, 2, 8, 16), (1, 2, 8, 32), (1, 2, 8, 32)), torch.float16, "head_dim differs"),
        (((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), torch.float16, "not a multiple"),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), torch.float16, "head_dim must be in 16..256"),
        (((1, 2, 8, 512), (1, 2, 8, 512), (1, 2, 8, 512)), torch.float16, "head_dim must be in 16..256"),
        (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16)), torch.float16, "same shape"),
        (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), torch.float64, "not supported"),
    ],
)
def test_preconditions(shapes, dtype, match):
    q, k, v = (torch.zeros(s, dtype=dtype) for s in shapes)
    with pytest.raises(KernelError, match=match):
        flash_attention(q, k, v)


def test_mixed_dtypes_rejected():
    q = torch.zeros(1, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(KernelError, match="share a dtype"):
        flash_attention(q, q.float(), q.float())


# -- registry ----------------------------------------------------------------------------------
def test_registry_builtins():
    assert get("flash").supports_backward and not get("minimal").supports_backward


def test_user_kernel_with_article_signature(tmp_path):
    kernel = get(f"{KERNELS / 'bad_kernels.py'}:qkv_only")
    assert not kernel.takes_causal
    q, k, v, _ = _inputs((1, 2, 2, 5, 5, 16), torch.float32, requires_grad=False)
    expected = attention_ref(q, k, v)
    assert torch.allclose(kernel(q, k, v, causal=False).double(), expected, atol=1e-5)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("flashy", "unknown kernel"),
        ("nowhere/missing.py:attention", "not found"),
        ("{k}/bad_kernels.py:nope", "has no function 'nope'"),
        ("{k}/bad_kernels.py:too_many_args", "signature"),
        ("{k}/broken_import.py:attention", r"importing .* failed at line 3: ZeroDivisionError"),
        ("{k}/broken_syntax.py:attention", "syntax error"),
    ],
)
def test_registry_errors(tmp_path, spec, match):
    (tmp_path / "broken_import.py").write_text("import math\n\nVALUE = 1 / 0\n")
    (tmp_path / "broken_syntax.py").write_text("def attention(q, k, v):\n    return q +\n")
    for name in ("bad_kernels.py",):
        (tmp_path / name).write_text((KERNELS / name).read_text())
    with pytest.raises(KernelError, match=match):
        get(spec.format(k=tmp_path))


def test_user_kernel_file_is_importable_twice(tmp_path):
    # the same file loaded again (a second verify in one process) must not clash
    spec = f"{KERNELS / 'bad_kernels.py'}:correct"
    assert get(spec).fn is not None and get(spec).fn is not None


def test_scale_default_is_inverse_sqrt_head_dim():
    q, k, v, _ = _inputs((1, 1, 1, 9, 9, 64), torch.float32, requires_grad=False)
    assert torch.allclose(flash_attention(q, k, v), flash_attention(q, k, v, sm_scale=1 / math.sqrt(64)))


# -- tuned tables: keyed by GPU, Triton minor version and launch-config space --------------------
def test_a_shipped_table_is_used_only_for_its_launch_config_space(tmp_path, monkeypatch):
    from flashrun.kernels import tuning

    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_loaded_from", set())
    winner = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "tma": False, "ws": None}
    current = tmp_path / "current.json"
    current.write_text(json.dumps({"space_version": tuning.SPACE_VERSION, "configs": {"fwd|key": winner}}))
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"space_version": tuning.SPACE_VERSION - 1, "configs": {"fwd|old": winner}}))
    tuning._load(current, shipped=True)
    tuning._load(stale, shipped=True)
    assert tuning._memory == {"fwd|key": winner}


def test_a_heuristic_config_that_cannot_launch_gives_way_to_the_next_candidate():
    # on a table miss flash runs a heuristic config without tuning; where it does not fit the GPU
    # (float32 at head_dim 256 asked 276 KB of shared memory on the H200) the next candidate runs
    from triton.runtime.errors import OutOfResources

    from flashrun.kernels import tuning

    big, small = LaunchConfig(64, 32, 4, 2), LaunchConfig(32, 32, 4, 2)
    tried = []

    def run(cfg):
        tried.append(cfg)
        if cfg == big:
            raise OutOfResources(282688, 232448, "shared memory")

    assert tuning._launchable("fwd|float32|d256|test", big, [big, small], run) == small
    assert tuning._launchable("fwd|float32|d256|test", big, [big, small], run) == small  # kept: no second try
    assert tried == [big, small]
    tuning._launchable_here.pop("fwd|float32|d256|test")


# -- lean launches: a forward's plan, made by its first call, reused by the next ------------------
@pytest.mark.parametrize("head_dim", [40, 64])
def test_a_forward_plan_is_reused_for_new_tensors_of_the_same_layout(head_dim):
    q, k, v, _ = _inputs((2, 4, 2, 37, 53, head_dim), torch.float16, requires_grad=False)
    first = flash_attention(q, k, v, causal=True)
    assert len(flash._forward_plans) == 1
    seen = []
    real = flash.launch_kernel
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash, "launch_kernel", lambda *a, **kw: seen.append(a[0]) or real(*a, **kw))
        again = flash_attention(q, k, v, causal=True)
        fresh = [t.clone().mul_(1.5) for t in (q, k, v)]
        planned = flash_attention(*fresh, causal=True)
    assert seen == [] and len(flash._forward_plans) == 1  # both through the plan
    assert torch.equal(again, first)
    _judge(planned, None, *fresh, torch.zeros_like(q), True)
    flash_attention(q, k, v)  # another variant (not causal): another plan
    assert len(flash._forward_plans) == 2


def test_a_descriptor_template_holds_no_tensor_and_rebases_to_what_the_constructor_makes():
    """A plan keeps its first call's TMA descriptors without their tensors (a model's activations
    must not stay alive) and copies them over each call's tensors: the copy is the descriptor the
    constructor would make for those tensors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def made(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, 32])

    first, later = torch.randn(2, 3, 64, 32), torch.randn(2, 3, 64, 32)
    kept = template(made(first))
    assert kept.base is None
    assert rebased(kept, later) == made(later) and rebased(kept, later).base is later


def test_a_forward_route_skips_the_path_checks_until_a_switch_changes(monkeypatch):
    """The first call of a layout decides the path (flash-decoding, Gluon or portable) and keeps
    its plan as the route; repeat calls run it without deciding again, until a switch of the Gluon
    path changes (FLASHRUN_HOPPER, a reset) - then the path is decided anew. Flash-decoding reads
    no switch: a call without autograd keeps its plan with the checked call (no route key at all),
    one with autograd as a route."""
    decided = []
    real = flash.decode.applies
    monkeypatch.setattr(flash.decode, "applies", lambda *a: decided.append(a[0].shape) or real(*a))
    dense = _inputs((1, 2, 1, 17, 17, 32), torch.float16, requires_grad=False)[:3]
    decoding = _inputs((1, 2, 1, 1, 300, 16), torch.float16, requires_grad=False)[:3]
    first = [flash_attention(*inputs, causal=True) for inputs in (dense, decoding)]
    assert set(decided) == {dense[0].shape, decoding[0].shape}
    decided.clear()
    again = [flash_attention(*(t.clone() for t in inputs), causal=True) for inputs in (dense, decoding)]
    assert decided == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    assert [type(route) for route in flash._forward_plans.values()] == [flash._ForwardPlan]
    assert [list(call.decoding) for call in flash._checked_calls.values() if call.decoding] == [[flash.decode.PDL]]
    monkeypatch.setenv("FLASHRUN_HOPPER", "0")
    flash_attention(*dense, causal=True)
    flash.hopper.reset()
    assert torch.equal(flash_attention(*decoding, causal=True), first[1])
    assert set(decided) == {dense[0].shape} and len(flash._forward_plans) == 2
    with torch.enable_grad():
        flash_attention(*(t.requires_grad_() for t in decoding), causal=True)
    assert [type(route) for route in flash._forward_plans.values()][-1] is flash._DecodeRoute


def test_packed_alibi_and_compile_only_calls_make_no_plan():
    q, k, v, _ = _inputs((1, 4, 4, 33, 33, 32), torch.float16, requires_grad=False)
    flash_attention(q, k, v, alibi_slopes=alibi_slopes(4))
    assert flash._forward_plans == {}  # ALiBi's slopes are a per-call tensor among the fixed arguments
    handed = []
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel)):
        flash_attention(q, k, v)
    assert handed == [_attn_fwd] and flash._forward_plans == {}  # compiling ahead launches nothing
