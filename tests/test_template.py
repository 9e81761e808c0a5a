"""The kernel `flashrun init` scaffolds (flashrun/data/attention_template.py): it passes verify on
the config it comes with, and on the variant cases its signature takes, through the interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TEMPLATE = "experiments/my_attention.py:attention"

# Awkward lengths and head dims, GQA, Nq != Nk both ways, every variant and their combinations,
# packed batches with empty and length-1 sequences (keys too); float32 checks the softcap's tanh
# closely, float16 the usual path.
VARIANT_CASES = [
    {"seq_len": 1, "head_dim": 40},
    {"seq_len": 97, "seq_len_k": 17, "head_dim": 80, "window": [3, 5]},
    {"seq_len": 17, "seq_len_k": 97, "head_dim": 16, "causal": True, "window": [8, 0], "dtype": "float32"},
    {"seq_len": 33, "head_dim": 16, "window": [0, 0]},
    {"seq_len": 33, "head_dim": 32, "window": [64, 100], "dtype": "float32"},
    {"seq_len": 65, "head_dim": 16, "window": [16, 0], "softcap": 2.0, "alibi": True, "dtype": "float32"},
    {"seq_len": 17, "head_dim": 40, "softcap": 0.5, "alibi": True, "causal": True},
    {"head_dim": 16, "seqlens": [0, 1, 17, 5]},
    {"head_dim": 32, "seqlens": [17, 0, 1, 33], "seqlens_k": [5, 9, 0, 40], "causal": True, "window": [4, 0],
     "alibi": True, "softcap": 1.0, "dtype": "float32"},
]


@pytest.fixture
def experiment(cli, isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder made by `flashrun init`, as the cwd (its config.toml is the one verify reads)."""
    assert cli("init", "exp").exit_code == 0
    monkeypatch.chdir(isolated / "exp")
    return isolated / "exp"


def test_the_template_passes_verify_on_its_own_config(cli, experiment: Path) -> None:
    result = cli("verify", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(r["kernel"], r["status"]) for r in data["results"]] == [("flash", "pass"),
                                                                    ("my_attention.py:attention", "pass")]
    assert data["results"][1]["label"] == "B2 H4 N128 D64 fp16 causal"


def test_the_template_runs_every_variant_it_takes(cli, experiment: Path) -> None:
    (experiment / "cases.json").write_text(json.dumps(VARIANT_CASES))
    result = cli("verify", "--cases", "cases.json", "-k", TEMPLATE, "--json",
                 "--set", "experiment.batch_size=1", "--set", "experiment.num_heads=4",
                 "--set", "experiment.num_kv_heads=2", "--set", "experiment.causal=false")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verdict"] == f"{len(VARIANT_CASES)} passed, 0 failed"
    assert [r["label"] for r in data["results"]] == [
        "B1 H4/2 N1 D40 fp16", "B1 H4/2 N97x17 D80 fp16 w3,5", "B1 H4/2 N17x97 D16 fp32 causal w8,0",
        "B1 H4/2 N33 D16 fp16 w0,0", "B1 H4/2 N33 D32 fp32 w64,100", "B1 H4/2 N65 D16 fp32 w16,0 cap2 alibi",
        "B1 H4/2 N17 D40 fp16 causal cap0.5 alibi", "B4 H4/2 N17 D16 fp16 varlen[0,1,17,5]",
        "B4 H4/2 N33x40 D32 fp32 causal w4,0 cap1 alibi varlen[17,0,1,33]x[5,9,0,40]"]

