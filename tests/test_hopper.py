"""The Gluon sm_90 forward's gate and first-use check (flashrun.kernels.flash.hopper).

No GPU here: the gate must be off (interpreter, CPU), and its fallback logic is tested by
pretending the gate is on and injecting a failing or wrong kernel function as flash_hopper.RUN;
the "portable" side of the check and the fallback are the real interpreted ``_attn_fwd``.
Whether the kernel compiles for sm_90 is tests/compile_hopper.py's job (run below).
"""

import json
import logging
from pathlib import Path

import pytest
import torch

from flashrun.kernels.flash import attention as flash, hopper as flash_hopper


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    flash_hopper.reset()
    monkeypatch.setattr(flash_hopper, "CHECK_SHAPE", (1, 2, 40))  # the check's inputs, smaller for the interpreter
    yield
    flash_hopper.reset()


def _inputs(n=40, d=64, h=2, h_kv=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g)
    k = torch.randn(1, h_kv, n, d, generator=g)
    v = torch.randn(1, h_kv, n, d, generator=g)
    return q, k, v


def _pretend_hopper(monkeypatch):
    """As on an H200 with Triton 3.6: every in-scope call is eligible (float32 included, the
    interpreter's exact dtype, so that the check's comparison is meaningful here)."""
    monkeypatch.setattr(flash_hopper, "eligible", lambda q, k, v, variant: flash_hopper._checked.get((q.dtype, q.shape[-1])))
    monkeypatch.setitem(flash_hopper.CHECK_ATOL, torch.float32, 1e-4)


def test_off_in_the_interpreter():
    q, k, v = _inputs()
    variant = flash._variant(q, 1, k.shape[2], True, (-1, -1), 0.0, None)
    assert flash_hopper.eligible(q.half(), k.half(), v.half(), variant) == "Triton's interpreter"
    assert flash.forward_path(q, k, v, causal=True) == "triton"
    flash.attention_forward(q, k, v, causal=True)
    assert flash_hopper.LAST_PATH == "triton"


def test_force_off(monkeypatch):
    q, k, v = _inputs()
    variant = flash._variant(q, 1, k.shape[2], False, (-1, -1), 0.0, None)
    monkeypatch.setenv("FLASHRUN_HOPPER", "0")
    assert "turned off" in flash_hopper.eligible(q, k, v, variant)
    monkeypatch.delenv("FLASHRUN_HOPPER")
    monkeypatch.setattr(flash_hopper, "ENABLED", False)
    assert "turned off" in flash_hopper.eligible(q, k, v, variant)


def test_gluon_api_feature_check():
    # this Triton either has the API the kernel uses or says what it lacks - never raises
    reason = flash_hopper.gluon_api()
    assert reason is None or isinstance(reason, str)


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_failed_check_falls_back_once(monkeypatch, caplog, broken):
    _pretend_hopper(monkeypatch)
    calls = []

    def bad_kernel(q, k, v, sm_scale, causal):
        calls.append(causal)
        if broken == "raises":
            raise RuntimeError("PassManager::run failed")
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    monkeypatch.setattr(flash_hopper, "RUN", bad_kernel)
    q, k, v = _inputs()
    expected, expected_lse = flash._attn_forward(q, k, v, 0.125, flash.Variant(causal=True), try_gluon=False)
    caplog.set_level(logging.WARNING, logger="flashrun.hopper")
    for _ in range(3):  # the check runs once; every call falls back
        o, lse = flash.attention_forward(q, k, v, causal=True, sm_scale=0.125)
        assert flash_hopper.LAST_PATH == "triton"
        torch.testing.assert_close(o, expected)
        torch.testing.assert_close(lse, expected_lse)
    assert flash.forward_path(q, k, v, causal=True) == "triton"
    warnings = [r for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "portable Triton kernel is used" in message
    assert ("raised RuntimeError" if broken == "raises" else "disagrees") in message
    assert len(calls) == 1  # stopped at the first failing case, never called again
    # another head_dim is checked (and warned about) on its own
    q2, k2, v2 = _inputs(n=20, d=128)
    flash.attention_forward(q2, k2, v2, causal=True)
    assert len([r for r in caplog.records if r.name == "flashrun.hopper"]) == 2 and len(calls) == 2


def test_passed_check_takes_the_path(monkeypatch, caplog):
    _pretend_hopper(monkeypatch)
    used = []

    def good_kernel(q, k, v, sm_scale, causal):  # the portable kernel standing in for a correct one
        used.append(q.shape)
        return flash._attn_forward(q, k, v, sm_scale, flash.Variant(causal=causal), "default", try_gluon=False)

    monkeypatch.setattr(flash_hopper, "RUN", good_kernel)
    q, k, v = _inputs(n=33, h=4, h_kv=2)
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        assert flash.forward_path(q, k, v) == "gluon-sm90"
        o = flash.flash_attention(q, k, v)
    assert flash_hopper.LAST_PATH == "gluon-sm90"
    assert not [r for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(used) == 2 + 1  # the check's two cases (causal and not), then the call
    torch.testing.assert_close(o, flash._attn_forward(q, k, v, 64 ** -0.5, flash.Variant(), try_gluon=False)[0])


def test_a_passed_check_is_remembered_across_processes(monkeypatch, tmp_path):
    _pretend_hopper(monkeypatch)
    monkeypatch.setenv("FLASHRUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: f"{dtype}-{head_dim}")
    runs = []

    def good_kernel(q, k, v, sm_scale, causal):
        runs.append(q.shape)
        return flash._attn_forward(q, k, v, sm_scale, flash.Variant(causal=causal), "default", try_gluon=False)

    monkeypatch.setattr(flash_hopper, "RUN", good_kernel)
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == 2  # the check ran: causal and not
    assert set(json.loads((tmp_path / "hopper-checks.json").read_text())) == {"torch.float32-64"}
    flash_hopper.reset()  # a new process: same GPU, driver, Triton, sources (the same verdict key)
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == 2  # taken from the file, nothing ran
    flash_hopper.reset()
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: "another driver")
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == 4  # anything else changed: checked again


def test_a_failed_check_is_not_remembered(monkeypatch, tmp_path):
    _pretend_hopper(monkeypatch)
    monkeypatch.setenv("FLASHRUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: "key")
    monkeypatch.setattr(flash_hopper, "RUN", lambda q, k, v, sm_scale, causal: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v) == "triton"
    assert not (tmp_path / "hopper-checks.json").exists()


def test_compiling_ahead_runs_no_check(monkeypatch):
    """In compile-only mode the check's launches are handed over and nothing is compared; the
    check itself runs on the first real call."""
    from flashrun.kernels import tuning

    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(flash_hopper, "RUN", lambda q, k, v, sm_scale, causal: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    handed = []
    q, k, v = _inputs()
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel.__name__)):
        assert flash_hopper.ensure_checked(q.device, q.dtype, 64, flash._portable_check)
    assert handed == ["_attn_fwd", "_attn_fwd"]  # the portable side of the check, causal and not
    assert flash_hopper._checked == {}  # no verdict yet: a wrong kernel is still caught ...
    assert flash.forward_path(q, k, v) == "triton"  # ... on the first real call


def test_variants_and_decode_shapes_stay_portable(monkeypatch):
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "eligible", lambda q, k, v, variant: (
        "window/softcap/ALiBi" if variant.window or variant.softcap else None))
    monkeypatch.setattr(flash_hopper, "RUN", lambda *a: pytest.fail("the Gluon kernel ran"))
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v, window=(8, 0)) == "triton"
    assert flash.forward_path(q, k, v, softcap=5.0) == "triton"
    q1 = q[:, :, :1]  # one query, many keys: flash-decoding's split (the interpreter has 4 "SMs")
    k_long, v_long = (torch.randn(1, 2, 4096, 64) for _ in range(2))
    assert flash.forward_path(q1, k_long, v_long) == "triton"


def test_compiles_for_hopper(python):
    """Every (dtype, head_dim, causal) the Gluon path claims compiles for sm_90 (skips where this
    Triton lacks the Gluon Hopper API or a CUDA backend)."""
    result = python(str(Path(__file__).parent / "compile_hopper.py"))
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 2 * 2 * len(flash_hopper.CONFIGS)
    assert "wgmma 0 " not in result.stdout and "tma 0 " not in result.stdout


def test_tma_alignment():
    q = torch.empty(2, 4, 40, 64, dtype=torch.float16)
    assert flash_hopper._aligned(q)
    assert not flash_hopper._aligned(q.transpose(2, 3))  # head_dim not contiguous
    assert not flash_hopper._aligned(q[:, :1].expand(2, 4, 40, 64))  # stride 0: no TMA descriptor
    assert not flash_hopper._aligned(torch.empty(2, 4, 40, 68, dtype=torch.float16)[..., :60])  # 136-byte rows


@pytest.mark.parametrize("head_dim,n_k,causal,why", [
    (128, 1024, False, None), (128, 40, False, None), (128, 2048, True, None), (128, 1024, True, "fewer than 2048"),
    (64, 4096, False, None), (64, 1024, False, "fewer than 4096 keys"), (64, 4096, True, "fewer than 8192"),
    (64, 8192, True, None), (256, 4096, False, "head_dim 256"), (96, 4096, False, "head_dim 96")])
def test_where_the_h200_measured_it_faster(head_dim, n_k, causal, why):
    # the H200 probe and sweep (NOTES v5): head_dim 128 but short causal, 64 from 4096 keys
    # (8192 causal); 256 untimed
    q = torch.randn(1, 2, 64, head_dim, dtype=torch.float16)
    k = torch.randn(1, 2, n_k, head_dim, dtype=torch.float16)
    variant = flash._variant(q, 1, n_k, causal, (-1, -1), 0.0, None)
    reason = flash_hopper.scope(q, k, k, variant)
    assert reason == why if why is None else why in reason
