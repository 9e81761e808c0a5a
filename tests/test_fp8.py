"""The fp8 (e4m3) forward through the CPU interpreter: flash_attention_fp8 on fresh inputs made by
quantize_qkv, judged by FlashAttention-3's rule - the truth in float64 on the dequantized inputs,
the yardstick the same maths with P rounded to e4m3, a pass within twice the yardstick's error
plus the bf16 floor - across awkward shapes; its error against the unquantized inputs (outliers
included) is measured beside, bounded loosely; and its argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from flashrun.errors import ArgumentError, KernelError
from flashrun.harness.inputs import head_scales
from flashrun.harness.judge import compare
from flashrun.harness.reference import attention_fp8_yardstick, attention_ref
from flashrun.kernels import flash_attention_fp8, quantize_qkv

E4M3 = torch.float8_e4m3fn


def _dequantized(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x8 · descale in float64, the descale per (batch, kv head) spread over x8's heads."""
    return x8.double() * (descale.double() if descale.dim() == 0 else head_scales(descale.double(), x8.shape[1]))


def _inputs(b, h, h_kv, n_q, n_k, d, seed, outliers=0.0):
    """bf16 q, k, v from N(0, 1); ``outliers``: that fraction of the elements drawn from N(0, 10)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = torch.randn(shape, generator=gen)
        if outliers:
            x = torch.where(torch.rand(shape, generator=gen) < outliers, 10 * torch.randn(shape, generator=gen), x)
        return x.to(torch.bfloat16)

    return draw(b, h, n_q, d), draw(b, h_kv, n_k, d), draw(b, h_kv, n_k, d)


CASES = [  # (B, H, H_kv, Nq, Nk, D, causal, window)
    (1, 2, 2, 1, 1, 64, False, (-1, -1)),
    (2, 4, 2, 17, 17, 64, True, (-1, -1)),
    (1, 4, 1, 97, 130, 40, True, (-1, -1)),  # MQA, Nq < Nk, an odd head dim
    (2, 2, 2, 130, 97, 128, True, (-1, -1)),  # Nq > Nk: the first rows see no key
    (1, 4, 2, 97, 97, 64, False, (16, 0)),  # a sliding window
    (1, 2, 1, 65, 200, 64, False, (-1, -1)),
]


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_the_fp8_forward_is_within_twice_the_yardstick(case, per_head):
    b, h, h_kv, n_q, n_k, d, causal, window = case
    q, k, v = _inputs(b, h, h_kv, n_q, n_k, d, seed=n_q + n_k + d)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, per_head=per_head)
    assert (q8.dtype, k8.dtype, v8.dtype) == (E4M3,) * 3 and v8.stride(2) == 1  # v seq-contiguous,
    assert v8.stride(3) % 16 == 0  # its rows of keys 16-byte aligned (TMA reads Vᵀ tiles)
    assert qd.shape == ((b, h_kv) if per_head else ()) and qd.dtype == torch.float32
    out = flash_attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, window=window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    truth_inputs = (_dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd))
    truth = attention_ref(*truth_inputs, causal=causal, window=window)
    yardstick = attention_fp8_yardstick(*truth_inputs, causal=causal, window=window)
    check = compare("out", out, truth, yardstick)
    assert check.passed, check.reason()


@pytest.mark.parametrize("outliers", [0.0, 1e-3], ids=["normal", "outliers"])
def test_the_error_against_the_unquantized_inputs(outliers):
    """Not the judge (that is the dequantized inputs'), but what a user gets: bounded loosely (a
    tenth of the output's range, TransformerEngine's fp8 check) with 0.1 % outliers too."""
    q, k, v = _inputs(1, 4, 2, 128, 256, 64, seed=7, outliers=outliers)
    out = flash_attention_fp8(*quantize_qkv(q, k, v), causal=True)
    exact = attention_ref(q.double(), k.double(), v.double(), causal=True)
    rmse = float((out.double() - exact).pow(2).mean().sqrt())
    assert rmse < 0.1 * float(exact.max() - exact.min())


def test_a_scalar_descale_and_none_are_one():
    q, k, v = _inputs(1, 2, 2, 33, 33, 64, seed=3)
    q8, k8, v8 = (x.to(E4M3) for x in (q, k, v))
    assert torch.equal(flash_attention_fp8(q8, k8, v8), flash_attention_fp8(q8, k8, v8, 1.0, 1.0, 1.0))
    doubled = flash_attention_fp8(q8, k8, v8, v_descale=2.0)
    assert torch.allclose(doubled.float(), 2 * flash_attention_fp8(q8, k8, v8).float(), rtol=1e-2)


def test_fp8_argument_errors():
    q8 = torch.randn(1, 2, 8, 64).to(E4M3)

    def fails(kind, match, *args, **kwargs):
        with pytest.raises(kind, match=match):
            flash_attention_fp8(*args, **kwargs)

    fails(KernelError, "q must be float8_e4m3fn", q8.to(torch.bfloat16), q8, q8)
    fails(ArgumentError, "q_descale must be float32", q8, q8, q8, torch.ones(3, 3))
    fails(ArgumentError, "k_descale must be a positive number", q8, q8, q8, k_descale=-1.0)
    fails(KernelError, "heads are not a multiple", q8, q8[:, :1].expand(1, 3, 8, 64), q8[:, :1].expand(1, 3, 8, 64))
    wants_grad = torch.randn(1, 2, 8, 64).to(E4M3).requires_grad_()
    fails(ArgumentError, "the fp8 forward has no backward", wants_grad, q8, q8)
    with pytest.raises(ArgumentError, match="4-D"):
        quantize_qkv(torch.randn(2, 8, 64), q8, q8)


MINE = '''import torch

def unscaled(q, k, v, causal=False, sm_scale=None, q_descale=None, k_descale=None, v_descale=None):
    # reads the e4m3 values without their descales: must fail
    from flashrun.kernels import flash_attention_fp8
    return flash_attention_fp8(q, k, v, causal=causal, sm_scale=sm_scale)

def exact(q, k, v, causal=False, sm_scale=None, q_descale=None, k_descale=None, v_descale=None):
    # the dequantized inputs in float32, P never rounded: more precise than the rule asks, so it passes
    def held(x, d):
        return x.float() * d.repeat_interleave(x.shape[1] // d.shape[1], 1)[..., None, None]
    q, k, v = held(q, q_descale), held(k, k_descale), held(v, v_descale)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * sm_scale
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q).logical_not(), float("-inf"))
    return (torch.nan_to_num(torch.softmax(s, -1)) @ v).to(torch.bfloat16)

def wrong_dtype(q, k, v, causal=False, sm_scale=None, q_descale=None, k_descale=None, v_descale=None):
    return exact(q, k, v, causal, sm_scale, q_descale, k_descale, v_descale).float()  # e4m3 cases return bf16

def plain(q, k, v, causal=False, sm_scale=None):
    return q
'''


def test_verify_judges_e4m3_cases_by_the_fp8_rule(cli, tmp_path):
    """dtype e4m3 in verify: flash (routed to the fp8 forward) passes on awkward shapes; a kernel
    that drops the descales fails, one more precise than the rule passes, one returning float32
    errors, one that takes no descales is skipped (and windows, for the users' kernels without one); the error against the unquantized inputs (and
    with outliers) is a note beside the verdict; --grad checks the forward only."""
    (tmp_path / "mine.py").write_text(MINE)
    kernels = [arg for name in ("unscaled", "exact", "wrong_dtype", "plain") for arg in ("-k", f"mine.py:{name}")]
    result = cli("verify", "--device", "cpu", "--json", "--grad", "-k", "flash", *kernels,
                 "--set", "experiment.dtype=e4m3", "--set", "experiment.num_heads=4",
                 "--set", "experiment.num_kv_heads=1", "--set", "experiment.head_dim=40",
                 "--set", "verify.seq_len=[1,17,97]", "--set", "verify.seq_len_k=[130]",
                 "--set", "verify.causal=[false,true]", "--set", "verify.window=[[-1,-1],[16,0]]")
    assert "Traceback" not in result.stderr, result.stderr  # (the JSON keeps the raising kernel's, for -v)
    data = json.loads(result.stdout)
    status: dict[str, set[str]] = {}
    for r in data["results"]:
        if r["case"]["window"] == [-1, -1] or r["kernel"] == "flash":
            status.setdefault(r["kernel"], set()).add(r["status"])
    assert status == {"flash": {"pass"}, "mine.py:unscaled": {"fail"}, "mine.py:exact": {"pass"},
                      "mine.py:wrong_dtype": {"error"}, "mine.py:plain": {"skipped"}}, data["verdict"]
    windowed = {r["status"] for r in data["results"] if r["kernel"] != "flash" and r["case"]["window"] != [-1, -1]}
    assert windowed == {"skipped"}
    flash = [r for r in data["results"] if r["kernel"] == "flash"]
    assert len(flash) == 12 and "B1 H4/1 N97x130 D40 e4m3 causal w16,0" in {r["label"] for r in flash}
    assert all([c["name"] for c in r["checks"]] == ["out"] for r in flash)  # no gradients: forward only
    assert all(any("against the unquantized ones" in n and "outliers" in n for n in r["notes"]) for r in flash)
    assert all("forward only" in " ".join(r["notes"]) for r in flash)
    assert result.exit_code == 1


@pytest.mark.parametrize("variant", ["experiment.softcap=2", "experiment.alibi=true", "experiment.seqlens=[3,5]",
                                     "experiment.cache_seqlens=[4]"])
def test_e4m3_cases_are_dense_attention(cli, variant):
    result = cli("verify", "--device", "cpu", "--set", "experiment.dtype=e4m3", "--set", variant)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "dtype e4m3 (the fp8 forward) runs dense attention" in result.output


def test_bench_has_no_e4m3_dtype_but_names_the_fp8_provider(cli):
    result = cli("bench", "--device", "cpu", "--dtype", "e4m3")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "expected one of 'float16', 'bfloat16' or 'float32' (or fp16, bf16, fp32)" in result.output


def test_an_e4m3_output_is_judged_with_the_rounding_it_cannot_avoid():
    """cuDNN's fp8 attention writes O in e4m3: its yardstick rounds O there too (``out_e4m3``),
    so the exact answer rounded to e4m3 passes, while an output that forgot v's descale fails."""
    q, k, v = _inputs(1, 4, 2, 65, 65, 64, seed=11)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, per_head=False)
    held = (_dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd))
    truth = attention_ref(*held, causal=True)
    yardstick = attention_fp8_yardstick(*held, causal=True, out_e4m3=True)
    assert float((yardstick.double() - truth).abs().max()) > 2 ** -6  # O's rounding is in it
    rounded = truth.to(E4M3)
    assert compare("out", rounded, truth, yardstick).passed
    forgot = (truth / vd.double()).clamp(-448, 448).to(E4M3)
    assert not compare("out", forgot, truth, yardstick).passed


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
def test_the_judge_dequantizes_either_descale_layout(per_head):
    """cuDNN's fp8 provider quantizes per tensor (descales of shape ()): the truth is built on them too."""
    from flashrun.harness.inputs import Inputs
    from flashrun.harness.judge import dequantized

    q, k, v = (torch.randn(2, h, 33, 64) for h in (4, 2, 2))
    q8, k8, v8, *descales = quantize_qkv(q, k, v, per_head=per_head)
    held = dequantized(Inputs(q=q8, k=k8, v=v8, dout=q, descales=tuple(descales)))
    for x8, x, d in zip((q8, k8, v8), (held.q, held.k, held.v), descales):
        assert torch.equal(x, _dequantized(x8, d).float())


def _portable(q8, k8, v8, descales, scale, causal):
    return flash_attention_fp8(q8, k8, v8, *descales, causal=causal, sm_scale=scale)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_first_use_check_passes_a_right_kernel_and_fails_wrong_ones(head_dim):
    """The GPU's e4m3 forward (the Gluon kernel) runs after this check; here the portable kernel,
    right in the interpreter, stands in for it, and wrong ones must fail."""
    from flashrun.kernels.flash import fp8

    cpu = torch.device("cpu")
    assert fp8.check(_portable, cpu, head_dim) is None
    scaled = lambda *a: _portable(*a) * 1.05  # O off by 5 %: past twice the rounding of P
    assert "max error" in fp8.check(scaled, cpu, head_dim)
    unmasked = lambda q8, k8, v8, d, scale, causal: _portable(q8, k8, v8, d, scale, False)
    assert "causal" in fp8.check(unmasked, cpu, head_dim)

    def raises(*_):
        raise RuntimeError("no kernel image")
    assert "RuntimeError: no kernel image" in fp8.check(raises, cpu, head_dim)


def test_the_first_use_check_judges_nothing_while_compiling_ahead():
    """Inside a compile-ahead (bench's, the probes') launches only compile and outputs hold
    garbage: the check passes nothing on it and fails nothing; a raise still fails it."""
    from flashrun.kernels import tuning
    from flashrun.kernels.flash import fp8

    garbage = lambda q8, *_: torch.full(q8.shape, 448.0)  # what an unlaunched output may hold

    def raises(*_):
        raise RuntimeError("no kernel image")
    with tuning.compile_only(lambda *_: None):
        assert fp8.check(garbage, torch.device("cpu"), 64) is None
        assert "no kernel image" in fp8.check(raises, torch.device("cpu"), 64)
    assert "max error" in fp8.check(garbage, torch.device("cpu"), 64)


def test_the_gpu_fallback_on_the_dequantized_inputs_passes_the_rule():
    """Where the GPU's kernel cannot run a call, it runs dequantized in bf16: right by the same rule."""
    from flashrun.kernels.flash import fp8

    def dequantized(q8, k8, v8, descales, scale, causal):
        return fp8._dequantized(q8, k8, v8, descales, 1, 2, scale, causal, (-1, -1))
    assert fp8.check(dequantized, torch.device("cpu"), 64) is None
    assert torch.equal(fp8._per_kv_head(torch.tensor(0.5), 2, 3), torch.full((2, 3), 0.5))


def test_v_laid_out_seq_major_once():
    from flashrun.kernels.flash.fp8 import seq_major

    v = torch.randn(2, 3, 37, 64).to(torch.float8_e4m3fn)
    v8 = seq_major(v)
    assert torch.equal(v8.float(), v.float()) and v8.stride(2) == 1 and v8.stride(3) == 48
    assert seq_major(v8) is v8


@pytest.mark.parametrize("head_dim,causal,n_k,name", [
    (64, True, 1024, "d64-persistent"), (128, False, 1024, "d128-n256-base"), (128, True, 1024, "d128-persistent"),
    (128, True, 4096, "d128-n256-base"), (256, True, 1024, "d256-n128")])
def test_the_gluon_kernel_per_head_dim_and_mask(head_dim, causal, n_k, name):
    """The e4m3 forward's kernel: the e4m3-only tiles at 128 and 256, but 128's 128-key blocks on
    short causal cells; every name is a kernel hopper can launch with FP8 (one column block)."""
    from flashrun.kernels.flash import fp8, hopper

    assert fp8.kernel_name(head_dim, causal, n_k) == name
    cfg = hopper.fp8_kernel(name)
    assert cfg.head_dim == head_dim and hopper.split_head_dim(head_dim)[1] == 0
