"""The attention variants through the tool (CPU interpreter, tiny shapes): verify end to end,
users' kernels with and without the variant arguments, cases files, gen-cases' edge cases,
bench with the torch providers, and the FLOP count over allowed pairs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashrun.cli import app
from flashrun.config import BenchConfig, ExperimentConfig
from flashrun.config.schema import VerifyConfig
from flashrun.harness.cases import (
    load_cases,
    offline_cases,
    variant_cases,
    write_cases_file,
)
from flashrun.harness.inputs import make_inputs
from flashrun.harness.judge import Reference
from flashrun.harness.reference import allowed
from flashrun.harness.shapes import (
    Shape,
    bench_shapes,
    flops,
    packed,
    pairs,
    visible_pairs,
)
from flashrun.harness.verify import reproduce_command

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()

USER_KERNELS = '''
from flashrun.kernels import flash_attention, flash_attention_varlen


def plain(q, k, v, causal=False, sm_scale=None):
    return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def with_variants(q, k, v, causal=False, sm_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    if cu_seqlens_q is not None:
        return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    return flash_attention(q, k, v, causal, sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes)


def dense_only(q, k, v, causal=False, sm_scale=None, *, window=(-1, -1), alibi_slopes=None):
    return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, window=window, alibi_slopes=alibi_slopes)


def takes_all(q, k, v, causal=False, sm_scale=None, **kwargs):
    return with_variants(q, k, v, causal, sm_scale, **kwargs)
'''


def verify_json(*args):
    result = runner.invoke(app, ["verify", *args, "--json"])
    assert "Traceback" not in result.stderr, result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.toml").write_text(
        '[experiment]\nbatch_size = 1\nnum_heads = 4\nnum_kv_heads = 2\nseq_len = 17\nseq_len_k = 29\n'
        'head_dim = 16\ndtype = "float32"\n\n[logging]\nlog_dir = "logs"\n')
    (tmp_path / "mine.py").write_text(USER_KERNELS)
    return tmp_path


# -- verify end to end ------------------------------------------------------------------------------
def test_every_variant_and_their_combination_pass_through_verify(workdir):
    """Each variant alone and all together, dense (GQA, Nq != Nk) and packed (with an empty and a
    length-1 sequence), forward and backward; minimal reports them unsupported."""
    code, data = verify_json(
        "--grad", "-k", "flash", "-k", "minimal",
        "--set", "verify.window=[[-1,-1],[4,2]]", "--set", "verify.softcap=[0.0,2.0]",
        "--set", "verify.alibi=[false,true]", "--set", "verify.seqlens=[[],[0,1,9,5]]",
        "--set", "verify.causal=[true]")
    assert code == 0, data["verdict"]
    flash = [r for r in data["results"] if r["kernel"] == "flash"]
    assert len(flash) == 16 and {r["status"] for r in flash} == {"pass"}
    assert {c["name"] for r in flash for c in r["checks"]} == {"out", "dq", "dk", "dv"}
    labels = {r["label"] for r in flash}
    assert "B1 H4/2 N17x29 D16 fp32 causal w4,2 cap2 alibi" in labels
    assert "B4 H4/2 N9 D16 fp32 causal w4,2 cap2 alibi varlen[0,1,9,5]" in labels
    combo = next(r for r in flash if r["label"] == "B1 H4/2 N17x29 D16 fp32 causal w4,2 cap2 alibi")
    assert combo["case"]["window"] == [4, 2] and combo["case"]["softcap"] == 2.0 and combo["case"]["alibi"]
    minimal = [r for r in data["results"] if r["kernel"] == "minimal"]
    plain = [r for r in minimal if r["label"] == "B1 H4/2 N17x29 D16 fp32 causal"]
    assert [r["status"] for r in plain] == ["pass"]
    others = [r for r in minimal if r not in plain]
    assert {r["status"] for r in others} == {"unsupported"}
    assert all("minimal does not take" in r["message"] for r in others)


def test_a_user_kernel_without_the_variant_arguments_is_skipped_with_the_reason(workdir):
    code, data = verify_json("-k", "mine.py:plain", "-k", "mine.py:with_variants", "-k", "mine.py:dense_only",
                             "-k", "mine.py:takes_all",
                             "--grad", "--set", "verify.window=[[-1,-1],[3,0]]",
                             "--set", "verify.seqlens=[[],[2,0,1]]", "--set", "experiment.alibi=true")
    assert code == 0, data["verdict"]
    status = {(r["kernel"], r["label"]): (r["status"], r["message"]) for r in data["results"]}
    dense_window = "B1 H4/2 N17x29 D16 fp32 w3,0 alibi"
    packed_window = "B3 H4/2 N2 D16 fp32 w3,0 alibi varlen[2,0,1]"
    assert status["mine.py:plain", dense_window] == (
        "skipped", "mine.py:plain does not take window, alibi_slopes, which this case needs (add them as keyword "
                   "arguments with defaults to run such cases)")
    assert status["mine.py:with_variants", dense_window][0] == "pass"
    assert status["mine.py:with_variants", packed_window][0] == "pass"
    assert status["mine.py:dense_only", dense_window][0] == "pass"
    assert status["mine.py:dense_only", packed_window][0] == "skipped"
    assert "cu_seqlens_q, cu_seqlens_k" in status["mine.py:dense_only", packed_window][1]
    assert status["mine.py:takes_all", packed_window][0] == "pass"  # **kwargs takes everything
    assert "skipped" in data["verdict"] and data["failed"] == 0
    judged = next(r for r in data["results"] if r["kernel"] == "mine.py:with_variants" and r["label"] == packed_window)
    assert [c["name"] for c in judged["checks"]] == ["out", "dq", "dk", "dv"]


def test_shipped_variants_config_covers_every_variant():
    from flashrun.config import load_config
    from flashrun.harness.shapes import verify_shapes

    shapes = verify_shapes(load_config(ROOT / "configs" / "variants.toml"))
    assert len(shapes) == 64
    assert {s.window for s in shapes} >= {(-1, -1), (0, 0), (8, 0), (100, 100)}
    assert any(s.window != (-1, -1) and s.softcap and s.alibi and s.seqlens and s.causal for s in shapes)
    assert any(s.num_kv_heads != s.num_heads and s.seq_len != s.seq_len_k and s.alibi for s in shapes)
    assert any(s.seqlens and 0 in s.seqlens and 1 in s.seqlens for s in shapes)


# -- shapes, configs, records, cases files ------------------------------------------------------------------
def test_labels_and_old_records():
    old = dict(batch_size=2, num_heads=8, num_kv_heads=2, seq_len=128, seq_len_k=256, head_dim=64, dtype="float16",
               causal=True)
    assert Shape(**old).label == "B2 H8/2 N128x256 D64 fp16 causal" and Shape(**old).plain
    shape = packed(Shape(**old, window=[128, 0], softcap=30, alibi=True), [0, 1, 17])
    assert shape.label == "B3 H8/2 N17 D64 fp16 causal w128,0 cap30 alibi varlen[0,1,17]"
    again = Shape(**json.loads(json.dumps(shape.to_json())))  # a record: lists come back as tuples
    assert again == shape and hash(again) == hash(shape)
    command = reproduce_command("flash", shape, 3, grad=True)
    assert "--set experiment.window=[128,0]" in command and "--set experiment.seqlens=[0,1,17]" in command
    assert "seqlens_k" not in command


def test_config_keys_validate():
    exp = ExperimentConfig.model_validate({"window": [8, 0], "softcap": 30, "seqlens": [0, 1, 17]})
    assert exp.window == (8, 0) and exp.softcap == 30.0
    assert VerifyConfig.model_validate({"window": [8, 0]}).window == [(8, 0)]  # one pair is one value
    assert VerifyConfig.model_validate({"window": [[8, 0], [-1, -1]]}).window == [(8, 0), (-1, -1)]
    for bad in ({"window": [-2, 0]}, {"window": [1, 2, 3]}, {"softcap": -1.0}, {"seqlens": [0, 0]},
                {"seqlens": [1, 2], "seqlens_k": [1]}, {"seqlens_k": [1]}, {"seqlens": []}):
        with pytest.raises(Exception):
            ExperimentConfig.model_validate(bad)


def test_cases_files_with_variant_fields_round_trip(tmp_path):
    base = ExperimentConfig(num_heads=4, num_kv_heads=2, head_dim=16)
    written = [{"seq_len": 17, "seq_len_k": 29, "window": [4, 0], "softcap": 2.0, "alibi": True},
               {"seqlens": [0, 1, 9], "seqlens_k": [3, 1, 9], "causal": True}, {"seq_len": 5}]
    write_cases_file(tmp_path / "cases.json", {"cases": written})
    loaded = load_cases(tmp_path / "cases.json")
    shapes = [Shape.from_fields(c, base, "test") for c in loaded]
    assert shapes[0].window == (4, 0) and shapes[0].softcap == 2.0 and shapes[0].alibi
    assert shapes[1].seqlens == (0, 1, 9) and shapes[1].seqlens_k == (3, 1, 9)
    assert (shapes[1].batch_size, shapes[1].seq_len, shapes[1].seq_len_k) == (3, 9, 9)
    assert shapes[2].plain
    with pytest.raises(Exception, match="seqlens_k"):
        Shape.from_fields({"seqlens": [1, 2], "seqlens_k": [1]}, base, "test")


def test_offline_edge_cases_cover_the_variants():
    cases = offline_cases(16384)
    variants = [c for c in cases if c.window or c.softcap or c.alibi or c.seqlens or c.cache_seqlens]
    assert variants == variant_cases(16384)
    caches = [c for c in variants if c.cache_seqlens]  # ragged with an empty cache, pages, appends
    assert any(0 in c.cache_seqlens and c.page_size for c in caches) and any(c.new_keys for c in caches)
    assert any(c.page_size and any(n > c.page_size for n in c.cache_seqlens) for c in caches)
    assert any(c.window == (0, 0) for c in variants)
    assert any(c.window and min(c.window) > max(c.seq_len, c.seq_len_k or 0) for c in variants)  # wider
    assert any(c.window and c.seq_len_k and c.seq_len_k > c.seq_len for c in variants)
    assert any(c.window and c.seq_len_k and c.seq_len_k < c.seq_len for c in variants)
    assert any(c.seqlens and 0 in c.seqlens and 1 in c.seqlens for c in variants)
    assert all(max([c.seq_len, *(c.seqlens or [])]) <= 40 for c in offline_cases(40) if c.window or c.seqlens)


def test_packed_inputs_keep_the_generator_discipline():
    shape = packed(Shape(1, 4, 2, 1, 1, 16, "float16", False, alibi=True), [0, 1, 9], [3, 2, 9])
    a, b = make_inputs(shape, 5, "cpu")[0], make_inputs(shape, 5, "cpu")[0]
    assert a.q.shape == (10, 4, 16) and a.k.shape == (14, 2, 16) and a.dout.shape == a.q.shape
    assert torch.equal(a.q, b.q) and torch.equal(a.v, b.v)
    assert a.cu_seqlens_q.tolist() == [0, 0, 1, 10] and a.cu_seqlens_k.tolist() == [0, 3, 5, 14]
    assert a.cu_seqlens_q.dtype == torch.int32 and a.alibi_slopes.shape == (4,)
    assert set(a.variant_args()) == {"alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}


# -- FLOPs over allowed pairs -----------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k,causal,window", [
    (16, 16, False, (3, 0)), (16, 16, True, (3, 5)), (9, 30, False, (2, 2)), (30, 9, False, (0, 0)),
    (30, 9, True, (-1, -1)), (7, 7, False, (100, 100)), (12, 40, True, (5, -1)), (40, 12, False, (-1, 3)),
])
def test_visible_pairs_count_the_reference_mask(n_q, n_k, causal, window):
    assert visible_pairs(n_q, n_k, causal, window) == int(allowed(n_q, n_k, "cpu", causal, window).sum())


def test_square_causal_keeps_the_flashattention_convention():
    assert visible_pairs(64, 64, True) == 64 * 64 / 2
    assert visible_pairs(64, 64, True, (100, 0)) == 64 * 64 / 2  # a window wider than the keys is none
    assert visible_pairs(64, 64, False, (7, 0)) == sum(min(i, 7) + 1 for i in range(64))


def test_varlen_flops_sum_the_sequences():
    shape = packed(Shape(1, 2, 2, 1, 1, 16, "float16", False, (2, 0)), [0, 1, 9, 5], [4, 1, 9, 5])
    expected = sum(visible_pairs(nq, nk, False, (2, 0)) for nq, nk in ((1, 1), (9, 9), (5, 5)))
    assert pairs(shape) == expected
    assert flops(shape, "fwd") == 4 * 2 * expected * 16 and flops(shape, "bwd") == 2.5 * flops(shape, "fwd")


# -- bench -------------------------------------------------------------------------------------------------
TINY = ["--device", "cpu", "--head-dims", "16", "--set", "bench.hidden=32", "--set", "bench.tokens=32",
        "--set", "bench.warmup_ms=1", "--set", "bench.rep_ms=2", "--seq-lens", "16", "--set", "bench.seq_len_k=[24]"]


def test_bench_sweep_multiplies_variants_and_adds_packed_batches():
    bench = BenchConfig(seq_len=[16], head_dim=[16], causal=[True], hidden=32, tokens=32,
                        window=[[-1, -1], [3, 0]], softcap=[0.0, 2.0], alibi=[True], varlen=[[0, 1, 9]])
    shapes = bench_shapes(bench)
    assert len(shapes) == 4 + 4 and all(s.alibi for s in shapes)
    assert [s.seqlens for s in shapes[4:]] == [(0, 1, 9)] * 4
    assert bench_shapes(bench.model_copy(update={"seq_len": []})) == shapes[4:]  # packed batches alone


def test_bench_times_the_variants_it_can_and_says_why_not_otherwise(isolated: Path):
    result = runner.invoke(app, ["bench", *TINY, "-p", "torch-naive,sdpa,sdpa-math,sdpa-flash", "--mode", "fwd,bwd",
                                 "--causal", "yes", "--set", "bench.window=[[3,1]]", "--set", "bench.softcap=[0.0,2.0]",
                                 "--set", "bench.alibi=[true]", "--set", "bench.varlen=[[0,1,9,5]]", "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == 2 * 2 * 4 * 2  # (dense, packed) x softcap x providers x modes
    for row in rows:
        capped = row["softcap"] == 2.0
        if row["provider"] == "torch-naive" or (row["provider"] in ("sdpa", "sdpa-math") and not capped):
            assert (row["status"], row["correct"]) == ("ok", True), row
            shape = Shape(row["batch"], row["heads"], row["kv_heads"], row["seq_len"], row["seq_len_k"],
                          row["head_dim"], row["dtype"], row["causal"], row["window"], row["softcap"], row["alibi"],
                          row["seqlens"], row["seqlens_k"])
            assert row["tflops"] == pytest.approx(flops(shape, row["mode"]) / row["ms"] / 1e9, rel=1e-4)
            assert flops(shape, "fwd") < 4 * shape.num_heads * shape.head_dim * 16 * 24  # not every pair
        elif row["provider"] in ("sdpa", "sdpa-math"):
            assert row["status"] == "n/a" and "no softcap" in row["note"], row
        else:
            assert row["status"] == "n/a", row
    assert {tuple(r["window"]) for r in rows} == {(3, 1)} and {r["alibi"] for r in rows} == {True}
    assert {tuple(r["seqlens"] or ()) for r in rows} == {(), (0, 1, 9, 5)}


@pytest.mark.parametrize("name", ["sdpa-flash", "sdpa-cudnn"])
def test_sdpa_backends_that_refuse_masks_are_na_for_variants(name):
    from flashrun.errors import KernelError
    from flashrun.harness.providers import _sdpa

    with pytest.raises(KernelError, match="refuses an explicit mask"):
        _sdpa(name, Shape(1, 2, 2, 16, 16, 16, "float16", False, (3, 0)), torch.device("cpu"))


@pytest.mark.parametrize("shape", [
    Shape(1, 4, 2, 17, 29, 16, "float32", True, (4, 2), 2.0, True),
    Shape(2, 2, 2, 19, 7, 16, "float32", False, (3, 5)),
    packed(Shape(1, 2, 1, 1, 1, 16, "float32", True, (3, 0), 2.0, True), [0, 1, 9, 5], [3, 2, 12, 5]),
], ids=lambda s: s.label)
def test_flex_mods_express_the_reference(shape):
    """FlexAttention's score_mod and block mask for a variant, run eagerly on the CPU (forward
    only there): the same numbers as the reference."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from flashrun.harness.flex import block_mask_of, mods
    from flashrun.harness.provider import unpacked

    inputs = make_inputs(shape, 0, "cpu")[0]
    mask_mod, score_mod = mods(shape, torch.device("cpu"))
    block_mask = block_mask_of(shape, torch.device("cpu"), mask_mod, flex.create_block_mask)
    fn = unpacked(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                        enable_gqa=True), shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        out = fn(inputs.q, inputs.k, inputs.v)
    assert all(c.passed for c in Reference.for_shape(inputs, shape, grads=False).judge(out))
