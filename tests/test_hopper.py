"""The Gluon sm_90 forward's gate and first-use check (flashrun.kernels.flash.hopper).

No GPU here: the gate must be off (interpreter, CPU), and its fallback logic is tested by
pretending the gate is on and injecting a failing or wrong kernel function as flash_hopper.RUN;
the "portable" side of the check and the fallback are the real interpreted ``_attn_fwd``.
Whether the kernel compiles for sm_90 is tests/compile_hopper.py's job (run below).
"""

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashrun.kernels.flash import attention as flash, hopper as flash_hopper
from flashrun.kernels.flash.args import tma_aligned


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

    def bad_kernel(q, k, v, sm_scale, causal, cfg, programs=None):
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


def _portable_as_gluon(used):
    def good_kernel(q, k, v, sm_scale, causal, cfg, programs=None):  # the portable kernel standing in for a correct one
        used.append((q.shape, causal, cfg, programs))
        return flash._attn_forward(q, k, v, sm_scale, flash.Variant(causal=causal), "default", try_gluon=False,
                                   key=None)  # (a kernel keeps no forward route)
    return good_kernel


def test_passed_check_takes_the_path(monkeypatch, caplog):
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "GATE", {(64, False): ((0, 0, "d64"),), (64, True): ((0, 0, "d64"),)})
    used = []
    good_kernel = _portable_as_gluon(used)

    monkeypatch.setattr(flash_hopper, "RUN", good_kernel)
    q, k, v = _inputs(n=33, h=4, h_kv=2)
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        assert flash.forward_path(q, k, v) == "gluon-sm90"
        o = flash.flash_attention(q, k, v)
    assert flash_hopper.LAST_PATH == "gluon-sm90"
    assert not [r for r in caplog.records if r.name == "flashrun.hopper"]
    assert len(used) == 2 + 1  # the check's two cases (causal and not), then the call
    assert flash._forward_plans == {}  # the check's portable runs keep no route (a stand-in RUN keeps none)
    assert {u[2] for u in used} == {flash_hopper.KERNELS["d64"]}
    torch.testing.assert_close(o, flash._attn_forward(q, k, v, 64 ** -0.5, flash.Variant(), try_gluon=False)[0])


def test_a_passed_check_is_remembered_across_processes(monkeypatch, tmp_path):
    _pretend_hopper(monkeypatch)
    monkeypatch.setenv("FLASHRUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: f"{dtype}-{head_dim}")
    runs = []

    def good_kernel(q, k, v, sm_scale, causal, cfg=None, programs=None):
        runs.append(q.shape)
        return flash._attn_forward(q, k, v, sm_scale, flash.Variant(causal=causal), "default", try_gluon=False)

    monkeypatch.setattr(flash_hopper, "RUN", good_kernel)
    q, k, v = _inputs()
    checked = 2 * len(flash_hopper.gated_kernels(64))  # each gated kernel, causal and not
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == checked  # the check ran
    assert set(json.loads((tmp_path / "hopper-checks.json").read_text())) == {"torch.float32-64"}
    flash_hopper.reset()  # a new process: same GPU, driver, Triton, sources (the same verdict key)
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == checked  # taken from the file, nothing ran
    flash_hopper.reset()
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: "another driver")
    assert flash.forward_path(q, k, v) == "gluon-sm90" and len(runs) == 2 * checked  # anything else changed: checked again


def test_a_failed_check_is_not_remembered(monkeypatch, tmp_path):
    _pretend_hopper(monkeypatch)
    monkeypatch.setenv("FLASHRUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: "key")
    monkeypatch.setattr(flash_hopper, "RUN", lambda q, k, v, sm_scale, causal, cfg=None, programs=None: (
        torch.zeros_like(q), torch.zeros(q.shape[:3])))
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v) == "triton"
    assert not (tmp_path / "hopper-checks.json").exists()


def test_compiling_ahead_runs_no_check(monkeypatch):
    """In compile-only mode the check's launches are handed over and nothing is compared; the
    check itself runs on the first real call."""
    from flashrun.kernels import tuning

    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(flash_hopper, "RUN", lambda q, k, v, sm_scale, causal, cfg=None, programs=None: (
        torch.zeros_like(q), torch.zeros(q.shape[:3])))
    handed = []
    q, k, v = _inputs()
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel.__name__)):
        assert flash_hopper.ensure_checked(q.device, q.dtype, 64, flash._portable_check)
    # the portable side of the check, causal and not, for each kernel the gate uses at head_dim 64
    assert handed == ["_attn_fwd"] * 2 * len(flash_hopper.gated_kernels(64))
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


def test_first_use_check_covers_every_gated_kernel(monkeypatch):
    """Each kernel GATE uses at a head_dim is checked on that head_dim's first use, causal and not; a
    persistent one on CHECK_PROGRAMS programs (each loops over several tiles: the cross-tile path)."""
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "GATE", {(128, False): ((0, 0, "d128-persistent"), (4096, 0, "d128")),
                                               (128, True): ((0, 0, "d128-m64"), (2048, 0, None))})
    used = []
    monkeypatch.setattr(flash_hopper, "RUN", _portable_as_gluon(used))
    q, k, v = _inputs(n=20, d=128)
    assert flash.forward_path(q, k, v) == "gluon-sm90"
    checked = [(causal, cfg, programs) for _, causal, cfg, programs in used]
    kernels = flash_hopper.KERNELS
    assert checked == [(False, kernels["d128-persistent"], 2), (True, kernels["d128-persistent"], 2),
                       (False, kernels["d128"], None), (True, kernels["d128"], None),
                       (False, kernels["d128-m64"], None), (True, kernels["d128-m64"], None)]
    used.clear()
    flash.attention_forward(q, k, v)  # 20 keys, not causal: the first row
    assert [u[2] for u in used] == [kernels["d128-persistent"]]
    used.clear()
    flash.attention_forward(q, k, v, causal=True)
    assert [u[2] for u in used] == [kernels["d128-m64"]]


def _binaries(names):
    """The distinct compiled kernels among these names (persistent is a grid size, not a binary)."""
    return {replace(flash_hopper.KERNELS[n], persistent=False) for n in names}


def test_compiles_for_hopper(python):
    """Every kernel in KERNELS compiles for sm_90 (fp16 full and bf16 causal: each dtype and mask
    once, to keep the suite's time; the script without --pairs compiles all four), without spills,
    launching the threads programs_per_sm assumes (skips where this Triton lacks the Gluon Hopper
    API or a CUDA backend)."""
    result = python(str(Path(__file__).parent / "compile_hopper.py"), "--pairs")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 2 * len(_binaries(flash_hopper.KERNELS))
    assert "wgmma 0 " not in result.stdout and "tma 0 " not in result.stdout
    for line in result.stdout.splitlines():
        if line.startswith("ok ") and "ptxas:" in line and "(no bundled ptxas)" not in line:
            assert "spill stores/loads 0/0 B" in line, line
        if line.startswith("ok "):
            # q_regs: every wgmma takes A from registers (S's Q as P V's P) - but where a second
            # column block meets a causal mask, whose first block's S reads Q from shared memory
            names, _, mask = line.split()[1:4]
            cfg = flash_hopper.KERNELS[names.split("/")[0]]
            wgmma, rs = (int(re.search(rf"\b{what} (\d+)", line).group(1)) for what in ("wgmma", "rs"))
            one_block = flash_hopper.split_head_dim(cfg.head_dim)[1] == 0
            assert (rs == wgmma) == (cfg.q_regs and (one_block or mask == "full:")), line
            assert rs > 0, line  # P V's P always


def test_tma_alignment():
    q = torch.empty(2, 4, 40, 64, dtype=torch.float16)
    assert tma_aligned(q)
    assert tma_aligned(q.transpose(1, 2).contiguous().transpose(1, 2))  # a model's (B, N, H, D) projection
    assert not tma_aligned(q.transpose(2, 3))  # head_dim not contiguous
    assert not tma_aligned(q[:, :1].expand(2, 4, 40, 64))  # stride 0: no TMA descriptor
    assert not tma_aligned(torch.empty(2, 4, 40, 68, dtype=torch.float16)[..., :60])  # 136-byte rows


@pytest.mark.parametrize("head_dim,n_k,tiles,causal,why", [
    (128, 256, 1024, False, "fewer than 512 keys"), (128, 512, 1024, False, None),
    (128, 1024, 512, False, "fewer than 1024 query tiles of 128 rows at 1024 keys"),
    (128, 2048, 1, False, None), (128, 4096, 1, True, None),
    (128, 2048, 1, True, None), (128, 1024, 4096, True, None),
    (128, 1024, 4095, True, "fewer than 4096 query tiles of 128 rows at 1024 keys"),
    (128, 512, 4096, True, None), (128, 512, 4095, True, "fewer than 4096 query tiles of 128 rows at 512 keys"),
    (128, 256, 4096, True, "fewer than 512 keys"), (64, 1024, 1024, False, None),
    (64, 1024, 1023, False, "fewer than 1024 query tiles"), (64, 2048, 1, False, None),
    (64, 512, 1024, False, "fewer than 1024 keys"), (64, 2048, 2047, True, "fewer than 2048 query tiles"),
    (64, 2048, 2048, True, None), (64, 4096, 2047, True, "fewer than 2048 query tiles of 128 rows at 4096 keys"),
    (64, 1024, 8192, True, None), (64, 1024, 8191, True, "fewer than 8192 query tiles of 128 rows at 1024 keys"),
    (64, 512, 8192, True, "head_dim 64 causal with fewer than 1024 keys"),
    (64, 8192, 1, True, None), (256, 40, 1, False, None),
    (256, 40, 1, True, None), (192, 40, 1, True, None), (192, 4096, 1, False, None), (96, 4096, 1, False, None),
    (96, 8192, 1, True, None), (96, 512, 1, False, "fewer than 1024 keys"), (80, 4096, 1, False, "head_dim 80")])
def test_where_the_h200_measured_it_faster(head_dim, n_k, tiles, causal, why):
    # round 6's H200 probe (NOTES v6): 128 from 2048 keys, 64 from 2048 (8192 causal), 192 and 256
    # at every length; round 12's (NOTES v12): 128 causal from 2048 keys (was 4096); round 14's
    # (NOTES v14): with 1024 query tiles or more, 128 from 512 keys and 64 from 1024; round 22's (NOTES
    # v22): causal on the persistent kernels, 128 from 1024 keys with 4096 tiles, 64 from 2048 keys
    # with 8192 tiles; round 26's (NOTES v26): 128 causal from 512 keys with 4096 tiles; round 28's
    # (NOTES v28): 64 causal from 1024 keys with 8192 tiles and from 2048 with 2048
    q = torch.empty(1, tiles, 128, head_dim, dtype=torch.float16)  # one 128-row tile per head
    k = torch.empty(1, 1, n_k, head_dim, dtype=torch.float16)
    assert flash_hopper.query_tiles(q) == tiles
    variant = flash._variant(q, 1, n_k, causal, (-1, -1), 0.0, None)
    reason = flash_hopper.scope(q, k, k, variant)
    assert reason == why if why is None else why in reason


def test_head_dim_192_causal_runs_persistent_below_8192_keys():
    # round 27's probe (NOTES v27): the persistent kernel's serpentine tiles 1.01-1.10x "d192" from
    # 1024 to 4096 causal keys, 0.98x at 8192
    assert [flash_hopper.kernel_for(192, True, n, 2560) for n in (17, 1024, 8191, 8192, 16384)] == \
        ["d192-persistent"] * 3 + ["d192"] * 2
    assert flash_hopper.kernel_for(192, False, 8192, 1) == "d192-persistent"


def test_gate_table_picks_the_last_row_reached(monkeypatch):
    monkeypatch.setattr(flash_hopper, "GATE", {(128, True): ((0, 0, "d128-persistent"), (2048, 0, "d128"),
                                                             (4096, 100, "d128-m64"), (65536, 0, None))})
    assert [flash_hopper.kernel_for(128, True, n, 1) for n in (1, 2047, 2048, 65535, 65536)] == \
        ["d128-persistent", "d128-persistent", "d128", "d128", None]
    # a row whose tiles are not reached is skipped: the last row reached decides
    assert [flash_hopper.kernel_for(128, True, 4096, tiles) for tiles in (99, 100)] == ["d128", "d128-m64"]
    assert flash_hopper.kernel_for(128, False, 4096, 1) is None  # no rows: the portable kernel
    assert flash_hopper.gated_kernels(128) == ["d128-persistent", "d128", "d128-m64"]
    assert flash_hopper.gated_kernels(64) == []


def test_gate_names_known_kernels_of_their_head_dim():
    for (head_dim, _), rows in flash_hopper.GATE.items():
        assert [least for least, _, _ in rows] == sorted(least for least, _, _ in rows)
        for _, _, name in rows:
            assert name is None or flash_hopper.KERNELS[name].head_dim == head_dim


@pytest.mark.parametrize("name", list(flash_hopper.KERNELS))
def test_every_kernel_fits_an_sm(name):
    cfg = flash_hopper.KERNELS[name]
    assert flash_hopper.smem_bytes(cfg) <= flash_hopper.SMEM_LIMIT - 1024
    assert flash_hopper.launched_threads(cfg) * cfg.maxnreg <= 65536
    if cfg.consumers == 2:  # the two consumer warpgroups and the producer's within the launch's registers
        assert 2 * 128 * cfg.consumer_regs + 128 * cfg.producer_regs <= flash_hopper.launched_threads(cfg) * cfg.maxnreg
    assert cfg.stages >= 2 or not cfg.overlap
    # 64-row tiles exist to put two programs on an SM
    assert flash_hopper.programs_per_sm(cfg) == (2 if cfg.consumers == 1 else 1)


@pytest.mark.parametrize("head_dim,blocks", [(64, (64, 0)), (128, (128, 0)), (192, (128, 64)), (256, (256, 0)),
                                             (96, (64, 32))])
def test_split_head_dim(head_dim, blocks):
    assert flash_hopper.split_head_dim(head_dim) == blocks


@pytest.mark.skipif(flash_hopper.gluon_api() is not None, reason="this Triton lacks the Gluon Hopper API")
@pytest.mark.parametrize("name,shape,sms,programs,grid", [
    ("d128", (2, 4, 1000, 128), 132, None, 8 * 8),  # one program per 128-row tile
    ("d128-persistent", (2, 4, 1000, 128), 132, None, 64),  # fewer tiles than SMs: one each
    ("d128-persistent", (2, 4, 1000, 128), 4, None, 4),
    ("d128-persistent", (2, 4, 1000, 128), 132, 3, 3),  # the first-use check's cap
    ("d128-m64-persistent", (2, 4, 1000, 128), 4, None, 8),  # 64-row tiles, two programs per SM
    ("d192", (1, 2, 17, 192), 132, None, 2),
    ("d256-base", (1, 2, 17, 256), 132, None, 2)])  # (no overlap: O by its pointer)
def test_launch_grid_and_column_blocks(name, shape, sms, programs, grid):
    cfg = flash_hopper.KERNELS[name]
    q = torch.empty(shape, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(shape[:3])
    got, args, constexprs, _ = flash_hopper.launch_args(q, q, q, o, lse, 0.1, True, cfg, sms, programs)
    assert got == (grid,)
    d0, d1 = flash_hopper.split_head_dim(shape[-1])
    assert (constexprs["HEAD_D0"], constexprs["HEAD_D1"], constexprs["CONSUMERS"]) == (d0, d1, cfg.consumers)
    q_desc, q1_desc = args[:2]
    assert list(q_desc.block_shape) == [1, 1, 64, d0]
    assert list(q1_desc.block_shape) == ([1, 1, 64, d1] if d1 else [1, 1, 64, d0])
    # O leaves by TMA through a K or V tile (64 rows of a consumer, as Q's boxes, a descriptor per
    # column block) where the overlapped loop runs key blocks of at least 64 rows; else by its pointer
    out = cfg.overlap and cfg.block_n >= 64
    assert constexprs["TMA_O"] is out and args[6] is o and args[7] is lse
    if out:
        assert args[8].base is o and list(args[8].block_shape) == [1, 1, 64, d0] and args[8].layout == q_desc.layout
        assert (args[9].base is o and list(args[9].block_shape) == [1, 1, 64, d1] and args[9].layout == q1_desc.layout
                if d1 else args[9] is args[8])
    else:
        assert args[8] is None and args[9] is None
    assert flash_hopper.PER_CALL == 10


@pytest.mark.skipif(flash_hopper.gluon_api() is not None, reason="this Triton lacks the Gluon Hopper API")
@pytest.mark.parametrize("n_q,n_k,causal,out", [(300, 300, True, True), (300, 299, True, False),
                                                (300, 299, False, True), (17, 4000, True, True)])
def test_o_by_tma_only_where_every_tile_sees_a_key(n_q, n_k, causal, out):
    """The kernel's TMA store of O goes through the tile's last K/V stage, which a tile with no key
    lacks: bottom-right causal with fewer keys than queries leaves the first rows keyless."""
    q = torch.empty(1, 2, n_q, 192, dtype=torch.float16)
    k = torch.empty(1, 2, n_k, 192, dtype=torch.float16)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    _, args, constexprs, _ = flash_hopper.launch_args(q, k, k, o, lse, 0.1, causal, flash_hopper.KERNELS["d192"], 132)
    assert constexprs["TMA_O"] is out and (args[8] is not None) is out


# -- first use in the background (the library's default on a GPU) ---------------------------------


class _Pool:
    """A stand-in for warmup.Batch: collects a check's launches (compile-only) into one Compile
    whose readiness the test sets."""

    def __init__(self):
        from flashrun.kernels import warmup

        self.handed, self.batches = [], []
        self.compile = warmup.Compile("check", None)
        pool = self

        class Batch:
            def __init__(self):
                pool.batches.append(self)

            def collect(self, launches):
                from flashrun.kernels import tuning

                with tuning.compile_only(lambda kernel, grid, args, kwargs: pool.handed.append(kernel.__name__)):
                    launches()
                return [pool.compile]

            def wait(self, kernels):
                assert all(c.ready.is_set() for c in kernels)

        self.Batch = Batch


@pytest.fixture
def in_background(monkeypatch):
    from flashrun.kernels import warmup

    pool = _Pool()
    monkeypatch.setattr(warmup, "Batch", pool.Batch)
    monkeypatch.setattr(flash_hopper, "background", lambda: True)
    monkeypatch.setattr(flash_hopper, "_verdict_key", lambda device, dtype, head_dim: None)
    return pool


def test_a_first_use_checks_in_the_background_while_the_portable_kernel_runs(monkeypatch, in_background):
    """The first call hands the check's launches and its own Gluon launch to the compile pool and
    runs the portable kernel, keeping no route; so do calls until those compiles are ready; the
    next call then checks (small launches) and takes the Gluon path, as every call after it."""
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "GATE", {(64, False): ((0, 0, "d64"),), (64, True): ((0, 0, "d64"),)})
    used = []
    monkeypatch.setattr(flash_hopper, "RUN", _portable_as_gluon(used))
    q, k, v = _inputs(n=33)
    want, _ = flash._attn_forward(q, k, v, 64 ** -0.5, flash.Variant(causal=True), try_gluon=False, key=None)
    for _ in range(2):
        out, _ = flash.attention_forward(q, k, v, causal=True)
        assert flash_hopper.LAST_PATH == "triton" and torch.equal(out, want)
        assert not flash._forward_plans and flash_hopper._checked == {}
    assert len(in_background.batches) == 1  # started once
    # compile-only: the check's Gluon stand-in and portable side, causal and not, then the call's own launch
    assert [u[1] for u in used] == [False, True, True] and in_background.handed.count("_attn_fwd") == 5
    used.clear()
    in_background.compile.ready.set()
    flash.attention_forward(q, k, v, causal=True)
    assert flash_hopper.LAST_PATH == "gluon-sm90" and flash_hopper._checked == {(q.dtype, 64): None}
    assert [u[1] for u in used] == [False, True, True]  # the check ran, then the call
    used.clear()
    flash.attention_forward(q, k, v, causal=True)
    assert flash_hopper.LAST_PATH == "gluon-sm90" and [u[1] for u in used] == [True]  # decided: no check


def test_a_background_check_that_fails_turns_the_path_off_once(monkeypatch, in_background, caplog):
    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "RUN", lambda q, k, v, sm_scale, causal, cfg=None, programs=None: (
        torch.zeros_like(q), torch.zeros(q.shape[:3])))
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v) == "triton" and flash_hopper._checked == {}
    in_background.compile.ready.set()
    with caplog.at_level(logging.WARNING, logger="flashrun.hopper"):
        assert flash.forward_path(q, k, v) == "triton"
        assert flash.forward_path(q, k, v) == "triton"
    assert len([r for r in caplog.records if "disagrees" in r.getMessage()]) == 1
    assert flash_hopper._checked[(q.dtype, 64)].startswith("disabled")


def test_compiling_ahead_in_the_background_lists_the_portable_kernel(monkeypatch, in_background):
    """An API call's compile-ahead (attention._compile_ahead) lists what the call will run while
    the verdict is open: the portable kernel, not the check's or the Gluon launches."""
    from flashrun.kernels import tuning

    _pretend_hopper(monkeypatch)
    monkeypatch.setattr(flash_hopper, "RUN", lambda *a, **kw: pytest.fail("a Gluon launch was listed"))
    handed = []
    q, k, v = _inputs()
    with tuning.compile_only(lambda kernel, grid, args, kwargs: handed.append(kernel.__name__)):
        assert flash_hopper.ensure_checked(q.device, q.dtype, 64, flash._portable_check) is None
        flash._attn_forward(q, k, v, 0.125, flash.Variant(causal=False))
    assert handed == ["_attn_fwd"] and not in_background.batches


def test_commands_wait_for_first_use_checks(monkeypatch):
    """flashrun's commands judge and time the fast path: on a GPU, device.select makes the checks
    wait (a user's own FLASHRUN_FIRST_USE stays)."""
    import os

    from flashrun import device

    monkeypatch.setenv("FLASHRUN_FIRST_USE", "")  # so that the undo restores the variable as it was
    monkeypatch.delenv("FLASHRUN_FIRST_USE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "use_compiler", lambda: None)
    device.select("auto")
    assert os.environ["FLASHRUN_FIRST_USE"] == "wait"
    monkeypatch.setenv("FLASHRUN_FIRST_USE", "background")
    device.select("auto")
    assert os.environ["FLASHRUN_FIRST_USE"] == "background"


def test_a_background_listing_that_raises_checks_at_once(monkeypatch, in_background):
    """Should handing the launches over fail, the first use checks as it did before (waiting), and
    the check's own handling of a kernel's error applies."""
    _pretend_hopper(monkeypatch)
    used = []
    monkeypatch.setattr(flash_hopper, "RUN", _portable_as_gluon(used))

    def refuse(self, launches):
        raise RuntimeError("no compile pool")

    monkeypatch.setattr(in_background.Batch, "collect", refuse)
    q, k, v = _inputs()
    assert flash.forward_path(q, k, v) == "gluon-sm90" and flash_hopper._checked == {(q.dtype, 64): None}


def test_the_fp8_kernels_compile_for_hopper(python):
    """The Gluon forward with FP8 (e4m3 in, bf16 out, Vᵀ tiles): the one-block kernels at head_dim 64
    and 128 and the e4m3-only one shipped at 128 compile for sm_90 without a spill, their wgmmas e4m3,
    P V's A from shared memory in the overlapped loops and from registers in the plain one (the
    script: --fp8 without --kernels adds 256, whose shipped 128-key kernel spills a little causal)."""
    result = python(str(Path(__file__).parent / "compile_hopper.py"), "--fp8", "--kernels",
                    "d64,d128,d128-m64,d128-n256-base")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    oks = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(oks) == 8 and all("float8_e4m3fn" in line for line in oks), oks
    assert all((" rs 0 " in line) != ("d128-n256-base" in line) for line in oks), oks
    for line in oks:
        if "ptxas:" in line and "(no bundled ptxas)" not in line:
            assert "spill stores/loads 0/0 B" in line, line


def test_fp8_launch_arguments():
    """run_fp8's launch: without the overlap (P in registers) K's descriptor reads k (heads padded to
    16 keys) as 16-key groups, and refuses a k not laid out so; V's reads the seq-contiguous v as Vᵀ
    tiles (head dim x keys); the descales ride per (batch, kv head) with their strides, and O by TMA
    and Q in registers stay off."""
    from flashrun.kernels.flash.fp8 import key_groups

    q = torch.empty(2, 8, 300, 128).to(torch.float8_e4m3fn)
    k = key_groups(torch.empty(2, 2, 300, 128).to(torch.float8_e4m3fn))
    assert k.stride() == (2 * 304 * 128, 304 * 128, 128, 1) and key_groups(k) is k
    v = torch.empty(2, 2, 128, 304).to(torch.float8_e4m3fn)[..., :300].transpose(2, 3)  # quantize_qkv's layout
    o = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = torch.empty(2, 8, 300)
    descales = tuple(torch.ones(2, 2) for _ in range(3))
    cfg = flash_hopper.KERNELS["d128-persistent"]  # q_regs off already; TMA_O would be on in bf16
    _, args, constexprs, _ = flash_hopper.launch_args(q, k, v, o, lse, 0.1, True, cfg, 132, descales=descales)
    k_desc, v_desc = args[2], args[4]
    assert list(k_desc.block_shape) == [1, 1, cfg.block_n, 128]  # the overlapped loop: P through shared memory
    assert list(v_desc.block_shape) == [1, 1, 128, cfg.block_n] and v_desc.base.stride(-1) == 1
    assert list(v_desc.base.shape) == [2, 2, 128, 300]
    assert args[-5:] == (*descales, 2, 1) and constexprs["FP8"] is True
    assert constexprs["TMA_O"] is False and constexprs["Q_REGS"] is False
    _, args, constexprs, _ = flash_hopper.launch_args(q, k, v, o, lse, 0.1, True, cfg, 132,
                                                      descales=tuple(torch.tensor(1.0) for _ in range(3)))
    assert args[-2:] == (0, 0)  # one descale for the whole tensor
    bf16 = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16)
    _, args, constexprs, _ = flash_hopper.launch_args(bf16, bf16[:, :2], bf16[:, :2], bf16, lse, 0.1, True, cfg, 132)
    assert args[-5:] == (None, None, None, 0, 0) and constexprs["FP8"] is False
    plain = flash_hopper.FP8_KERNELS["d128-n256-base"]
    _, args, _, _ = flash_hopper.launch_args(q, k, v, o, lse, 0.1, True, plain, 132, descales=descales)
    k_desc = args[2]
    assert list(k_desc.shape) == [2 * 2 * 304 // 16, 2, 4, 2, 128] and list(k_desc.strides) == [2048, 256, 512, 128, 1]
    assert list(k_desc.block_shape) == [plain.block_n // 16, 2, 4, 2, 128]
    with pytest.raises(ValueError, match="16-key groups"):
        flash_hopper.launch_args(q, torch.empty(2, 2, 300, 128).to(torch.float8_e4m3fn), v, o, lse, 0.1, True, plain,
                                 132, descales=descales)


def test_the_fp8_key_groups_put_every_key_where_p_v_reads_it():
    """The register P of the e4m3 loop without the overlap, on the host: K's descriptor
    (hopper._key_group_descriptor) lands key tau(r) in shared row r; S's column c then holds that
    key, which hopper_jit._key_columns says (restated here); _p_operand's relabeling (reshape to
    (M, N/16, 2, 4, 2), permute (0, 1, 3, 2, 4)) makes A's index k the column c(k). P V is right
    only if A's k-th element is key k, for every block of keys, ragged N included."""
    from flashrun.kernels.flash.fp8 import key_groups

    n, d, block_n = 300, 128, 256
    k = key_groups(torch.zeros(2, 2, n, d).to(torch.float8_e4m3fn))
    desc = flash_hopper._key_group_descriptor(k, block_n)
    ids = torch.arange(k.untyped_storage().nbytes() // d)  # each stored key row's index
    rows = torch.as_strided(ids.repeat_interleave(d), desc.shape, desc.strides)[..., 0]
    per_head = k.stride(1) // d
    for head, block in ((0, 0), (0, 1), (1, 0)):  # (batch 0) a head's blocks; past its keys lie the next head's
        group = head * (per_head // 16) + block * block_n // 16
        tau = rows[group:group + block_n // 16].reshape(block_n) - (head * per_head + block * block_n)
        c = torch.arange(block_n)
        assert torch.equal(tau, (c // 16) * 16 + ((c // 2) % 4) * 4 + ((c // 8) % 2) * 2 + c % 2)  # _key_columns
        c_of_k = c.reshape(block_n // 16, 2, 4, 2).permute(0, 2, 1, 3).reshape(block_n)  # _p_operand
        assert torch.equal(tau[c_of_k], c)


def test_the_fp8_decode_kernel_compiles_for_hopper(python):
    """hopper_decode_jit's kernel compiles for sm_90 as the KV-cache API's plan launches it
    (contiguous and paged caches, one scale and token scales, an append): its operand conversions
    are asserted trivial in the kernel, so K and V reach the MMAs from the registers they were
    loaded into; per launch 64 mma.sync and 128 e4m3 widenings (one 64-key block, unmasked and
    masked), K by 16-byte loads (skips where this Triton cannot compile Gluon for sm_90)."""
    result = python(str(Path(__file__).parent / "compile_decode.py"))
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    oks = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(oks) == 5 and all("_attn_decode_fp8" in line for line in oks), oks
    for line in oks:
        assert " mma 64 " in line and " widen 128 " in line and " ld16 0 " not in line, line
