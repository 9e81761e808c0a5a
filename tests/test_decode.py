"""Decode and the KV cache through the CPU interpreter (tiny shapes): flash_attention_with_kvcache
against the reference over the gathered cache, its argument checks, the plans and lean launches,
and the KV-cache shapes through verify and bench. Big shapes are in tests/test_gpu.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from flashrun.cli import app
from flashrun.config import BenchConfig, ExperimentConfig
from flashrun.errors import ArgumentError, KernelError
from flashrun.harness import flex as flex_provider
from flashrun.harness import kvcache as bench_kvcache
from flashrun.harness import providers
from flashrun.harness.check import POISON, _poisoned_allocations
from flashrun.harness.inputs import as_cached, block_table, from_e4m3, make_inputs, to_e4m3
from flashrun.harness.judge import Reference
from flashrun.harness.probe import launches
from flashrun.harness.shapes import Shape, bench_shapes, flops, kvcache
from flashrun.harness.verify import reproduce_command
from flashrun.kernels import alibi_slopes, attention_forward, flash_attention, flash_attention_with_kvcache, get
from flashrun.kernels.flash import attention as flash
from flashrun.kernels.flash import decode
from flashrun.kernels.flash import launch as launch_mod
from flashrun.kernels.flash.decode_jit import _attn_decode, _attn_decode_combine

runner = CliRunner()
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def _cache_inputs(lengths, heads, kv_heads, n_q, head_dim, dtype=FP16, page_size=0, new_keys=0, causal=False,
                  seed=0, **variants):
    shape = kvcache(Shape(1, heads, kv_heads, n_q, 1, head_dim, str(dtype)[6:], causal, **variants), lengths,
                    page_size, new_keys)
    return shape, make_inputs(shape, seed, "cpu")[0]


def _check(shape, inputs, cache_seqlens=None, sm_scale=None):
    """flash_attention_with_kvcache on clones of the caches, fresh allocations poisoned, judged
    by the harness's judge (the output, and the appended slots exactly)."""
    k_cache, v_cache = inputs.k.clone(), inputs.v.clone()
    with _poisoned_allocations():
        out = flash_attention_with_kvcache(
            inputs.q, k_cache, v_cache, inputs.cache_seqlens if cache_seqlens is None else cache_seqlens,
            k=inputs.k_new, v=inputs.v_new, block_table=inputs.block_table, causal=shape.causal,
            window=shape.window, softcap=shape.softcap, alibi_slopes=inputs.alibi_slopes, sm_scale=sm_scale)
    assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype
    checks = Reference.for_kvcache(inputs, causal=shape.causal, sm_scale=sm_scale).judge(out, None, POISON,
                                                                                         cache=(k_cache, v_cache))
    for check in checks:
        assert check.passed, check.reason()
    return out, k_cache, v_cache


# (cache lengths, heads, kv heads, queries, head_dim, page size, new keys): ragged lengths with an
# empty cache, pages of 16 (a page boundary inside most sequences), of 48 (not a power of two), of
# 64 (whole key blocks: one page lookup a block) and of 1 key, new keys across a page boundary, more
# queries than keys, split head dims (40, 80), MQA
CASES = [
    ((0, 17, 300), 4, 2, 1, 64, 0, 0),
    ((0, 17, 300), 4, 2, 1, 64, 16, 1),
    ((37, 0, 290), 4, 1, 3, 40, 16, 2),
    ((100, 0, 33), 8, 2, 2, 80, 48, 3),
    ((70, 0, 200), 4, 2, 2, 64, 64, 2),
    ((15, 2), 2, 2, 4, 16, 16, 1),
    ((250, 131), 8, 1, 1, 64, 1, 0),
    ((1,), 4, 4, 5, 32, 0, 0),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_kvcache_matches_the_gathered_reference(case, causal):
    lengths, heads, kv_heads, n_q, head_dim, page_size, new_keys = case
    shape, inputs = _cache_inputs(lengths, heads, kv_heads, n_q, head_dim, page_size=page_size, new_keys=new_keys,
                                  causal=causal)
    _check(shape, inputs)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_kvcache_dtypes(dtype):
    shape, inputs = _cache_inputs((33, 200), 4, 2, 2, 64, dtype, page_size=16, new_keys=2, causal=True)
    _check(shape, inputs)


@pytest.mark.parametrize("variants", [
    {"window": (8, 0), "causal": True}, {"window": (0, 0)}, {"softcap": 5.0, "alibi": True, "causal": True},
    {"window": (20, 3), "softcap": 2.0, "alibi": True}], ids=["sliding", "window0", "softcap-alibi", "all"])
def test_kvcache_variants(variants):
    # window (0, 0) with 3 new keys and one query: two of them no query sees - written all the same
    shape, inputs = _cache_inputs((9, 0, 140), 4, 2, 1, 32, page_size=16, new_keys=3, **variants)
    _check(shape, inputs)


def test_kvcache_lengths_as_an_int_and_a_scale():
    shape, inputs = _cache_inputs((140, 140), 4, 2, 2, 32, page_size=16, new_keys=1, causal=True)
    out, *_ = _check(shape, inputs, cache_seqlens=140, sm_scale=0.3)
    again, *_ = _check(shape, inputs, sm_scale=0.3)  # the same call with the lengths as a tensor
    assert torch.equal(out, again)


def test_kvcache_split_path_and_one_split():
    shape, inputs = _cache_inputs((600,), 4, 2, 1, 64)
    _check(shape, inputs)
    assert max(p.splits for p in decode._plans.values() if p.lse_shape is None) > 1  # the interpreter has 4 "SMs"
    shape, inputs = _cache_inputs(tuple(range(0, 160, 10)), 4, 2, 1, 16)  # 16 sequences: one split each
    _check(shape, inputs)


def test_new_keys_may_differ_in_the_stride_of_a_size_one_dim():
    """One kv head: k from a (B, H_kv, S, D) transpose and a contiguous v lay out the same
    elements alike though their head strides differ; the call takes them as they are. New keys
    and values laid out differently are copied into one layout (they were refused once)."""
    shape, inputs = _cache_inputs((5, 9), 4, 1, 1, 16, new_keys=3)
    k, v = inputs.k_new, inputs.v_new
    b, n, _, d = k.shape
    k_odd = k.as_strided(k.shape, (n * d, d, n * d, 1))  # (B, S, 1, D) as a transpose leaves it: head stride S·D
    assert k_odd.stride() != v.stride() and torch.equal(k_odd, k)
    lengths = torch.tensor(shape.cache_seqlens, dtype=torch.int32)
    caches = [(inputs.k.clone(), inputs.v.clone()) for _ in range(2)]
    outs = [flash_attention_with_kvcache(inputs.q, kc, vc, lengths, k=kn, v=v)
            for (kc, vc), kn in zip(caches, (k, k_odd))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0][0], caches[1][0])
    # a layout that differs (views of one fused qkv projection, as phi3's) is copied into one
    caches.append((inputs.k.clone(), inputs.v.clone()))
    out = flash_attention_with_kvcache(inputs.q, *caches[2], lengths, k=k.transpose(1, 3).contiguous().transpose(1, 3),
                                       v=v)
    assert torch.equal(out, outs[0]) and torch.equal(caches[2][0], caches[0][0]) and torch.equal(caches[2][1],
                                                                                                  caches[0][1])


def test_a_block_table_of_one_page_a_row_may_have_any_column_stride():
    """Sequences that fit one page give a (B, 1) block table, whose column stride means nothing:
    the harness's own table (a transpose made contiguous, which torch leaves as it is for a
    size-1 dim: strides (1, B)) was refused. It runs as its contiguous copy does."""
    shape, inputs = _cache_inputs((0, 17, 40), 4, 2, 1, 16, page_size=48, new_keys=2)
    table = inputs.block_table
    assert table.shape == (3, 1) and table.stride() == (1, 3)
    outs, caches = [], []
    for t in (table, table.clone(memory_format=torch.contiguous_format).as_strided((3, 1), (1, 1))):
        k_cache, v_cache = inputs.k.clone(), inputs.v.clone()
        outs.append(flash_attention_with_kvcache(inputs.q, k_cache, v_cache, inputs.cache_seqlens, k=inputs.k_new,
                                                 v=inputs.v_new, block_table=t))
        caches.append((k_cache, v_cache))
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*caches))
    _check(shape, inputs)


def test_kvcache_argument_errors():
    q = torch.randn(2, 1, 4, 16, dtype=FP16)
    cache = torch.randn(2, 32, 2, 16, dtype=FP16)
    pages = torch.randn(8, 8, 2, 16, dtype=FP16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lengths = torch.tensor([3, 5], dtype=torch.int32)

    def fails(kind, match, *args, **kwargs):
        with pytest.raises(kind, match=match) as info:
            flash_attention_with_kvcache(*args, **kwargs)
        return info.value

    fails(ArgumentError, "cache_seqlens must be an int or an int32", q, cache, cache, lengths.long())
    fails(ArgumentError, r"cache_seqlens must be in 0\.\.31", q, cache, cache, 32, k=cache[:, :1], v=cache[:, :1])
    fails(ArgumentError, "cache_seqlens must be an int or an int32 tensor", q, cache, cache, 3.0)
    fails(ArgumentError, "block_table must be int32", q, pages, pages, lengths, block_table=table.long())
    fails(ArgumentError, r"block_table must be \(2, max_pages\)", q, pages, pages, lengths, block_table=table[:1])
    fails(ArgumentError, "give both or neither", q, cache, cache, lengths, k=cache[:, :1])
    fails(KernelError, "k and v must be", q, cache, cache, lengths, k=cache[:1, :1], v=cache[:1, :1])
    fails(KernelError, "k_cache and v_cache must have the same shape", q, cache, cache[:, :8], lengths)
    fails(KernelError, "k_cache holds 2 sequences, q 3", torch.randn(3, 1, 4, 16, dtype=FP16), cache, cache, 1)
    fails(KernelError, "heads are not a multiple", torch.randn(2, 1, 3, 16, dtype=FP16), cache, cache, 1)
    fails(KernelError, "must have q's dtype", q, cache.float(), cache.float(), lengths)
    fails(KernelError, r"q must have 4 dims", q[0], cache, cache, lengths)
    error = fails(ArgumentError, "window must be a pair", q, cache, cache, lengths, window=(1,))
    assert error.hint and isinstance(error, ValueError)  # a ValueError for Python callers


def test_plans_are_cached_and_launch_every_parameter():
    q, k, v = (torch.randn(1, 4, 1, 16, dtype=FP16) if i == 0 else torch.randn(1, 2, 600, 16, dtype=FP16)
               for i in range(3))
    flash_attention(q, k, v)
    count = len(decode._plans)
    flash_attention(q, k, v)
    flash_attention(q.clone(), k.clone(), v.clone())  # other tensors, same layout and alignment: the same plan
    assert len(decode._plans) == count
    plan = decode.plan(q, k, v, 16 ** -0.5, flash.Variant())
    # the lean launch passes the per-call arguments, then the tail, in the kernel's parameter order
    assert plan.splits > 1 and plan.combine is not None
    assert 17 + len(plan.decode.tail) == len(_attn_decode.arg_names)  # 13 + an fp8 cache's 4 scale tensors
    assert 4 + len(plan.combine.tail) == len(_attn_decode_combine.arg_names)
    # the combine: a program per (row, batch and kv head, column block of the head dim)
    assert plan.combine.grid == (2, 2, 1)  # a group of 2 rows, 1 x 2 (batch, kv head) pairs, all 16 columns


def test_the_combine_spreads_a_wide_head_dim_over_column_blocks():
    """MQA: one (batch, kv head) pair merging many splits, too few rows to fill the GPU. Its
    rows' columns go to several programs (the last block partly past head_dim 80), and the
    output still matches; where the rows fill the GPU, a program takes the whole head dim."""
    shape, inputs = _cache_inputs((700,), 4, 1, 1, 80)
    decode._plans.clear()
    _check(shape, inputs)
    (plan,) = [p for p in decode._plans.values() if p.lse_shape is None]  # the KV-cache call's
    assert plan.splits > 1 and plan.combine.grid == (4, 1, 2)  # 4 rows < 2 x 4 "SMs": two blocks of 64 columns
    assert [decode.combine_cols(p, 128, torch.device("cpu")) for p in (1, 2, 4, 8)] == [32, 32, 64, 128]


def test_the_combine_merges_in_several_steps_past_empty_splits(monkeypatch):
    """The combine reads every split's partial without weighing it first: empty splits (a short
    or empty sequence, past the keys) must merge as zero weight over several steps of 2 splits."""
    monkeypatch.setattr(decode, "_plans", {})
    monkeypatch.setattr(decode, "COMBINE_TILE", 2 * 32)  # 32 columns a program: 2 splits a step
    monkeypatch.setattr(decode, "WAVES", 8)  # splits for 3 sequences on the interpreter's 4 "SMs"
    shape, inputs = _cache_inputs((700, 90, 0), 4, 1, 1, 32, causal=True)
    _check(shape, inputs)
    (plan,) = decode._plans.values()
    assert plan.splits > 4 and plan.combine.tail[-3] == 2  # BLOCK_S: more than two steps

def test_lean_launch_calls_the_compiled_kernel(monkeypatch):
    """After the first call the kept CompiledKernel is launched with integer pointers (checked
    here with a stand-in: the interpreter has no compiled kernels)."""
    seen = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            seen.append(args)

    launch = launch_mod._Launch(_attn_decode, (3, 1, 2), ("tail",), decode.DECODE)
    launch.compiled = Compiled()
    t = torch.empty(4)
    launch(7, t, None, 5)
    assert seen == [(3, 1, 2, 7, "fn", "meta", None, None, None, t.data_ptr(), None, 5, "tail")]
    # a 1-D grid (the Gluon forward's) is padded to the three the launcher takes before the stream
    flat = launch_mod._Launch(_attn_decode, (6,), ("tail",), {"num_warps": 4, "maxnreg": 168})
    flat.compiled = Compiled()
    flat(7, t)
    assert seen[-1] == (6, 1, 1, 7, "fn", "meta", None, None, None, t.data_ptr(), "tail")
    assert flat.options == {"num_warps": 4, "maxnreg": 168}
    assert not launch_mod._hooked()
    with launches():  # bench --metrics' recorder wraps CompiledKernel.launch_metadata: Triton's path
        assert launch_mod._hooked()
    assert not launch_mod._hooked()
    monkeypatch.setattr(launch_mod.knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook
    assert launch_mod._hooked()


def test_a_launcher_that_refuses_the_direct_call_sends_launches_through_triton(monkeypatch, caplog):
    class Refusing:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            raise TypeError("function takes exactly 20 arguments")

    monkeypatch.setattr(launch_mod._Launch, "direct", True)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 600, 16), torch.randn(1, 2, 600, 16)
    want = flash_attention(q, k, v)
    plan = decode.plan(q, k, v, 16 ** -0.5, flash.Variant(), write_lse=False)  # (flash_attention's without autograd)
    plan.decode.compiled = Refusing()
    assert torch.equal(flash_attention(q, k, v), want)  # launched by Triton instead
    assert not launch_mod._Launch.direct and "refused the direct call" in caplog.text


def test_decode_shapes_route_here_and_one_causal_query_is_plain():
    q = torch.randn(2, 8, 1, 64, dtype=FP16)
    k, v = (torch.randn(2, 2, 300, 64, dtype=FP16) for _ in range(2))
    variant = flash._variant(q, 2, 300, True, (-1, -1), 0.0, None)
    assert decode.applies(q, k, variant) and flash.forward_path(q, k, v, causal=True) == "triton"
    assert torch.equal(flash_attention(q, k, v, causal=True), flash_attention(q, k, v))
    assert not decode.applies(q, k[:, :, :100], variant)  # few keys: the portable forward
    assert not decode.applies(torch.randn(2, 8, 65, 64, dtype=FP16), k, variant)  # too many queries


def test_a_call_without_autograd_neither_allocates_nor_writes_the_lse(monkeypatch):
    """flash_attention without a graph to record has no use for the LSE: its decode route writes
    none (one allocation and one store fewer per call); attention_forward's, which returns it,
    is a route of its own, and both outputs agree."""
    monkeypatch.setattr(flash, "_forward_plans", {})
    monkeypatch.setattr(decode, "_plans", {})
    q = torch.randn(2, 8, 1, 64, dtype=FP16)
    k, v = (torch.randn(2, 2, 300, 64, dtype=FP16) for _ in range(2))
    out = flash_attention(q, k, v)
    assert [p.lse_shape for p in decode._plans.values()] == [None]
    o, lse = attention_forward(q, k, v)
    assert sorted(map(str, (p.lse_shape for p in decode._plans.values()))) == ["(2, 8, 1)", "None"]
    assert lse.shape == (2, 8, 1) and torch.isfinite(lse).all()
    assert torch.equal(out, o)
    assert torch.equal(flash_attention(q, k, v), out) and len(decode._plans) == 2  # the routes, again
    with torch.enable_grad():  # a graph: the LSE for the backward
        q.requires_grad_()
        flash_attention(q, k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_workspace_is_shared_on_a_stream(monkeypatch):
    monkeypatch.setattr(decode, "_workspaces", {})
    first = decode._workspace(torch.device("cpu"), None, 100, 10)
    assert decode._workspace(torch.device("cpu"), None, 50, 5) is first
    grown = decode._workspace(torch.device("cpu"), None, 200, 10)
    assert grown[0].numel() == 200 and grown[1].numel() == 10


# -- through the tool -------------------------------------------------------------------------------
def test_kvcache_shapes_labels_flops_and_records():
    shape = kvcache(Shape(1, 8, 2, 1, 1, 64, "float16", True), (0, 17, 300), 16, 1)
    assert shape.label == "B3 H8/2 N1x301 D64 fp16 causal cache[0,17,300] page16 new1"
    assert (shape.batch_size, shape.seq_len_k, shape.capacity) == (3, 301, 304)
    full = kvcache(Shape(1, 8, 2, 1, 1, 64, "float16", False), (0, 17, 300), 16, 1)
    assert flops(full, "fwd") == 4 * 8 * 64 * (1 + 18 + 301)  # the query sees every key of its sequence
    again = Shape(**json.loads(json.dumps(shape.to_json())))
    assert again == shape
    command = reproduce_command("flash", shape, 0, grad=False)
    assert "--set experiment.cache_seqlens=[0,17,300]" in command and "--set experiment.page_size=16" in command
    table = block_table(shape, "cpu")
    assert table.shape == (3, 19) and sorted(table.flatten().tolist()) == list(range(57))
    assert table[0, 1] - table[0, 0] == -3  # a sequence's pages are not side by side


def test_kvcache_config_keys_validate():
    exp = ExperimentConfig.model_validate({"cache_seqlens": [0, 5], "page_size": 16, "new_keys": 1})
    shape = Shape.from_fields({}, exp, "test")
    assert shape.cache_seqlens == (0, 5) and shape.seq_len_k == 6
    for bad in ({"page_size": 16}, {"new_keys": 1}, {"cache_seqlens": [1], "seqlens": [1]}, {"cache_seqlens": []},
                {"cache_seqlens": [-1]}, {"page_size": -1}):
        with pytest.raises(Exception):
            ExperimentConfig.model_validate(bad)
    # [] in a [verify] sweep: the same shape without a cache
    assert not Shape.from_fields({"cache_seqlens": [], "page_size": 16}, exp, "test").kvcache


def test_bench_page_sizes_add_full_cache_shapes():
    shapes = bench_shapes(BenchConfig(seq_len=[1], seq_len_k=[4096], head_dim=[128], causal=[False],
                                      page_size=[0, 16], num_kv_heads=4))
    assert [s.label for s in shapes] == ["B8 H16/4 N1x4096 D128 fp16", "B8 H16/4 N1x4096 D128 fp16 cache[" +
                                         ",".join(["4096"] * 8) + "]", "B8 H16/4 N1x4096 D128 fp16 cache[" +
                                         ",".join(["4096"] * 8) + "] page16"]


def _verify(tmp_path, *args):
    (tmp_path / "mine.py").write_text(
        "import torch\n"
        "from flashrun.kernels import flash_attention_with_kvcache\n\n"
        "def dense(q, k, v, causal=False, sm_scale=None):\n    return q\n\n"
        "def cached(q, k, v, causal=False, sm_scale=None, cache_seqlens=None, block_table=None, k_new=None,\n"
        "           v_new=None):\n"
        "    return flash_attention_with_kvcache(q, k, v, cache_seqlens, k=k_new, v=v_new, block_table=block_table,\n"
        "                                        causal=causal, sm_scale=sm_scale)\n\n"
        "def whole_cache(q, k, v, causal=False, sm_scale=None, cache_seqlens=None):\n"
        "    # attends to every slot of the cache, not to each sequence's keys: must fail\n"
        "    return flash_attention_with_kvcache(q, k, v, k.shape[1], causal=causal, sm_scale=sm_scale)\n")
    result = runner.invoke(app, ["verify", "--device", "cpu", "--json", "--set", "experiment.num_heads=4",
                                 "--set", "experiment.num_kv_heads=2", "--set", "experiment.head_dim=32",
                                 "--set", "verify.seq_len=[2]", "--set", "verify.causal=[true]", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def test_verify_runs_kvcache_cases(tmp_path):
    code, data = _verify(tmp_path, "-k", "flash", "-k", "minimal", "-k", "mine.py:dense", "-k", "mine.py:cached",
                         "--set", "verify.cache_seqlens=[[0,17,70],[33]]", "--set", "verify.page_size=[0,16]",
                         "--set", "verify.new_keys=[2]")
    assert code == 0, data["verdict"]
    results = {(r["kernel"], r["label"]): r for r in data["results"]}
    paged = "B3 H4/2 N2x72 D32 fp16 causal cache[0,17,70] page16 new2"
    assert results["flash", paged]["status"] == "pass"
    assert [c["name"] for c in results["flash", paged]["checks"]] == ["out", "k_cache", "v_cache"]
    assert results["mine.py:cached", paged]["status"] == "pass"
    assert results["mine.py:dense", paged]["status"] == "skipped"
    assert "does not take cache_seqlens, block_table, k_new, v_new" in results["mine.py:dense", paged]["message"]
    assert results["minimal", paged]["status"] == "unsupported"


def test_verify_fails_a_kernel_that_ignores_the_lengths(tmp_path):
    code, data = _verify(tmp_path, "-k", "mine.py:whole_cache", "--set", "experiment.cache_seqlens=[5,30]")
    assert code == 1
    assert data["results"][0]["status"] == "fail" and "out: max error" in data["results"][0]["message"]


def test_bench_on_the_cpu_times_the_torch_providers_on_the_gathered_cache(tmp_path):
    result = runner.invoke(app, ["bench", "--device", "cpu", "--seq-lens", "1", "--seq-lens-k", "300",
                                 "--head-dims", "32", "--causal", "no", "-p", "sdpa", "-p", "torch-naive",
                                 "-p", "flash", "-p", "flash+graph", "--set", "bench.page_size=[16]",
                                 "--set", "bench.tokens=600", "--set", "bench.hidden=128",
                                 "--set", "bench.num_kv_heads=2", "--set", "bench.rep_ms=5",
                                 "--set", "bench.warmup_ms=1", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    cached = [r for r in rows if r["cache_seqlens"]]
    assert {r["provider"] for r in cached} == {"sdpa", "torch-naive", "flash", "flash+graph"}
    assert all(r["status"] == "ok" for r in cached if r["provider"] in ("sdpa", "torch-naive"))
    assert all(r["page_size"] == 16 and r["cache_seqlens"] == [300, 300] for r in cached)
    graph = next(r for r in cached if r["provider"] == "flash+graph")
    assert graph["status"] == "n/a" and "CUDA graphs need a CUDA GPU" in graph["note"]


def test_provider_names_with_graphs():
    providers.check_names(["flash+graph", "sdpa-cudnn+graph", "mine.py:attention+graph"])
    with pytest.raises(Exception, match="unknown provider 'nope\\+graph'"):
        providers.check_names(["nope+graph"])
    provider = providers.resolve("sdpa+graph", torch.device("cpu"))
    with pytest.raises(KernelError, match="CUDA graphs need a CUDA GPU"):
        provider.prepare(Shape(1, 2, 2, 1, 8, 16, "float32", False), torch.device("cpu"))


def test_flex_paged_path_on_the_cpu():
    # FlexAttention eager (the bench compiles it on a GPU): the page pool under a converted block mask
    from torch.nn.attention.flex_attention import flex_attention

    for variants in ({}, {"causal": True, "window": (50, 0), "softcap": 2.0, "alibi": True}):
        shape, inputs = _cache_inputs((300, 300), 8, 2, 3, 32, FP32, page_size=128, **variants)
        attn = bench_kvcache.flex_paged(shape, torch.device("cpu"), flex_attention, flex_provider.mods)
        for check in Reference.for_shape(inputs, shape, grads=False).judge(attn.fn(inputs.q, inputs.k, inputs.v)):
            assert check.passed, check.reason()
    with pytest.raises(KernelError, match="ragged"):
        bench_kvcache.dense_shape(kvcache(shape, (3, 5), 16))


def test_the_judge_sees_an_append_that_did_not_happen():
    shape, inputs = _cache_inputs((5, 20), 4, 2, 1, 32, page_size=16, new_keys=2)
    k_cache, v_cache = inputs.k.clone(), inputs.v.clone()
    out = flash_attention_with_kvcache(inputs.q, k_cache.clone(), v_cache.clone(), inputs.cache_seqlens,
                                       k=inputs.k_new, v=inputs.v_new, block_table=inputs.block_table)
    checks = Reference.for_kvcache(inputs, causal=False).judge(out, cache=(k_cache, v_cache))  # caches left as were
    assert [c.passed for c in checks] == [True, False, False]


def test_kernel_registry_routes_cache_arguments():
    shape, inputs = _cache_inputs((7, 40), 4, 2, 1, 32, page_size=16, new_keys=1, alibi=True)
    kernel = get("flash")
    assert {"cache_seqlens", "block_table", "k_new", "v_new"} <= kernel.accepts
    out = kernel(inputs.q, inputs.k.clone(), inputs.v.clone(), **inputs.variant_args())
    assert torch.equal(inputs.alibi_slopes, alibi_slopes(4))
    assert Reference.for_kvcache(inputs, causal=False).judge(out)[0].passed


# -- lengths past the cache, and the LSE ---------------------------------------------------------
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("new_keys", [0, 3], ids=["read", "append"])
def test_lengths_past_the_cache_raise_and_nothing_is_written(page_size, new_keys):
    """FlashAttention-2's bounds test: a length with no room left for the new keys is refused
    before any slot is written (it used to be clamped, the append overwriting the last keys)."""
    shape, inputs = _cache_inputs((20, 9), 4, 2, 1, 32, page_size=page_size, new_keys=new_keys)
    capacity = inputs.k.shape[1] if not page_size else inputs.block_table.shape[1] * page_size
    k_cache, v_cache = inputs.k.clone(), inputs.v.clone()
    for lengths, shown in (([9, capacity - new_keys + 1], rf"got 9\.\.{capacity - new_keys + 1}"), ([-1, 9], "got -1")):
        with pytest.raises(ArgumentError, match=rf"cache_seqlens must be in 0\.\.{capacity - new_keys} .*{shown}"):
            flash_attention_with_kvcache(inputs.q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                                         k=inputs.k_new, v=inputs.v_new, block_table=inputs.block_table)
        assert torch.equal(k_cache, inputs.k) and torch.equal(v_cache, inputs.v)  # not one key lost
    _check(shape, inputs)  # the same cache with lengths that fit


def test_a_page_outside_the_cache_is_refused_and_unused_entries_are_not_read():
    shape, inputs = _cache_inputs((20, 9), 4, 2, 1, 32, page_size=16, new_keys=1)
    table = inputs.block_table.clone()
    table[1, 1:] = -1  # sequence 1's 10 keys fill one page: the rest of its row is never read
    _check(shape, dataclasses.replace(inputs, block_table=table))
    table[0, 1] = inputs.k.shape[0]  # sequence 0's second page: past the pool
    k_cache = inputs.k.clone()
    with pytest.raises(ArgumentError, match=rf"block_table points at page {inputs.k.shape[0]}; the cache has pages"):
        flash_attention_with_kvcache(inputs.q, k_cache, inputs.v.clone(), inputs.cache_seqlens, k=inputs.k_new,
                                     v=inputs.v_new, block_table=table)
    assert torch.equal(k_cache, inputs.k)


def test_lengths_are_read_back_once_per_version(monkeypatch):
    """A model's layers pass the same lengths in a step: one read-back for all of them; a change
    in place is seen."""
    shape, inputs = _cache_inputs((20, 9), 4, 2, 1, 32, new_keys=1)
    reads = []
    extremes = decode._extremes
    monkeypatch.setattr(decode, "_extremes", lambda t: reads.append(t) or extremes(t))
    lengths = inputs.cache_seqlens.clone()
    for _ in range(3):
        flash_attention_with_kvcache(inputs.q, inputs.k.clone(), inputs.v.clone(), lengths, k=inputs.k_new,
                                     v=inputs.v_new)
    assert len(reads) == 1
    lengths[1] = inputs.k.shape[1]  # no room for the new key any more
    with pytest.raises(ArgumentError, match="cache_seqlens must be in"):
        flash_attention_with_kvcache(inputs.q, inputs.k.clone(), inputs.v.clone(), lengths, k=inputs.k_new,
                                     v=inputs.v_new)


@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged"])
def test_under_graph_capture_the_kernel_refuses_a_sequence_past_the_cache(page_size, monkeypatch):
    """While a CUDA graph is captured nothing can be read back: the kernel itself writes none of
    that sequence's slots and gives it NaN, and the other sequences are untouched by it."""
    shape, inputs = _cache_inputs((20, 9), 4, 2, 2, 32, page_size=page_size, new_keys=2)
    capacity = inputs.k.shape[1] if not page_size else inputs.block_table.shape[1] * page_size
    monkeypatch.setattr(decode, "_capturing", lambda device: True)
    k_cache, v_cache = inputs.k.clone(), inputs.v.clone()
    bad = torch.tensor([20, capacity - 1], dtype=torch.int32)  # sequence 1 has room for 1 new key, not 2
    out, lse = flash_attention_with_kvcache(inputs.q, k_cache, v_cache, bad, k=inputs.k_new, v=inputs.v_new,
                                            block_table=inputs.block_table, return_lse=True)
    assert out[1].isnan().all() and lse[1].isnan().all()
    assert not out[0].isnan().any() and not lse[0].isnan().any()
    good_k, good_v = inputs.k.clone(), inputs.v.clone()
    expected = flash_attention_with_kvcache(inputs.q, good_k, good_v, torch.tensor([20, 0], dtype=torch.int32),
                                            k=inputs.k_new, v=inputs.v_new, block_table=inputs.block_table)
    assert torch.equal(out[0], expected[0])
    # only sequence 0's two new slots changed: sequence 1 wrote nothing
    changed = (k_cache != inputs.k).any(-1).any(-1)  # (batch or page, slot)
    assert torch.equal(changed, (good_k != inputs.k).any(-1).any(-1) & ~_slots_of(inputs, 1, page_size, changed))


def _slots_of(inputs, b, page_size, like):
    """The cache slots that belong to sequence ``b`` (its pages, or its row)."""
    mask = torch.zeros_like(like)
    if page_size:
        mask[inputs.block_table[b].long()] = True
    else:
        mask[b] = True
    return mask


@pytest.mark.parametrize(("lengths", "page_size", "new_keys", "causal"), [
    ((600,), 0, 0, False),  # split over programs: the combine writes the LSE
    ((0, 17, 70), 16, 2, True),  # an empty cache, pages, appended keys, a causal query block
    ((33, 5), 0, 1, False),
])
def test_kvcache_returns_the_log_sum_exp(lengths, page_size, new_keys, causal):
    """return_lse: each query's natural-log sum of exp(scores) over the keys it sees, (B, H, Sq),
    within twice PyTorch's own error in float16 of the float64 truth."""
    from flashrun.harness.reference import attention_ref, gather_kvcache

    shape, inputs = _cache_inputs(lengths, 4, 2, 3, 32, page_size=page_size, new_keys=new_keys, causal=causal)
    out, lse = flash_attention_with_kvcache(inputs.q, inputs.k.clone(), inputs.v.clone(), inputs.cache_seqlens,
                                            k=inputs.k_new, v=inputs.v_new, block_table=inputs.block_table,
                                            causal=causal, return_lse=True)
    assert lse.shape == (len(lengths), 4, 3) and lse.dtype == torch.float32
    q, k, v, _, cu_k = gather_kvcache(inputs.q, inputs.k, inputs.v, inputs.cache_seqlens, inputs.block_table,
                                      inputs.k_new, inputs.v_new)
    for b in range(len(lengths)):
        qb = q[b * 3:(b + 1) * 3].transpose(0, 1)[None]  # (1, H, Sq, D)
        kb, vb = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
        _, truth = attention_ref(qb, kb, vb, causal=causal, return_lse=True)
        _, yard = attention_ref(qb, kb, vb, causal=causal, upcast=False, return_lse=True)
        seen = truth[0].isfinite()
        assert torch.equal(seen, lse[b].isfinite()) and (lse[b][~seen] == float("-inf")).all()
        err = (lse[b][seen].double() - truth[0][seen]).abs().max() if seen.any() else 0
        allowed = 2 * (yard[0][seen].double() - truth[0][seen]).abs().max() + 1e-3 if seen.any() else 0
        assert err <= allowed, (b, err, allowed)


# -- an fp8 cache --------------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


def _keys_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` (B or page, keys, H_kv, D) with the same values, its memory (B or page, H_kv, D, keys)."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@pytest.mark.parametrize(("mode", "v_keys"), [("tensor", False), ("token", False), ("tensor", True)],
                         ids=["tensor", "token", "tensor-v-keys"])
@pytest.mark.parametrize(("lengths", "page_size", "new_keys", "causal"), [
    ((0, 17, 300), 16, 2, False),  # an empty cache, pages, appended keys
    ((600,), 0, 0, False),  # split over programs
    ((33, 70), 48, 3, True),  # pages of 48, causal queries over appended keys
], ids=["paged-append", "split", "causal-p48"])
def test_an_fp8_cache_matches_the_reference_on_its_dequantized_keys(mode, v_keys, lengths, page_size, new_keys,
                                                                     causal):
    """An e4m3 cache read as cache · scale, bf16 queries: judged by the usual rule on the
    dequantized cache (all the maths after the dequantization is bf16/fp32). New bf16 keys are
    quantized by the call (their own power-of-two scales in token mode) and land in the cache.
    ``v_keys``: V's memory keys-contiguous, (B or page, H_kv, D, keys) (vLLM's value cache)."""
    shape, inputs = _cache_inputs(lengths, 4, 2, 3 if causal else 1, 32, dtype=BF16, page_size=page_size,
                                  new_keys=new_keys, causal=causal)
    k8, k_scale = to_e4m3(inputs.k, mode)
    v8, v_scale = to_e4m3(inputs.v, mode)
    k_cache, v_cache = k8.clone(), v8.clone()
    if v_keys:
        v_cache = _keys_contiguous(v_cache)
    scales = (k_scale.clone(), v_scale.clone()) if mode == "token" else (k_scale, v_scale)
    out = flash_attention_with_kvcache(inputs.q, k_cache, v_cache, inputs.cache_seqlens, k=inputs.k_new,
                                       v=inputs.v_new, block_table=inputs.block_table, causal=causal,
                                       k_scale=scales[0], v_scale=scales[1])
    assert out.dtype == BF16
    new = {}
    if new_keys:  # what the call must have appended: the new keys as the cache stores them
        new = {"k": as_cached(inputs.k_new, scales[0]), "v": as_cached(inputs.v_new, scales[1])}
    truth = dataclasses.replace(inputs, k=from_e4m3(k8, k_scale, BF16), v=from_e4m3(v8, v_scale, BF16),
                                k_new=new.get("k"), v_new=new.get("v"))
    checks = Reference.for_kvcache(truth, causal=causal).judge(out, None, None,
                                                                cache=(from_e4m3(k_cache, scales[0], BF16),
                                                                       from_e4m3(v_cache, scales[1], BF16)))
    for check in checks:  # the output, and each appended slot exactly (scale included)
        assert check.passed, check.reason()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("decades", [(-12, 3), (-5, -3)], ids=["1e-12..1e3", "1e-5..1e-3"])
def test_token_scales_keep_float16_p_accurate(monkeypatch, dtype, decades):
    """An fp8 cache with a scale per key and fp16 queries, P in float16: P takes each V scale over
    its tile's largest, since P · scale itself can leave float16's range (scales near 1e-8 flush it
    to zero). With V's rows spanning 1e-12 to 1e3 within every tile, or all tiny, the output passes
    the judge on the dequantized cache; so do bf16 queries (P · scale in bf16, with float16 dots for
    the scores or without)."""
    gen = torch.Generator().manual_seed(0)
    shape, inputs = _cache_inputs((200, 1000), 4, 2, 1, 32, dtype=dtype)
    low, high = decades
    size = 10.0 ** (torch.rand(inputs.v.shape[:-1], generator=gen) * (high - low) + low)
    k8, k_scale = to_e4m3(inputs.k, "token")
    v8, v_scale = to_e4m3((inputs.v.float() * size[..., None]).to(dtype), "token")
    truth = dataclasses.replace(inputs, k=from_e4m3(k8, k_scale, dtype), v=from_e4m3(v8, v_scale, dtype))
    for f16_dots in (True, False) if dtype == BF16 else (True,):
        monkeypatch.setattr(decode, "FP8_DOT_F16", f16_dots)
        monkeypatch.setattr(decode, "_plans", {})
        out = flash_attention_with_kvcache(inputs.q, k8, v8, inputs.cache_seqlens, k_scale=k_scale, v_scale=v_scale)
        (check,) = Reference.for_kvcache(truth, causal=False).judge(out, None, None)
        assert check.passed, check.reason()


def test_token_scales_may_differ_in_the_stride_of_a_size_one_dim():
    """MQA token scales (B, S, 1): k's from a transpose and v's contiguous lay out the same
    elements alike; the call takes them (a size-1 dim's stride never counts) and gives what two
    contiguous ones give."""
    shape, inputs = _cache_inputs((30, 70), 4, 1, 1, 16, dtype=BF16)
    k8, k_scale = to_e4m3(inputs.k, "token")
    v8, v_scale = to_e4m3(inputs.v, "token")
    b, n, _ = k_scale.shape
    k_odd = k_scale.as_strided(k_scale.shape, (n, 1, n))
    assert k_odd.stride() != v_scale.stride() and torch.equal(k_odd, k_scale)
    outs = [flash_attention_with_kvcache(inputs.q, k8, v8, inputs.cache_seqlens, k_scale=ks, v_scale=v_scale)
            for ks in (k_scale, k_odd)]
    assert torch.equal(outs[0], outs[1])


def test_fp8_cache_argument_errors():
    q = torch.randn(2, 1, 4, 16, dtype=BF16)
    cache = torch.randn(2, 32, 2, 16).to(E4M3)
    scales = torch.ones(2, 32, 2)
    lengths = torch.tensor([3, 5], dtype=torch.int32)

    def fails(kind, match, *args, **kwargs):
        with pytest.raises(kind, match=match):
            flash_attention_with_kvcache(*args, **kwargs)

    fails(KernelError, "an fp8 cache takes float16 or bfloat16 queries", q.float(), cache, cache, lengths)
    fails(KernelError, "v_cache must have", q, cache, cache.to(BF16), lengths)
    fails(ArgumentError, r"token scales: k_scale and v_scale must both be float32 tensors \(2, 32, 2\)", q, cache,
          cache, lengths, k_scale=scales[:, :8], v_scale=scales[:, :8])
    fails(ArgumentError, "token scales", q, cache, cache, lengths, k_scale=scales, v_scale=0.5)
    fails(ArgumentError, "k_scale must be a positive number", q, cache, cache, lengths, k_scale=-1.0)
    fails(ArgumentError, "k_scale and v_scale dequantize an fp8 cache", q, cache.to(BF16), cache.to(BF16), lengths,
          k_scale=2.0)


@pytest.mark.parametrize("f16_dots", [False, True], ids=["widened", "f16-dots"])
def test_an_fp8_cache_with_unit_scales_is_the_bf16_cache_it_holds(monkeypatch, f16_dots):
    """e4m3 values are exact in bf16: widened to the queries' bf16, the same cache stored both
    ways gives the same output. Through float16 dots (decode.FP8_DOT_F16, the default) the
    queries and P are rounded to float16, not bfloat16: closer to float32 attention over the
    same values (the float32 path) than the bf16 cache's output is, with queries large and small
    (the power-of-two scaling into float16's range)."""
    monkeypatch.setattr(decode, "FP8_DOT_F16", f16_dots)
    monkeypatch.setattr(decode, "_plans", {})
    for size in (1.0, 3e5, 1e-5):
        shape, inputs = _cache_inputs((40, 9), 4, 2, 1, 32, dtype=BF16, page_size=16)
        q = (inputs.q.float() * size).to(BF16)
        k8, v8 = inputs.k.to(E4M3), inputs.v.to(E4M3)
        as_fp8 = flash_attention_with_kvcache(q, k8, v8, inputs.cache_seqlens, block_table=inputs.block_table)
        as_bf16 = flash_attention_with_kvcache(q, k8.to(BF16), v8.to(BF16), inputs.cache_seqlens,
                                               block_table=inputs.block_table)
        if not f16_dots:
            assert torch.equal(as_fp8, as_bf16)
            continue
        truth = flash_attention_with_kvcache(q.float(), k8.float(), v8.float(), inputs.cache_seqlens,
                                             block_table=inputs.block_table)  # float32 throughout
        assert (as_fp8.float() - truth).abs().max() <= (as_bf16.float() - truth).abs().max(), size


def test_verify_judges_an_fp8_cache_on_what_it_holds(tmp_path):
    """verify's fp8 cases: the verdict on the dequantized cache (and the appended slots as the fp8
    cache holds them), the error against the unquantized keys reported beside it; a kernel that
    reads the fp8 cache without its scales fails."""
    (tmp_path / "fp8.py").write_text(
        "from flashrun.kernels import flash_attention_with_kvcache\n\n"
        "def unscaled(q, k, v, causal=False, sm_scale=None, cache_seqlens=None, block_table=None, k_new=None,\n"
        "             v_new=None, k_scale=None, v_scale=None):\n"
        "    return flash_attention_with_kvcache(q, k, v, cache_seqlens, k=k_new, v=v_new, block_table=block_table,\n"
        "                                        causal=causal, sm_scale=sm_scale)\n")
    code, data = _verify(tmp_path, "-k", "flash", "-k", f"{tmp_path / 'fp8.py'}:unscaled",
                         "--set", "verify.cache_seqlens=[[0,17,70]]", "--set", "verify.page_size=[0,16]",
                         "--set", "verify.new_keys=[2]", "--set", "verify.kv_scale=['', 'tensor', 'token']",
                         "--set", "verify.dtype=['float16', 'bfloat16']")
    results = {(r["kernel"], r["label"]): r for r in data["results"]}
    labels = {label for kernel, label in results if kernel == "flash"}
    assert "B3 H4/2 N2x72 D32 bf16 causal cache[0,17,70] page16 new2 e4m3/token" in labels
    assert {r["status"] for (kernel, _), r in results.items() if kernel == "flash"} == {"pass"}, data["verdict"]
    fp8 = [r for (kernel, label), r in results.items() if kernel == "flash" and "e4m3" in label]
    assert len(fp8) == 8 and all([c["name"] for c in r["checks"]] == ["out", "k_cache", "v_cache"] for r in fp8)
    assert all(any("against the unquantized keys" in note for note in r["notes"]) for r in fp8)
    # a user's kernel on the CPU: bf16 cases skipped (the interpreter's bf16 tl.dot), fp16 ones judged
    unscaled = [r for (kernel, label), r in results.items()
                if kernel != "flash" and "e4m3" in label and "fp16" in label]
    assert len(unscaled) == 4 and {r["status"] for r in unscaled} == {"fail"}
    assert code == 1


def test_an_fp8_cache_needs_a_kv_cache_and_half_precision():
    with pytest.raises(ValueError, match="kv_scale .* needs cache_seqlens"):
        ExperimentConfig(kv_scale="tensor")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ExperimentConfig(kv_scale="token", cache_seqlens=(3,), dtype="float32")
    shapes = bench_shapes(BenchConfig(seq_len=[1], seq_len_k=[64], head_dim=[32], causal=[False], hidden=64,
                                      tokens=128, dtype=["float16", "float32"], page_size=[16],
                                      kv_scale=["", "token"]))
    cached = [s.label for s in shapes if s.kvcache]
    assert cached == ["B2 H2 N1x64 D32 fp16 cache[64,64] page16", "B2 H2 N1x64 D32 fp16 cache[64,64] page16 e4m3/token",
                      "B2 H2 N1x64 D32 fp32 cache[64,64] page16"]  # fp32 has no fp8 cache
