"""The Gluon sm_90 dK/dV backward's gate, wiring and first-use check (flashrun.kernels.flash.hopper_bwd).

No GPU here: the real gate must say no (off by default; with FLASHRUN_HOPPER_BWD=1 still no in the
interpreter), and the wiring in ``_attn_backward`` is tested by pretending the gate is on (as on an
H200 with the variable set) and injecting a kernel function as hopper_bwd.RUN: a float64 autograd
reference standing in for a correct kernel, or a failing or wrong one. The portable side of the
first-use check and the fallback are the real interpreted kernels. Whether the kernel compiles
for sm_90 is tests/compile_hopper_bwd.py's job (run below).
"""

import logging
import math
from pathlib import Path

import pytest
import torch

from flashrun.kernels.flash import attention as flash
from flashrun.kernels.flash import hopper as flash_hopper
from flashrun.kernels.flash import hopper_bwd
from flashrun.kernels.flash.args import alibi_slopes
from flashrun.kernels.flash.jit import UNBOUNDED


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    hopper_bwd.reset()
    monkeypatch.setattr(hopper_bwd, "CHECK_SHAPE", (1, 4, 2, 24, 20))  # smaller for the interpreter
    yield
    hopper_bwd.reset()


def _inputs(n=24, n_k=None, d=64, h=2, h_kv=2, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g).to(dtype)
    k = torch.randn(1, h_kv, n_k or n, d, generator=g).to(dtype)
    v = torch.randn(1, h_kv, n_k or n, d, generator=g).to(dtype)
    do = torch.randn(1, h, n, d, generator=g).to(dtype)
    return q, k, v, do


def _reference_dkdv(q, k, v, do, sm_scale, causal, window=None):
    """dK, dV by float64 autograd (GQA by repeating k/v heads; bottom-right causal or window)."""
    return _reference(q, k, v, do, sm_scale, causal, window)[1:]


def _reference(q, k, v, do, sm_scale, causal, window=None, softcap=0.0, alibi_slopes=None):
    """dQ, dK, dV by float64 autograd; ``window`` (left, right): query i sees keys
    [i + shift - left, i + shift + right], shift = N_K - N_Q; scores softcap·tanh(s / softcap),
    minus slope·|i + shift - j| with ALiBi (slopes (H,))."""
    with torch.enable_grad():  # (also where a stand-in kernel runs: inside autograd's backward)
        group = q.shape[1] // k.shape[1]
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        s = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) * sm_scale
        n_q, n_k = q.shape[2], k.shape[2]
        offset = torch.arange(n_k)[None, :] - (torch.arange(n_q)[:, None] + n_k - n_q)  # key j - query i's diagonal
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            s = s - alibi_slopes.double().view(-1, 1, 1) * offset.abs()
        if causal:
            s = s.masked_fill(offset > 0, -math.inf)
        if window is not None:
            s = s.masked_fill((offset < -window[0]) | (offset > window[1]), -math.inf)
        p = torch.nan_to_num(torch.softmax(s, -1))  # a row that sees no key: 0
        (p @ v64.repeat_interleave(group, 1)).backward(do.double())
    return q64.grad.to(q.dtype), k64.grad.to(k.dtype), v64.grad.to(v.dtype)


def _reference_kernel(calls):
    """Stands in for a correct Gluon kernel (hopper_bwd.RUN's signature): with ``dq``, the fused
    kernel, which adds dQ into that zeroed float32 buffer; with ``kv_out``, a split group's parts,
    which add dK and dV into those zeroed float32 buffers."""
    def run(q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None, window=None, kv_out=None,
            softcap=0.0, alibi_slopes=None):
        calls.append((tuple(q.shape), causal, cfg, split, dq is not None, window, softcap, alibi_slopes is not None))
        ref_dq, dk, dv = _reference(q, k, v, do, sm_scale, causal, window, softcap, alibi_slopes)
        if dq is not None:
            dq += ref_dq.float()
        if kv_out is None:
            return dk, dv
        for out, grad in zip(kv_out, (dk, dv)):
            out += grad.float()
        return kv_out
    return run


def _pretend_hopper(monkeypatch):
    """As on an H200 with triton 3.6: the real on/off switch, then every call in scope (float32 too,
    the interpreter's exact dtype, so that the check's comparison means something here)."""
    monkeypatch.setattr(hopper_bwd, "eligible", lambda q, k, v, do, variant, fused=False: (
        None if hopper_bwd.enabled() else "off") or hopper_bwd.variants_reason(q.shape[-1], fused, variant)
        or hopper_bwd._checked.get(hopper_bwd._key(q.dtype, q.shape[-1], fused, variant)))
    monkeypatch.setitem(hopper_bwd.CHECK_ATOL, torch.float32, 1e-4)


def _backward(q, k, v, do, causal=False, deterministic=True, window=(-1, -1)):
    variant = flash._variant(q, q.shape[0], k.shape[2], causal, window, 0.0, None)
    sm_scale = q.shape[-1] ** -0.5
    o, lse = flash._attn_forward(q, k, v, sm_scale, variant, "default", try_gluon=False)
    return flash._attn_backward(do, q, k, v, o, lse, sm_scale, variant, "default", deterministic=deterministic)


# -- the real gate --------------------------------------------------------------------------------


def test_on_by_default_and_either_variable_turns_it_off(monkeypatch):
    q, k, v, do = _inputs(dtype=torch.bfloat16)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, None)
    monkeypatch.delenv("FLASHRUN_HOPPER_BWD", raising=False)
    monkeypatch.delenv("FLASHRUN_HOPPER", raising=False)
    assert hopper_bwd.DEFAULT_ON is True and hopper_bwd.enabled()
    monkeypatch.setenv("FLASHRUN_HOPPER", "0")  # both Gluon paths off, as for the forward
    assert not hopper_bwd.enabled()
    assert "FLASHRUN_HOPPER=0" in hopper_bwd.eligible(q, k, v, do, variant)
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")  # the general switch wins over the forced one
    assert not hopper_bwd.enabled()


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("0", False), ("off", False), ("", True)])
@pytest.mark.parametrize("default_on", [True, False])
def test_the_variable_turns_it_on_and_off(monkeypatch, value, on, default_on):
    monkeypatch.delenv("FLASHRUN_HOPPER", raising=False)
    monkeypatch.setattr(hopper_bwd, "DEFAULT_ON", default_on)
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", value)
    assert hopper_bwd.enabled() is (on if value else default_on)


def test_on_still_needs_an_sm90_gpu(monkeypatch):
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    q, k, v, do = _inputs(dtype=torch.float16)
    variant = flash._variant(q, 1, k.shape[2], False, (-1, -1), 0.0, None)
    assert hopper_bwd.eligible(q, k, v, do, variant) == "Triton's interpreter"
    monkeypatch.setattr(hopper_bwd, "INTERPRETED", False)
    assert hopper_bwd.eligible(q, k, v, do, variant) == "not an sm_90 GPU"  # CPU tensors


@pytest.mark.parametrize("change,why", [
    (dict(dtype=torch.float32), "dtype"), (dict(d=96), None), (dict(d=80, causal=True), None),
    (dict(d=112), "head_dim 112"), (dict(d=192), None), (dict(d=160), "head_dim 160"),
    (dict(d=256), None), (dict(d=320), "head_dim 320"),
    (dict(window=(8, 0)), None), (dict(window=(3, 5), causal=False), None),
    (dict(softcap=5.0), None), (dict(alibi=True), None), (dict(d=192, alibi=True), "ALiBi at head_dim 192"),
    (dict(d=256, softcap=5.0), None),
    (dict(strided_do=True), "aligned"), (dict(expanded_kv=True), "aligned"),
    (dict(), None), (dict(d=128, causal=True, h=8, h_kv=2, n_k=40), None), (dict(model_view=True), None)])
def test_scope(change, why, monkeypatch):
    monkeypatch.delenv(hopper_bwd.VARIANTS_ENV, raising=False)
    d, dtype = change.get("d", 64), change.get("dtype", torch.bfloat16)
    q, k, v, do = _inputs(d=d, dtype=dtype, h=change.get("h", 2), h_kv=change.get("h_kv", 2), n_k=change.get("n_k"))
    if change.get("strided_do"):
        do = torch.empty(1, 2, 24, d + 4, dtype=dtype)[..., :d]  # rows of d + 4 elements: not 16-byte strides
    if change.get("expanded_kv"):
        k = k[:, :1].expand(1, 2, *k.shape[2:])  # stride 0: no TMA descriptor
    if change.get("model_view"):  # a model's (B, N, H, D) storage seen as (B, H, N, D)
        q, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, do))
    slopes = torch.ones(2) if change.get("alibi") else None
    variant = flash._variant(q, 1, k.shape[2], change.get("causal", False), change.get("window", (-1, -1)),
                             change.get("softcap", 0.0), slopes)
    reason = hopper_bwd.scope(q, k, v, do, variant)
    assert reason is None if why is None else why in reason


def test_gluon_api_feature_check_never_raises():
    reason = flash_hopper.gluon_api()
    assert reason is None or isinstance(reason, str)


# -- the wiring in _attn_backward ------------------------------------------------------------------


@pytest.mark.parametrize("env", ["FLASHRUN_HOPPER_BWD", "FLASHRUN_HOPPER"])
def test_turned_off_keeps_the_portable_kernel(monkeypatch, env):
    monkeypatch.setenv(env, "0")
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(hopper_bwd, "RUN", lambda *a: pytest.fail("the Gluon kernel ran"))
    q, k, v, do = _inputs()
    dq, dk, dv = _backward(q, k, v, do, causal=True)
    assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
    ref_dk, ref_dv = _reference_dkdv(q, k, v, do, 64 ** -0.5, True)
    torch.testing.assert_close(dk, ref_dk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, ref_dv, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [dict(n=24), dict(n=30, n_k=20, h=4, h_kv=2)])
def test_variable_set_takes_the_path_after_its_check(monkeypatch, caplog, shape):
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    q, k, v, do = _inputs(**shape)
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        dq, dk, dv = _backward(q, k, v, do, causal=True)
    assert not [r for r in caplog.records if r.name == "flashrun.hopper"]
    assert hopper_bwd.LAST_PATH == flash_hopper.GLUON_PATH
    # the first-use check's two cases (full, then causal through the GQA split), then the call itself,
    # its group spread by the portable kernel's rule with the Gluon kernel's threshold
    split = flash._kv_split(k.shape[0] * k.shape[1], q.shape[1] // k.shape[1], q.device, hopper_bwd.SPLIT_WAVES)
    assert [(c[1], c[3], c[4], c[5]) for c in calls] == [(False, 1, False, None), (True, 2, False, None),
                                                         (True, split, False, None)]
    assert calls[-1][0] == tuple(q.shape) and calls[-1][2] == hopper_bwd.KERNELS["d64"]
    ref_dk, ref_dv = _reference_dkdv(q, k, v, do, 64 ** -0.5, True)
    torch.testing.assert_close(dk, ref_dk)
    torch.testing.assert_close(dv, ref_dv)
    # dQ is still the portable kernel's
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "0")
    expected = _backward(q, k, v, do, causal=True)
    assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
    torch.testing.assert_close(dq, expected[0], atol=0, rtol=0)
    assert len(calls) == 3


def test_atomic_backward_takes_the_fused_kernel(monkeypatch, caplog):
    """deterministic=False: the Gluon kernel with dQ inside (its own first-use check, dQ compared
    too), not the Triton atomic kernel; dQ comes out of the float32 buffer the kernel added into."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    q, k, v, do = _inputs(n=30, n_k=20, h=4, h_kv=2)
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        dq, dk, dv = _backward(q, k, v, do, causal=True, deterministic=False)
    assert not [r for r in caplog.records if r.name == "flashrun.hopper"]
    assert hopper_bwd.LAST_PATH == hopper_bwd.FUSED_PATH
    assert [c[4] for c in calls] == [True, True, True]  # the check's two cases, then the call
    assert calls[-1][2] == hopper_bwd.KERNELS[hopper_bwd.FUSED[64]]
    for got, ref in zip((dq, dk, dv), _reference(q, k, v, do, 64 ** -0.5, True)):
        torch.testing.assert_close(got, ref)
    assert dq.dtype == q.dtype


def test_a_wrong_fused_kernel_leaves_the_atomic_backward_to_triton(monkeypatch, caplog):
    """A fused kernel whose dQ is wrong (dK, dV right) fails its own check, once: the atomic
    backward falls back to the Triton kernel while the deterministic one keeps its Gluon dK/dV."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    right = _reference_kernel([])

    def no_dq(q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None, window=None, kv_out=None):
        return right(q, k, v, do, lse, delta, sm_scale, causal, cfg, split, window=window, kv_out=kv_out)  # no dq

    monkeypatch.setattr(hopper_bwd, "RUN", no_dq)
    q, k, v, do = _inputs()
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    for _ in range(2):
        dq, _, _ = _backward(q, k, v, do, causal=True, deterministic=False)
        assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
        torch.testing.assert_close(dq, _reference(q, k, v, do, 64 ** -0.5, True)[0], atol=1e-4, rtol=1e-4)
    warnings = [r.getMessage() for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(warnings) == 1 and "max |ddQ|" in warnings[0], warnings
    _backward(q, k, v, do, causal=True)
    assert hopper_bwd.LAST_PATH == flash_hopper.GLUON_PATH


@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa-split-adds"])
def test_the_fused_backward_lays_its_gradients_out_as_a_model_passes_its_inputs(monkeypatch, h_kv):
    """q, k, v as a model passes them ((B, N, H, D) projections seen as (B, H, N, D)): dQ, dK, dV
    come back in that layout (the model's backward then reshapes them without a copy), right,
    whether dK and dV come from the kernel (one part per group) or from the float32 buffer that a
    split group's parts add into beside dQ's (one fill, one cast for all three)."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(2, 30, 4, 64, generator=g).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, 20, h_kv, 64, generator=g).transpose(1, 2) for _ in range(2))
    dq, dk, dv = _backward(q, k, v, do, causal=True, deterministic=False)
    assert hopper_bwd.LAST_PATH == hopper_bwd.FUSED_PATH and calls[-1][3] == (1 if h_kv == 4 else 2)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), k.stride())
    for got, ref in zip((dq, dk, dv), _reference(q, k, v, do, 64 ** -0.5, True)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref)


def test_carved_views_are_zeroed_disjoint_aligned_and_laid_out_like_their_tensors():
    like = (torch.empty(2, 7, 3, 5).transpose(1, 2), torch.empty(2, 1, 7, 5), torch.empty(3, 4)[:, :3])
    buffer, views = hopper_bwd._carved(like, torch.float32)
    assert not buffer.any()
    for view, t in zip(views, like):
        assert view.shape == t.shape and view.storage_offset() % 32 == 0
        assert view.stride() == torch.empty_like(t).stride()
    for mark, view in enumerate(views, 1):
        view.fill_(mark)
    for mark, view in enumerate(views, 1):  # no view overlaps another
        assert bool((view == mark).all())


def test_a_backward_route_decides_the_path_once_until_a_switch_changes(monkeypatch):
    """Through autograd the backward keeps, per forward route key and dO's layout, whether the
    Gluon kernel with dQ inside runs it: repeat calls skip the gate; turning the path off (the
    variable, or a reset) decides again."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    gated = []
    applies = hopper_bwd.applies
    monkeypatch.setattr(hopper_bwd, "applies", lambda *args, **kwargs: gated.append(1) or applies(*args, **kwargs))
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel([]))
    q, k, v, do = _inputs(n=30, n_k=20)

    def call():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        flash.flash_attention(qg, kg, vg, causal=True, deterministic=False).backward(do)
        return qg.grad
    ref = _reference(q, k, v, do, 64 ** -0.5, True)[0]
    for expected in (1, 1):
        torch.testing.assert_close(call(), ref)
        assert hopper_bwd.LAST_PATH == hopper_bwd.FUSED_PATH and len(gated) == expected
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "0")
    torch.testing.assert_close(call(), ref, atol=1e-4, rtol=1e-4)
    assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH and len(gated) == 2
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    hopper_bwd.reset()
    call()
    assert hopper_bwd.LAST_PATH == hopper_bwd.FUSED_PATH and len(gated) == 3


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_failed_check_falls_back_once(monkeypatch, caplog, broken):
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []

    def bad_kernel(q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None, window=None):
        calls.append(causal)
        if broken == "raises":
            raise RuntimeError("PassManager::run failed")
        return torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(hopper_bwd, "RUN", bad_kernel)
    q, k, v, do = _inputs()
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    for _ in range(2):
        _, dk, dv = _backward(q, k, v, do, causal=True)
        assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
        ref_dk, ref_dv = _reference_dkdv(q, k, v, do, 64 ** -0.5, True)
        torch.testing.assert_close(dk, ref_dk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dv, ref_dv, atol=1e-4, rtol=1e-4)
    warnings = [r.getMessage() for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(warnings) == 1, warnings
    assert "portable Triton kernel is used" in warnings[0]
    assert ("raised RuntimeError" if broken == "raises" else "disagrees") in warnings[0]
    assert calls == [False]  # stopped at the first failing case, never called again


def test_compiling_ahead_runs_no_check(monkeypatch):
    """In compile-only mode the check's launches are handed over and nothing is compared; the
    check itself runs on the first real call."""
    from flashrun.kernels import tuning

    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(hopper_bwd, "RUN", lambda q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None,
                        window=None: (
        torch.zeros_like(k), torch.zeros_like(v)))
    handed = []
    q, k, v, do = _inputs()
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel.__name__)):
        assert hopper_bwd.ensure_checked(q.device, q.dtype, 64, flash._portable_backward_check)
    assert hopper_bwd._checked == {}  # no verdict yet: a wrong kernel is still caught ...
    assert "_attn_bwd_dkdv" in handed and "_attn_bwd_dq" in handed  # (the portable side, compiled)
    _, dk, _ = _backward(q, k, v, do)
    assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH  # ... on the first real call
    assert "disagrees" in hopper_bwd._checked[(torch.float32, 64, False, False, False, False)]


@pytest.mark.parametrize("deterministic", [True, False], ids=["dkdv", "fused"])
def test_a_window_takes_the_path_after_its_own_check(monkeypatch, caplog, deterministic):
    """A windowed call is checked apart (two windows) from the plain and causal ones, so a call
    without a window never compiles the window's kernels; the kernel gets the window as the
    variant holds it (an unbounded side as UNBOUNDED)."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    q, k, v, do = _inputs(n=30, n_k=20, h=4, h_kv=2)
    _backward(q, k, v, do, causal=True, deterministic=deterministic)
    assert [c[5] for c in calls] == [None, None, None]
    caplog.clear()  # (the causal check's line, shown where an earlier test left the logger at INFO)
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        dq, dk, dv = _backward(q, k, v, do, window=(7, -1), deterministic=deterministic)
    assert not [r for r in caplog.records if r.name == "flashrun.hopper" and r.levelno >= logging.WARNING]
    assert hopper_bwd.LAST_PATH == (flash_hopper.GLUON_PATH if deterministic else hopper_bwd.FUSED_PATH)
    masks = [w for _, w, _ in hopper_bwd.CHECK_MASKS[True]]
    assert [(c[1], c[5]) for c in calls[3:]] == [(False, masks[0]), (False, masks[1]), (False, (7, UNBOUNDED))]
    for got, ref in zip((dq, dk, dv), _reference(q, k, v, do, 64 ** -0.5, False, (7, UNBOUNDED))):
        torch.testing.assert_close(got, ref)


def test_a_kernel_that_ignores_the_window_fails_the_window_check_only(monkeypatch, caplog):
    """A kernel right without a window but blind to one: the windowed calls fall back (once, with
    the reason), while causal calls keep the Gluon path."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    right = _reference_kernel([])

    def blind(q, k, v, do, lse, delta, sm_scale, causal, cfg, split=1, dq=None, window=None):
        return right(q, k, v, do, lse, delta, sm_scale, causal, cfg, split, dq)

    monkeypatch.setattr(hopper_bwd, "RUN", blind)
    q, k, v, do = _inputs()
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    for _ in range(2):
        _, dk, dv = _backward(q, k, v, do, window=(5, 0))
        assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
        torch.testing.assert_close(dk, _reference_dkdv(q, k, v, do, 64 ** -0.5, False, (5, 0))[0], atol=1e-4, rtol=1e-4)
    warnings = [r.getMessage() for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(warnings) == 1 and "with a window" in warnings[0] and "window (37, 5)" in warnings[0], warnings
    _backward(q, k, v, do, causal=True)
    assert hopper_bwd.LAST_PATH == flash_hopper.GLUON_PATH


# -- the launcher (host side only) ------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 17, 1])
def test_lse_rows_a_descriptor_can_read(n):
    lse = torch.randn(2, 3, n)
    out = hopper_bwd.rows_aligned(lse)
    torch.testing.assert_close(out, lse, atol=0, rtol=0)
    assert out.stride(2) == 1 and all(s * 4 % 16 == 0 for s in out.stride()[:2])
    assert (out.data_ptr() == lse.data_ptr()) == (n % 4 == 0)  # a copy only when the rows are not aligned


@pytest.mark.parametrize("name", list(hopper_bwd.KERNELS))
def test_every_kernel_fits_an_sm(name):
    cfg = hopper_bwd.KERNELS[name]
    assert hopper_bwd.smem_bytes(cfg) <= hopper_bwd.SMEM_LIMIT - 2048
    assert hopper_bwd.launched_threads(cfg) * cfg.maxnreg <= 65536
    assert cfg.consumers * 128 * cfg.consumer_regs + 128 * cfg.producer_regs <= 65536
    assert cfg.stages >= 2 and cfg.head_dim in hopper_bwd.HEAD_DIMS


@pytest.mark.parametrize("routes", ["DEFAULT", "FUSED"])
def test_the_routes_name_kernels_for_their_head_dims(routes):
    table = getattr(hopper_bwd, routes)
    assert all(hopper_bwd.KERNELS[name].head_dim == d for d, name in table.items())


def test_a_head_dim_without_a_route_stays_portable():
    """256 has a dK/dV kernel and none with dQ inside: the fused backward is out of scope there."""
    q = torch.empty(1, 2, 64, 256, dtype=torch.bfloat16)
    variant = flash._variant(q, 1, q.shape[2], True, (-1, -1), 0.0, None)
    assert hopper_bwd.scope(q, q, q, q, variant, False) is None
    assert hopper_bwd.scope(q, q, q, q, variant, True) == "head_dim 256 with dQ inside"


@pytest.mark.parametrize("name", sorted(set(hopper_bwd.FUSED.values())))
def test_every_fused_kernel_fits_an_sm(name):
    cfg = hopper_bwd.KERNELS[name]
    assert hopper_bwd.fusable(cfg)
    assert cfg.consumers == 2
    if cfg.transposed:  # whole steps in turns, DQ_COLS columns at a time, tiling both column blocks
        assert cfg.dq_cols == (hopper_bwd.DQ_COLS,) and all(b % hopper_bwd.DQ_COLS == 0 for b in cfg.blocks)
        return
    # whole steps in turns, half the columns each, or (a head dim of two blocks) a block each
    assert cfg.dq_cols in ((cfg.head_dim,), (cfg.head_dim // 2,) * 2, cfg.blocks)
    assert cfg.blocks[1] == 0 or cfg.dq_cols == cfg.blocks


@pytest.mark.skipif(flash_hopper.gluon_api() is not None, reason="this Triton lacks the Gluon Hopper API")
@pytest.mark.parametrize("shape,split,grid", [
    ((2, 8, 1000, 128), 1, (8, 2, 2)),  # q (B, H, N, D), k/v heads 2: GQA 4:1
    ((2, 8, 1000, 128), 2, (8, 4, 2)),
    ((1, 2, 17, 64), 1, (1, 2, 1)),
    ((2, 8, 1000, 96), 2, (8, 4, 2)),  # two column blocks, 64 + 32
    ((1, 2, 300, 80), 1, (3, 2, 1)),
    ((2, 8, 1000, 192), 2, (16, 4, 2))])  # 128 + 64, transposed: 64-key blocks of two 32-key consumers
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_launch_grid_and_descriptors(shape, split, grid, causal):
    # (key blocks, k/v heads x split, batch); causal: the key blocks last, so that the programs
    # start every head's first (heaviest) blocks first
    from flashrun.kernels.flash.hopper_bwd_jit import DQ_COLS

    assert DQ_COLS == hopper_bwd.DQ_COLS  # (kept in both: the configs import no Triton)
    z, h, n, d = shape
    cfg = hopper_bwd.KERNELS[hopper_bwd.kernel_for(d)]
    q = torch.empty(shape, dtype=torch.bfloat16)
    k = torch.empty(z, 2 if h == 8 else h, n, d, dtype=torch.bfloat16)
    lse = torch.empty(z, h, n)
    dk = torch.empty(z, k.shape[1] * split, n, d, dtype=torch.float32 if split > 1 else k.dtype)
    got, args, constexprs, options = hopper_bwd.launch_args(q, k, k, q, lse, lse, dk, dk, 0.1, causal, cfg, split)
    assert got == ((*grid[1:], grid[0]) if causal else grid)
    assert constexprs["GROUP"] == h // k.shape[1] // split and constexprs["KV_SPLIT"] == split
    d0, d1 = cfg.blocks
    assert (d0, d1) == {64: (64, 0), 128: (128, 0), 96: (64, 32), 80: (64, 16), 192: (128, 64)}[d]
    keys = 32 if d == 192 else 64  # each consumer's K and V rows
    assert [list(a.block_shape) for a in args[:6]] == [[1, 1, 64, d0], [1, 1, keys, d0], [1, 1, keys, d0],
                                                       [1, 1, 64, d0], [1, 1, 64], [1, 1, 64]]
    # the second column block's q, k, v, dO (loaded from column HEAD_D), and no dQ
    assert [a if a is None else list(a.block_shape) for a in args[7:12]] == (
        [[1, 1, 64, d1], [1, 1, keys, d1], [1, 1, keys, d1], [1, 1, 64, d1], None] if d1 else [None] * 5)
    assert all(a.base is t for a, t in zip(args[7:11], (q, k, k, q)) if d1)
    assert (constexprs["HEAD_D"], constexprs["HEAD_D1"]) == (d0, d1)
    # the gradients themselves (split 1, k's dtype): the producer stores them through dK's and dV's
    # descriptors, boxes as K's (TMA_OUT); float32 partials go out by the consumers' stores
    out = split == 1
    assert constexprs["TMA_OUT"] is out
    assert [a if a is None else (list(a.block_shape), a.base is dk) for a in args[12:16]] == (
        [([1, 1, keys, d0], True)] * 2 + [([1, 1, keys, d1], True) if d1 else None] * 2 if out else [None] * 4)
    # the per-call arguments, then dK's strides, N_Q, N_K, the scales, the window, the softcap and ALiBi's
    assert args[16] is dk and args[17] is dk and len(args) - 13 == hopper_bwd.PER_CALL
    assert args[-4:] == (0.0, None, 0, 0) and constexprs["SOFTCAP"] is constexprs["ALIBI"] is False
    assert list(args[4].shape) == [z, h, n]  # LSE's rows end at N_Q even when padded
    assert options == {"num_warps": 4, "maxnreg": cfg.maxnreg}
    assert args[6] is None and constexprs["FUSED_DQ"] is False and constexprs["KV_ADD"] == 0
    if split > 1:  # the parts add into one float32 head: the kernel is told over how many they spread
        summed = torch.zeros(k.shape, dtype=torch.float32)
        _, _, constexprs, _ = hopper_bwd.launch_args(q, k, k, q, lse, lse, summed, summed, 0.1, True, cfg, split,
                                                     adds=True)
        assert constexprs["KV_ADD"] == split and constexprs["KV_SPLIT"] == split
    with pytest.raises(ValueError, match="split"):
        hopper_bwd.launch_args(q, k, k, q, lse, lse, dk, dk, 0.1, True, cfg, 3)
    fused = hopper_bwd.KERNELS[hopper_bwd.kernel_for(d, fused=True)]
    dq = torch.zeros(shape)
    _, args, constexprs, _ = hopper_bwd.launch_args(q, k, k, q, lse, lse, dk, dk, 0.1, True, fused, split, dq)
    assert constexprs["FUSED_DQ"] is True and list(args[6].block_shape) == [1, 1, 64, fused.dq_cols[0]]
    assert list(args[6].shape) == list(shape)
    # a head dim of two blocks: consumer 1 adds dQ's second block through its own descriptor (the
    # transposed kernel: one DQ_COLS-column descriptor tiles both)
    if d1 and not fused.transposed:
        assert list(args[11].block_shape) == [1, 1, 64, d1] and args[11].base is dq
    else:
        assert args[11] is None
    if split > 1:  # with dQ inside, a split's parts add by TMA through each consumer's dQ tile
        # (one column block, keys as rows: else by the consumers' atomics)
        summed = torch.zeros(k.shape, dtype=torch.float32)
        _, args, constexprs, _ = hopper_bwd.launch_args(q, k, k, q, lse, lse, summed, summed, 0.1, True, fused,
                                                        split, dq, adds=True)
        by_tma = not d1 and not fused.transposed
        assert constexprs["TMA_OUT"] is by_tma and constexprs["KV_ADD"] == split
        assert [a if a is None else (list(a.block_shape), a.base is summed) for a in args[12:16]] == (
            [([1, 1, 64, fused.dq_cols[0]], True)] * 2 + [None] * 2 if by_tma else [None] * 4)
        assert not by_tma or args[12].layout == args[6].layout  # (the tile's layout is dQ's)


def test_compiles_for_hopper(python):
    """Every kernel in KERNELS compiles for sm_90, without and with dQ inside (fp16 full GQA 1:1,
    bf16 causal GQA 4:1 split into partials and GQA 6:1 split adding into one head, fp16 window,
    and where the kernel takes them bf16 softcap + ALiBi with a window: each dtype, mask and output
    once; the script without --pairs compiles them all) with no spill,
    no C7515, no wgmma wait beyond the kernel's own (skips where this Triton lacks the Gluon Hopper
    API or a CUDA backend)."""
    result = python(str(Path(__file__).parent / "compile_hopper_bwd.py"), "--pairs")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # each kernel as the deterministic backward's dK/dV and with dQ inside
    kernels = len(hopper_bwd.KERNELS) + sum(map(hopper_bwd.fusable, hopper_bwd.KERNELS.values()))
    # and softcap + ALiBi with a window (bf16 GQA 4:1 split) where the kernel takes them
    variants = sum(hopper_bwd.takes_variants(cfg, window=True) * (1 + hopper_bwd.fusable(cfg))
                   for cfg in hopper_bwd.KERNELS.values())
    assert result.stdout.count("ok ") == 4 * kernels + variants  # --pairs: full, causal (two GQA splits), a window
    assert "wgmma 0 " not in result.stdout and "tma 0 " not in result.stdout


def test_the_gluon_dq_kernel_compiles_for_hopper(python):
    """The Gluon dQ kernel (hopper_dq_jit) at each of its head dims, fp16
    and bf16, full and causal, GQA 1:1 and 4:1, with a softcap and without, compiles for sm_90 in
    its shared memory without a spill, a serialized wgmma or a wait beyond its own two per step."""
    result = python(str(Path(__file__).parent / "compile_hopper_bwd.py"), "--gluon-dq")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 16 * len(hopper_bwd.DQ_KERNELS), result.stdout


def test_the_gluon_dq_kernel_runs_on_sm90_unless_turned_off_and_launches_per_query_tile(monkeypatch):
    """Never outside an sm_90 GPU, and off with FLASHRUN_HOPPER_BWD_DQ=0; its launch: one program
    per 128 query rows and (batch, head), the GQA group and the scales as the portable dQ takes them."""
    q, k, v, do = _inputs(d=256, dtype=torch.bfloat16)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, None)
    monkeypatch.setenv(hopper_bwd.DQ_ENV, "0")
    assert "off" in hopper_bwd.gluon_dq_reason(q, k, v, do, variant)
    monkeypatch.delenv(hopper_bwd.DQ_ENV)
    assert "sm_90" in hopper_bwd.gluon_dq_reason(q, k, v, do, variant)
    lse = torch.zeros(q.shape[:3])
    grid, args, constexprs, _ = hopper_bwd.dq_launch_args(q, k, v, do, lse, lse, q, 0.0625, True,
                                                          hopper_bwd.DQ_KERNELS[256])
    assert grid == (-(-q.shape[2] // 128), q.shape[0] * q.shape[1])
    assert constexprs["GROUP"] == q.shape[1] // k.shape[1] and constexprs["CAUSAL"] is True
    assert args[-3:] == (0.0625 * 1.4426950408889634, 0.0625, 0.0) and constexprs["SOFTCAP"] is False
    _, args, constexprs, _ = hopper_bwd.dq_launch_args(q, k, v, do, lse, lse, q, 0.0625, True,
                                                       hopper_bwd.DQ_KERNELS[256], softcap=50.0)
    assert args[-3:] == (0.0625 / 50.0, 0.0625, 50.0 * 1.4426950408889634) and constexprs["SOFTCAP"] is True


@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_the_gluon_dq_kernel_runs_after_its_own_first_use_check(monkeypatch, caplog, right, softcap):
    """Where the Gluon dQ kernel applies: its first-use check (against the
    portable backward's dQ, at the check's cap with a softcap) runs once, then the kernel computes
    the deterministic backward's dQ; a kernel that disagrees is off for the process, with a
    warning, and the portable dQ kernel runs. Either way the gradients are the reference's."""
    monkeypatch.delenv(hopper_bwd.DQ_ENV, raising=False)
    monkeypatch.setitem(hopper_bwd.CHECK_ATOL, torch.float32, 1e-4)
    monkeypatch.setattr(hopper_bwd, "_checked", {})
    monkeypatch.setattr(hopper_bwd, "gluon_dq_reason", lambda *args: None)  # as on an H200
    calls = []

    def standin(q, k, v, do, lse, delta, dq, sm_scale, causal, softcap=0.0):
        calls.append(softcap)
        dq.copy_(_reference(q, k, v, do, sm_scale, causal, None, softcap)[0] * (1.0 if right else 1.05))

    monkeypatch.setattr(hopper_bwd, "gluon_dq", standin)
    q, k, v, do = _inputs(n=30, n_k=20, h=4, h_kv=2)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), softcap, None)
    o, lse = flash._attn_forward(q, k, v, 0.125, variant, "default", try_gluon=False)
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    for _ in range(2):
        dq, dk, dv = flash._attn_backward(do, q, k, v, o, lse, 0.125, variant, deterministic=True)
        for got, ref in zip((dq, dk, dv), _reference(q, k, v, do, 0.125, True, None, softcap)):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    checked = hopper_bwd._checked[(q.dtype, q.shape[-1], "dq", softcap > 0)]
    assert (checked is None) == right
    assert calls[0] == (hopper_bwd.CHECK_SOFTCAP if softcap else 0.0)  # the check, at its own cap
    if right:
        assert calls[-2:] == [softcap, softcap] and len(calls) == 4  # checked once (full, causal), then each call
    else:
        assert len(calls) == 1 and "dQ backward" in caplog.text and "disagrees" in caplog.text


def test_a_backward_first_use_in_the_background_keeps_no_route_until_decided(monkeypatch):
    """The library's default on a GPU: the fused backward's first use hands its check's launches
    and the call's own to the compile pool and runs the Triton atomic backward, deciding nothing
    and keeping no route, until those compiles are ready; then the fused Gluon kernel takes it."""
    from flashrun.kernels import warmup

    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    ready = warmup.Compile("check", None)

    class Batch:
        def collect(self, launches):
            from flashrun.kernels import tuning

            with tuning.compile_only(lambda kernel, grid, args, kwargs: None):
                launches()
            return [ready]

        def wait(self, kernels):
            pass

    monkeypatch.setattr(warmup, "Batch", Batch)
    monkeypatch.setattr(flash_hopper, "background", lambda: True)
    q, k, v, do = _inputs(n=30, n_k=20, h=4, h_kv=2)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, None)
    o, lse = flash._attn_forward(q, k, v, 0.125, variant, "default", try_gluon=False)
    routes = {}
    monkeypatch.setattr(flash, "_backward_routes", routes)
    for _ in range(2):
        flash._attn_backward(do, q, k, v, o, lse, 0.125, variant, deterministic=False, key=("call",))
        assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH and not routes and hopper_bwd._checked == {}
    assert [c[4] for c in calls] == [True, True, True]  # compile-only: the check's two cases and the call
    ready.ready.set()
    flash._attn_backward(do, q, k, v, o, lse, 0.125, variant, deterministic=False, key=("call",))
    assert hopper_bwd.LAST_PATH == hopper_bwd.FUSED_PATH and list(routes.values()) == [True]


# -- softcap and ALiBi ----------------------------------------------


@pytest.mark.parametrize("change,fused,why", [
    (dict(softcap=5.0), False, None), (dict(alibi=True), False, None), (dict(softcap=5.0, alibi=True), True, None),
    (dict(softcap=300.0), False, "precise tanh"), (dict(softcap=5.0, d=192), False, None), (dict(alibi=True, d=192), False, "ALiBi at head_dim 192"),
    (dict(alibi=True, d=128), True, None), (dict(alibi=True, d=128, window=(9, 2)), True, "with dQ inside"),
    (dict(alibi=True, d=128, window=(9, 2)), False, None), (dict(softcap=5.0, d=128, window=(9, 2)), True, None),
    (dict(softcap=5.0, alibi=True, d=96, window=(9, 2)), True, "with dQ inside"), (dict(softcap=5.0, d=96), True, None)])
def test_the_variants_scope_once_turned_on(monkeypatch, change, fused, why):
    """Softcap and ALiBi run on the untransposed kernels, the fast tanh's caps; on the kernels that
    split dQ's columns between the consumers all but ALiBi with a window (timed slower there)."""
    monkeypatch.setenv(hopper_bwd.VARIANTS_ENV, "1")
    monkeypatch.delenv(hopper_bwd.FUSED_VARIANTS_ENV, raising=False)
    d = change.get("d", 64)
    q, k, v, do = _inputs(d=d, dtype=torch.bfloat16)
    slopes = torch.ones(2) if change.get("alibi") else None
    variant = flash._variant(q, 1, k.shape[2], True, change.get("window", (-1, -1)), change.get("softcap", 0.0), slopes)
    reason = hopper_bwd.scope(q, k, v, do, variant, fused)
    assert reason is None if why is None else why in reason, reason


@pytest.mark.parametrize("d", [80, 96, 128])
@pytest.mark.parametrize("value,takes", [("1", (True, True)), ("on", (True, True)), ("0", (False, False)),
                                         ("", (True, False))], ids=["1", "on", "0", "unset"])
def test_the_kernels_that_split_dq_take_the_variants_as_asked(monkeypatch, d, value, takes):
    """FLASHRUN_HOPPER_BWD_FUSED_VARIANTS: =1 softcap and ALiBi on the kernels with dQ inside that
    split its columns (80, 96, 128) with or without a window, =0 neither, unset all but ALiBi
    with a window; the deterministic backward's kernels take them either way."""
    monkeypatch.setenv(hopper_bwd.VARIANTS_ENV, "1")
    monkeypatch.setenv(hopper_bwd.FUSED_VARIANTS_ENV, value)
    q, k, v, do = _inputs(d=d, dtype=torch.bfloat16)
    for softcap, slopes, window in ((5.0, None, (-1, -1)), (0.0, torch.ones(2), (-1, -1)), (0.0, torch.ones(2), (9, 2))):
        variant = flash._variant(q, 1, k.shape[2], True, window, softcap, slopes)
        assert hopper_bwd.scope(q, k, v, do, variant, False) is None
        reason = hopper_bwd.scope(q, k, v, do, variant, True)
        expected = takes[1] if window != (-1, -1) else takes[0]
        assert reason is None if expected else "with dQ inside" in reason, reason


@pytest.mark.parametrize("variants", [dict(softcap=2.0), dict(alibi=True), dict(softcap=2.0, alibi=True, window=(9, 2))],
                         ids=["softcap", "alibi", "both+window"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["dkdv", "fused"])
def test_variants_take_the_gluon_backward_and_its_check_covers_them(monkeypatch, variants, deterministic):
    """With the variants on, a softcap or ALiBi backward runs its own first-use check (the variant
    at the check's cap and slopes) and then the Gluon kernel, whose results match the reference;
    the plain backward's verdict is not theirs."""
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    monkeypatch.setenv(hopper_bwd.VARIANTS_ENV, "1")
    _pretend_hopper(monkeypatch)
    calls = []
    monkeypatch.setattr(hopper_bwd, "RUN", _reference_kernel(calls))
    q, k, v, do = _inputs(n=30, n_k=20, h=4, h_kv=2)
    slopes = alibi_slopes(4) if variants.get("alibi") else None
    window = variants.get("window", (-1, -1))
    variant = flash._variant(q, 1, k.shape[2], window == (-1, -1), window, variants.get("softcap", 0.0), slopes)
    o, lse = flash._attn_forward(q, k, v, 0.125, variant, "default", try_gluon=False)
    dq, dk, dv = flash._attn_backward(do, q, k, v, o, lse, 0.125, variant, deterministic=deterministic)
    assert hopper_bwd.LAST_PATH == (flash_hopper.GLUON_PATH if deterministic else hopper_bwd.FUSED_PATH)
    checked, call = calls[:-1], calls[-1]
    assert checked and all(c[6] == (hopper_bwd.CHECK_SOFTCAP if "softcap" in variants else 0.0) for c in checked)
    assert all(c[7] == ("alibi" in variants) for c in calls)
    assert call[6] == variants.get("softcap", 0.0)
    want = _reference(q, k, v, do, 0.125, window == (-1, -1), None if window == (-1, -1) else window,
                      variants.get("softcap", 0.0), slopes)
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_kernel_that_drops_the_softcap_fails_its_check_and_the_portable_backward_runs(monkeypatch, caplog):
    monkeypatch.setenv("FLASHRUN_HOPPER_BWD", "1")
    monkeypatch.setenv(hopper_bwd.VARIANTS_ENV, "1")
    _pretend_hopper(monkeypatch)
    right = _reference_kernel([])

    def no_softcap(*args, softcap=0.0, **kwargs):
        return right(*args, **kwargs)

    monkeypatch.setattr(hopper_bwd, "RUN", no_softcap)
    q, k, v, do = _inputs()
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 2.0, None)
    o, lse = flash._attn_forward(q, k, v, 0.125, variant, "default", try_gluon=False)
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    dq, dk, dv = flash._attn_backward(do, q, k, v, o, lse, 0.125, variant, deterministic=True)
    assert hopper_bwd.LAST_PATH == flash_hopper.TRITON_PATH
    assert any("with a softcap" in r.getMessage() for r in caplog.records)
    for got, ref in zip((dq, dk, dv), _reference(q, k, v, do, 0.125, True, None, 2.0)):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    plain = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, None)
    assert hopper_bwd._checked.get(hopper_bwd._key(q.dtype, 64, False, plain)) is None  # the plain path's own verdict


def test_the_variants_turn_off(monkeypatch):
    q, k, v, do = _inputs(d=64, dtype=torch.bfloat16, h=2, h_kv=2, n_k=None)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 5.0, None)
    monkeypatch.setenv(hopper_bwd.VARIANTS_ENV, "0")
    assert "FLASHRUN_HOPPER_BWD_VARIANTS=0" in hopper_bwd.scope(q, k, v, do, variant)


def test_the_transposed_kernel_takes_a_softcap_not_alibi(monkeypatch):
    q, k, v, do = _inputs(d=256, dtype=torch.bfloat16, h=2, h_kv=2, n_k=None)
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 30.0, None)
    monkeypatch.delenv(hopper_bwd.VARIANTS_ENV, raising=False)
    assert hopper_bwd.scope(q, k, v, do, variant) is None
    alibi = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, torch.ones(2))
    assert hopper_bwd.scope(q, k, v, do, alibi) == "ALiBi at head_dim 256"


def test_a_first_use_check_leaves_the_paths_the_checked_call_set(monkeypatch):
    """bench reports LAST_PATH after a cell's checked calls: the backward's first-use check runs a
    portable forward in between, which must not relabel the Gluon forward before it."""
    q, k, v, do = _inputs(d=64, dtype=torch.float16, h=2, h_kv=2, n_k=None)
    monkeypatch.setattr(flash_hopper, "LAST_PATH", flash_hopper.GLUON_PATH)
    monkeypatch.setattr(hopper_bwd, "LAST_PATH", hopper_bwd.FUSED_PATH)
    flash._portable_backward_check(q, k, v, do, 0.125, True)
    flash._portable_check(q, k, v, 0.125, True)
    assert (flash_hopper.LAST_PATH, hopper_bwd.LAST_PATH) == (flash_hopper.GLUON_PATH, hopper_bwd.FUSED_PATH)
