"""``flashrun model``: a kernel swapped into transformers models, through the CPU interpreter.

Every family's mini model passes every check with flash (plain, padded and packed batches); a
kernel wrong in one variant fails the model and names the first layer that diverges; what a
kernel cannot express fails with the reason; the variants the mini models carry visibly change
their logits (so the checks above can see them at all); the command's exit codes, JSON,
``--rerun``, local checkpoints and missing pieces.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from watched import Watched

pytest.importorskip("transformers", reason="flashrun model needs transformers: pip install 'flashrun[model]'")

from rich.console import Console  # noqa: E402

from flashrun.config import load_config  # noqa: E402
from flashrun.model import checks, data, families, swap  # noqa: E402
from flashrun.model import run as model_run  # noqa: E402

KERNELS = Path(__file__).parent / "kernels" / "model_kernels.py"
EVERY_CHECK = ["logits", "logits-padded", "logits-packed", "train-step", "training", "generate"]


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty Hugging Face cache and no network: nothing may be downloaded."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _run(*sets: str, kernel: str = "flash") -> model_run.Report:
    cfg = load_config(None, None, {"model.kernel": kernel}, list(sets))
    return model_run.run(cfg, model_run.make_plan(cfg))


def _by_name(report: model_run.Report) -> dict:
    return {c.name: c for c in report.checks}


@pytest.mark.slow
@pytest.mark.parametrize("arch", families.ARCHS)
def test_every_family_passes_every_check_with_flash(arch):
    # two rows and 40 tokens: a second, ragged query tile and left padding that differs per row
    report = _run(f"model.arch={arch!r}", "model.batch=2", "model.seq_len=40", "model.train_steps=3",
                  "model.gen_tokens=6")
    assert [c.name for c in report.checks] == EVERY_CHECK
    failed = {c.name: c.summary for c in report.checks if not c.passed}
    assert not failed, failed
    calls = report.model["kernel_calls"]
    assert calls["dense"] and calls["packed"]  # the kernel ran, plain and packed (padding, position_ids)
    for variant in families.family(arch).variants:
        assert calls[variant], f"{arch}'s {variant} never reached the kernel"
    assert report.model["baseline"] == families.family(arch).baseline
    assert report.exit_code == 0


@pytest.mark.parametrize("arch, kernel, layer", [
    ("mistral", "ignores_window", 0),
    ("gemma2", "ignores_window", 0),  # layer 0 is a sliding one, layer 1 full
    ("gemma2", "ignores_softcap", 0),
    ("llama", "leaks_future", 0),
])
def test_a_kernel_wrong_in_one_variant_fails_the_model_at_its_first_layer(arch, kernel, layer):
    report = _run(f"model.arch={arch!r}", "model.checks=['logits']", kernel=f"{KERNELS}:{kernel}")
    logits = _by_name(report)["logits"]
    assert not logits.passed
    assert logits.detail["first_diverging_layer"] == layer
    assert f"first diverging layer: {layer}" in logits.summary
    assert report.exit_code == 1


def test_a_kernel_with_a_wrong_backward_fails_the_train_step_and_names_the_parameter():
    report = _by_name(_run("model.checks=['logits', 'train-step']", kernel=f"{KERNELS}:half_dq"))
    assert report["logits"].passed  # its forward is right
    step = report["train-step"]
    assert not step.passed and step.detail["failed"], step.summary
    # the last layer's q_proj gets half its gradient; its k/v/o projections (downstream of no
    # other wrong dQ) and the token losses (the forward) stay right
    last = f"model.layers.{families.build_config('llama', 'mini').num_hidden_layers - 1}.self_attn"
    assert f"{last}.q_proj.weight" in step.detail["failed"]
    assert not any(name.startswith((f"{last}.k_proj", f"{last}.v_proj", f"{last}.o_proj", "token"))
                   for name in step.detail["failed"])


@pytest.mark.parametrize("arch", families.ARCHS)
def test_the_token_losses_are_what_the_loss_averages(arch):
    # the train-step check judges the loss token by token: the tokens must be the model's own
    config = families.build_config(arch, "mini")
    model = families.build(config, torch.float64, "cpu", 0)
    batch = data.copy_task(config.vocab_size, 2, 24, 0)
    loss, tokens, grads = checks._gradients(model, "eager", batch)
    assert len(tokens) == int(batch.valid().sum()) - batch.input_ids.shape[0]  # the first token has no label
    assert torch.allclose(tokens.mean().to(loss.dtype), loss, rtol=1e-6) and grads


def test_a_good_user_kernel_passes():
    report = _run("model.arch='gemma2'", "model.checks=['logits']", kernel=f"{KERNELS}:everything")
    assert all(c.passed for c in report.checks), [c.summary for c in report.checks]


def test_what_a_kernel_cannot_express_fails_with_the_reason():
    mistral = _run("model.arch='mistral'", "model.checks=['logits']", kernel=f"{KERNELS}:plain")
    assert not any(c.passed for c in mistral.checks)
    assert "does not take window" in _by_name(mistral)["logits"].summary
    llama = _by_name(_run("model.checks=['logits']", kernel=f"{KERNELS}:plain"))
    assert llama["logits"].passed  # plain causal attention it can do
    assert not llama["logits-padded"].passed and "cu_seqlens" in llama["logits-padded"].summary


@pytest.mark.parametrize("arch, disable", [
    ("mistral", {"sliding_window": 4096}),
    ("gemma2", {"sliding_window": 4096}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma3", {"sliding_window": 4096}),
])
def test_the_mini_models_variants_visibly_change_their_logits(arch, disable):
    # random weights hide variants (scores ~0.1 at init); the minis sharpen q/k and use a short
    # window and softcap 5, so that a kernel ignoring one is caught far above float noise
    config = families.build_config(arch, "mini")
    model = families.build(config, torch.float64, "cpu", 0)
    model.set_attn_implementation("eager")
    ids = data.copy_task(config.vocab_size, 1, 32, 0).input_ids
    with torch.no_grad():
        with_variant = model(ids, use_cache=False).logits
        for key, value in disable.items():
            setattr(model.config, key, value)
        model = type(model)(model.config).to(torch.float64).eval()
        model.load_state_dict(families.build(config, torch.float64, "cpu", 0).state_dict())
        model.set_attn_implementation("eager")
        without = model(ids, use_cache=False).logits
    relative = float((with_variant - without).norm() / with_variant.norm())
    assert relative > 1e-2, relative  # the checks' float32 bounds are ~1e-5 relative


def test_sharpened_scores_reach_the_target_spread():
    small = families.build_config("llama", "mini")
    model = families.build(small, torch.float64, "cpu", 0)
    hidden = torch.randn(1, 64, small.hidden_size, dtype=torch.float64)  # what RMSNorm hands q_proj: ~unit scale
    layer = model.model.layers[0].self_attn
    with torch.no_grad():
        q, k = layer.q_proj(hidden), layer.k_proj(hidden)
    q = q.view(1, 64, -1, 64)[..., 0, :]
    k = k.view(1, 64, -1, 64)[..., 0, :]
    scores = (q @ k.transpose(-1, -2)) * 64 ** -0.5
    assert 1.5 < float(scores.std()) < 6.0  # SCORE_STD = 3, from the init's analytic spread


# -- the swap's conversions ---------------------------------------------------------------------


class _Module:
    is_causal = True
    training = False


def test_padding_with_holes_or_right_padding_against_a_cache_is_refused():
    q = torch.randn(2, 2, 4, 16)
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(swap.Unsupported, match="holes"):
        swap._packing(holes, q, q, {})
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert swap._packing(right, q, q, {})["cu_seqlens_k"].tolist() == [0, 3, 7]  # training: fine
    with pytest.raises(swap.Unsupported, match="right padding"):
        swap._packing(right, q[:, :, :1], q, {})  # decode against a right-padded cache
    with pytest.raises(swap.Unsupported, match="4-D"):
        swap._packing(torch.ones(2, 1, 4, 4, dtype=torch.bool), q, q, {})


def test_restarting_position_ids_become_packed_sequences():
    q = torch.randn(1, 2, 6, 16)
    packed = swap._packing(None, q, q, {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])})
    assert packed["cu_seqlens_q"].tolist() == [0, 3, 5, 6] and packed["max_seqlen_q"] == 3
    assert swap._packing(None, q, q, {"position_ids": torch.arange(6)[None]}) is None


def test_a_forward_reads_its_padding_and_positions_once_not_per_layer(monkeypatch):
    """Reading the mask or position_ids back waits for the GPU: once per forward, then every
    layer reuses the answer (a new mask or new positions are read again)."""
    from flashrun import kernels

    reads = []
    monkeypatch.setattr(swap, "_packing", lambda *args: reads.append(args) or None)
    model = families.build(families.build_config("llama", "mini"), torch.float32, "cpu", 0)
    fn = swap.register(kernels.get("flash"))
    model.set_attn_implementation(swap.NAME)
    ids = torch.arange(12)[None] % 7
    with torch.no_grad():
        model(input_ids=ids)
        assert len(reads) == 1 and sum(fn.calls.values()) == model.config.num_hidden_layers
        model(input_ids=ids)  # a new forward: new position_ids
    assert len(reads) == 2


def test_dropout_is_refused_not_ignored():
    module = _Module()
    module.training = True
    fn = swap.Swap(None)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(swap.Unsupported, match="dropout"):
        fn(module, q, q, q, None, dropout=0.1)


# -- the command ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_passes_and_prints_every_check_as_json(flashrun):
    result = flashrun("model", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["verdict"] == "6 passed, 0 failed" and report["passed"] == 6 and report["failed"] == 0
    assert [c["name"] for c in report["checks"]] == EVERY_CHECK
    assert all(c["passed"] is True for c in report["checks"])
    assert report["model"]["transformers"] and report["plan"]["dtype"] == "float32"


def test_a_failing_kernel_exits_1_and_bad_input_exits_2(cli):
    failing = cli("model", "--arch", "mistral", "-k", f"{KERNELS}:ignores_window", "--set", "model.checks=['logits']",
                  "--json")
    assert failing.exit_code == 1
    assert json.loads(failing.stdout)["failed"] >= 1
    unknown = cli("model", "--arch", "gpt5")
    assert unknown.exit_code == 2 and "model.arch" in unknown.stderr
    missing = cli("model", "-k", "nowhere.py:attention")
    assert missing.exit_code == 2 and "not found" in missing.stderr


def test_a_hub_id_that_is_not_cached_says_how_to_fetch_it(cli):
    result = cli("model", "--model", "someone/some-model")
    assert result.exit_code == 2
    assert "neither a local folder nor a model in the local Hugging Face cache" in result.stderr
    assert "hf download someone/some-model" in result.stderr
    missing = cli("model", "--model", "/nowhere/checkpoints/llama")  # a path: no download hint
    assert missing.exit_code == 2
    assert "/nowhere/checkpoints/llama: no such folder" in missing.stderr and "hf download" not in missing.stderr


def test_without_transformers_it_says_how_to_install_it(python):
    code = ("import sys; sys.modules['transformers'] = None; sys.argv = ['flashrun', 'model']\n"
            "from flashrun.cli import main; main()")
    result = python("-c", code)
    assert result.returncode == 2
    assert "needs transformers" in result.stderr and "flashrun[model]" in result.stderr


def test_a_local_checkpoint_loads_from_its_folder(cli, tmp_path):
    config = families.build_config("qwen2", "mini")
    families.build(config, torch.float32, "cpu", 3).save_pretrained(tmp_path / "ckpt")
    result = cli("model", "--model", str(tmp_path / "ckpt"), "--set", "model.checks=['logits']", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["model"]["weights"] == "checkpoint" and report["model"]["model_type"] == "qwen2"


def test_rerun_repeats_the_recorded_plan(cli):
    first = cli("model", "--arch", "mistral", "--set", "model.sliding_window=8", "--set", "model.checks=['logits']",
                "--json")
    assert first.exit_code == 0
    recorded = json.loads(first.stdout)
    again = cli("model", "--rerun", recorded["run_id"], "--json")
    assert again.exit_code == 0
    repeated = json.loads(again.stdout)
    assert repeated["plan"] == recorded["plan"] and repeated["model"]["sliding_window"] == 8
    refused = cli("model", "--rerun", recorded["run_id"], "--arch", "llama")
    assert refused.exit_code == 2 and "--arch" in refused.stderr


def test_the_table_is_whole_at_80_columns():
    report = _run("model.checks=['logits']")
    console = Console(width=80, record=True, force_terminal=False)
    model_run.render(report, console)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for check in report.checks:
        assert check.name in text
    assert report.run_id in text


STALLS_ON_PADDING = '''
import pathlib, time
from flashrun.kernels import flash_attention


def attention(q, k, v, causal, sm_scale, cu_seqlens_q=None, cu_seqlens_k=None):
    if cu_seqlens_q is not None:  # the padded batch: the logits check before it has finished
        pathlib.Path({marker!r}).touch()
        time.sleep(3600)
    return flash_attention(q, k, v, causal, sm_scale)
'''


def test_ctrl_c_keeps_the_finished_checks(isolated: Path) -> None:
    started = isolated / "padded-started"
    (isolated / "stalls.py").write_text(STALLS_ON_PADDING.format(marker=str(started)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with Watched(["model", "-k", "stalls.py:attention", "--json"], env, isolated / "stdout.txt") as run:
        run.wait_for("the padded batch's kernel call", started.exists)
        code, stdout, stderr = run.interrupt()
    assert code == 130, stderr
    report = json.loads(stdout)
    assert report["interrupted"] is True and [c["name"] for c in report["checks"]] == ["logits"]
    recorded = [json.loads(line) for line in (isolated / "logs" / "runs.jsonl").read_text().splitlines()]
    assert recorded[-1]["command"] == "model" and recorded[-1]["results"]["interrupted"] is True


def _clocked(monkeypatch, model):
    """CPU clocks in place of CUDA events and memory stats; returns the implementation each
    timed call ran under, in order."""
    import time

    from flashrun.model import speed

    order = []

    def event_ms(fn):
        order.append(model.config._attn_implementation)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(speed, "_event_ms", event_ms)
    monkeypatch.setattr(speed, "_peak", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(speed, "DECODE_STEPS", 2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return order


def test_the_speed_phases_run_on_a_mini_model(monkeypatch):
    # speed is timed on a GPU only; here CPU clocks stand in for CUDA events and memory stats, so
    # that the phases (prefill into a DynamicCache, train step, decode against the cache) and the
    # rows' arithmetic run against this transformers' API
    from flashrun import kernels
    from flashrun.model import speed

    registered = swap.register(kernels.get("flash"))
    config = families.build_config("mistral", "mini")
    model = families.build(config, torch.float32, "cpu", 0)
    order = _clocked(monkeypatch, model)
    batch = data.copy_task(config.vocab_size, 2, 24, 0)
    rows = speed.run(model, "flash", ["sdpa", "flash_attention_2", "none"], "sdpa", {}, batch, reps=3, fp8_kv=True)
    assert [r.attention for r in rows] == ["flash", "flash e4m3-kv", "sdpa", "flash_attention_2", "none"]
    flash, fp8_kv, sdpa, fa2, floor = rows
    assert flash.status == fp8_kv.status == sdpa.status == floor.status == "ok", (flash.note, fp8_kv.note, sdpa.note)
    assert "floor" in floor.note and floor.decode_ms is not None
    assert flash.train_tok_s == pytest.approx(48 / flash.train_ms * 1e3)
    assert flash.decode_tok_s == pytest.approx(2 / flash.decode_ms * 1e3)
    assert sdpa.speedup_train == pytest.approx(1.0)
    assert flash.speedup_train == pytest.approx(sdpa.train_ms / flash.train_ms)
    # the e4m3 KV cache's row: decode only, through the KV-cache call
    assert fp8_kv.decode_ms is not None and fp8_kv.train_ms is fp8_kv.prefill_ms is fp8_kv.speedup_train is None
    assert registered.calls["kv-cache"] > 0
    assert fa2.status == "n/a" and "flash-attn" in fa2.note
    # interleaved: every round times each implementation once, in turn (3 prefill and 3 train
    # rounds, 2 decode steps), so a drift over the run falls on all alike
    assert order == [swap.NAME, "sdpa", swap.FLOOR] * (3 + 3) + [swap.NAME, swap.NAME, "sdpa", swap.FLOOR] * 2


def test_the_floor_attends_to_nothing_but_every_projection_takes_its_backward():
    # `none`: V passed through, so its time is what the model costs around its attention; q and k
    # still reach the loss (times zero), or the floor would skip their projections' backward
    swap.register(None)
    config = families.build_config("llama", "mini")
    model = families.build(config, torch.float32, "cpu", 0)
    model.set_attn_implementation(swap.FLOOR)
    ids = data.copy_task(config.vocab_size, 1, 16, 0).input_ids
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)  # GQA 2:1, Nq < Nk
    out, _ = swap.floor_attention(None, q, k, v, None)
    assert torch.equal(out, v[:, :, -3:].repeat_interleave(2, dim=1).transpose(1, 2))


def test_an_implementation_that_fails_is_its_row_and_the_others_are_timed(monkeypatch):
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from flashrun import kernels
    from flashrun.model import speed

    def broken(module, query, key, value, attention_mask, **kwargs):  # runs inference only
        if torch.is_grad_enabled():
            raise RuntimeError("no backward here\nsecond line")
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fr_test_broken", broken)
    swap.register(kernels.get("flash"))
    config = families.build_config("llama", "mini")
    model = families.build(config, torch.float32, "cpu", 0)
    order = _clocked(monkeypatch, model)
    rows = speed.run(model, "flash", ["fr_test_broken", "sdpa"], "sdpa", {},
                     data.copy_task(config.vocab_size, 1, 16, 0), reps=2)
    flash, broken_row, sdpa = rows
    assert flash.status == sdpa.status == "ok" and flash.train_ms and sdpa.decode_ms
    # its prefill was timed; its train step failed (in the warm-up), so it left the rotation
    assert broken_row.status == "error" and broken_row.note == "RuntimeError: no backward here"
    assert broken_row.prefill_ms is not None and broken_row.train_ms is None and broken_row.decode_ms is None
    assert order.count("fr_test_broken") == 2 and order.count(swap.NAME) == 2 + 2 + 2


def test_the_reference_is_finite_on_padded_rows_and_a_nonfinite_one_fails():
    # transformers' eager attention leaves a padded query row NaN in float64, and the NaN reaches
    # every real row one layer later (0 x NaN in P·V): a reference like that would judge nothing
    from flashrun import kernels
    from flashrun.harness.judge import compare_scaled
    from flashrun.model import checks

    swap.register(kernels.get("flash"))
    config = families.build_config("llama", "mini")
    model = families.build(config, torch.float64, "cpu", 0)
    batch = data.padded(data.copy_task(config.vocab_size, 1, 32, 0))  # one row, 10 padded positions
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(**batch.kwargs(), use_cache=False).logits
    assert torch.isnan(eager[batch.valid()]).any()  # what the reference must not be
    logits, layers = checks._forward(model, swap.REFERENCE, batch)
    assert torch.isfinite(logits).all() and all(torch.isfinite(layer).all() for layer in layers)
    ref = eager[batch.valid()]
    judged = compare_scaled("logits", logits[batch.valid()].float(), ref, logits[batch.valid()].float())
    assert not judged.passed and "the reference itself has" in judged.reason()


# -- generation over an fp8 (e4m3) KV cache ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # GQA; softcap + sliding-window layers
def test_generation_over_an_fp8_cache_is_within_twice_its_yardstick(arch):
    report = _run(f"model.arch={arch}", "model.checks=['generate-fp8']")
    check = _by_name(report)["generate-fp8"]
    assert check.passed, check.summary
    assert report.model["kernel_calls"]["kv-cache"] > 0  # the steps read the e4m3 cache through the kernel
    assert 0.0 <= check.detail["greedy_equal_to_unquantized"] <= 1.0  # reported beside, not gated


def test_a_kernel_that_reads_the_fp8_cache_without_its_scales_fails(monkeypatch):
    import flashrun.kernels as kernels

    real = kernels.flash_attention_with_kvcache

    def unscaled(*args, k_scale=None, v_scale=None, **kwargs):  # the values' scales never reach the kernel
        return real(*args, k_scale=torch.ones_like(k_scale), v_scale=torch.ones_like(v_scale), **kwargs)

    monkeypatch.setattr(kernels, "flash_attention_with_kvcache", unscaled)
    check = _by_name(_run("model.checks=['generate-fp8']"))["generate-fp8"]
    assert not check.passed and "max error" in check.summary


def test_an_fp8_cache_refuses_an_attention_that_does_not_write_it_and_a_prompt_past_its_room():
    from flashrun import kernels
    from flashrun.model import fp8cache
    from flashrun.model.speed import cache_kwarg

    config = families.build_config("llama", "mini")
    model = families.build(config, torch.float32, "cpu", 0)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    cache = fp8cache.Fp8Cache(config.num_hidden_layers, 64)
    model.set_attn_implementation("sdpa")  # sees only the new keys: right for the prompt, not after
    arg = cache_kwarg(model)
    model(input_ids=ids, use_cache=True, **{arg: cache})
    with pytest.raises(swap.Unsupported, match="did not write them"):
        model(input_ids=ids[:, :1], use_cache=True, **{arg: cache})
    cache.reset()
    assert not swap.PENDING
    swap.register(kernels.get("flash"))
    model.set_attn_implementation(swap.NAME)
    with pytest.raises(swap.Unsupported, match="holds 4 tokens"):
        model(input_ids=ids, use_cache=True, **{arg: fp8cache.Fp8Cache(config.num_hidden_layers, 4)})


def test_the_speed_plot_leaves_out_what_a_row_does_not_time(tmp_path):
    from flashrun.model.speed import SpeedRow

    cfg = load_config(None, None, {}, [])
    report = model_run.Report(model_run.make_plan(cfg))
    report.speed = [SpeedRow("flash", 2.0, 1.0, 3.0, 1.0, 0.5, 2.0, 1.0, 1.0),
                    SpeedRow("flash e4m3-kv", decode_ms=0.4, decode_tok_s=2.5)]
    assert model_run.plot(report, tmp_path / "speed.png").stat().st_size > 0


def test_the_speed_table_is_whole_at_80_columns_with_the_reasons_below():
    from flashrun.model.speed import SpeedRow

    report = model_run.Report(model_run.make_plan(load_config(None, None, {}, [])))
    report.speed = [SpeedRow("flash", 1133.1, 9.0, 42.5, 9.0, 7.9, 42000.7, 18.3, 9.1, 1.02, 1.0),
                    SpeedRow("flash e4m3-kv", decode_ms=7.9, decode_tok_s=506.3, note="decode only"),
                    SpeedRow("flash_attention_2", status="n/a", note="flash-attn is not installed")]
    console = Console(width=80, record=True, force_terminal=False)
    model_run._render_speed(report, console)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for whole in ("flash_attention_2", "flash e4m3-kv", "decode tok/s", "prefill ms", "1,133.1", "42,001",
                  "flash_attention_2: n/a, flash-attn is not installed"):
        assert whole in text, whole
