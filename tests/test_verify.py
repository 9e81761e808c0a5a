"""flashrun verify end to end (CPU interpreter): verdicts, reasons, exit codes, records, rerun."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashrun.cli import app

ROOT = Path(__file__).resolve().parent.parent
BAD = Path(__file__).parent / "kernels" / "bad_kernels.py"
ARTICLE = Path(__file__).parent / "kernels" / "article_kernel.py"
runner = CliRunner()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with a small config; logs go to its logs/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.toml").write_text(
        '[experiment]\nbatch_size = 1\nnum_heads = 2\nseq_len = 37\nhead_dim = 32\ncausal = true\n'
        'dtype = "float32"\n\n[logging]\nlog_dir = "logs"\n'
    )
    return tmp_path


def verify(*args):
    result = runner.invoke(app, ["verify", *args])
    # A traceback only where it is asked for: -v prints a failing kernel's; --json carries it as data.
    assert "-v" in args or "Traceback" not in result.stderr, result.output
    assert "-v" in args or "--json" in args or "Traceback" not in result.stdout, result.output
    return result


def verify_json(*args):
    result = verify(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def test_default_config_passes(workdir):
    code, data = verify_json("--grad")
    assert code == 0, data
    assert data["verdict"] == "1 passed, 0 failed"
    checks = data["results"][0]["checks"]
    assert [c["name"] for c in checks] == ["out", "dq", "dk", "dv"]
    assert all(c["passed"] and c["unwritten"] == 0 and c["nonfinite"] == 0 for c in checks)


@pytest.mark.parametrize(
    "kernel,reason",
    [
        ("no_scale", "max error"),
        ("wrong_mask", "max error"),
        ("unwritten_row", "never written"),
        ("returns_nan", "NaN/Inf"),
        ("raises", "RuntimeError: boom"),
    ],
)
def test_wrong_kernels_fail_for_the_right_reason(workdir, kernel, reason):
    code, data = verify_json("--kernel", f"{BAD}:{kernel}")
    assert code == 1
    (result,) = data["results"]
    assert result["status"] in ("fail", "error")
    assert reason in result["message"]


def _line_of(text):
    return next(i for i, line in enumerate(BAD.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    "kernel,where,error",
    [
        ("raises", f"{BAD}:{_line_of('raise RuntimeError')} in raises", "RuntimeError: boom"),
        # inside a @triton.jit function: the interpreter's own error wraps it; the line is the user's
        ("jit_error", f"{BAD}:{_line_of('q * not_defined')} in _fails_inside", "name 'not_defined' is not defined"),
    ],
)
def test_a_kernel_that_raises_says_where(workdir, kernel, where, error):
    code, data = verify_json("--kernel", f"{BAD}:{kernel}", "--kernel", "flash")
    assert code == 1
    failed, passed = data["results"]
    assert failed["status"] == "error" and error in failed["message"]
    assert failed["message"].endswith(f" (at {where})")  # one line: the user's innermost frame
    assert "\n" not in failed["message"]
    assert failed["traceback"].startswith("Traceback (most recent call last):")
    assert f'{BAD}", line {where.split(":")[1].split()[0]}' in failed["traceback"]
    assert "traceback" not in passed  # only when there is one
    record = json.loads((workdir / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["results"]["checks"][0]["traceback"] == failed["traceback"]

    table = verify("--kernel", f"{BAD}:{kernel}")
    assert table.exit_code == 1 and f"(at {where})" in table.stdout and "Traceback" not in table.output
    verbose = verify("--kernel", f"{BAD}:{kernel}", "-v")
    assert verbose.exit_code == 1
    assert "Traceback (most recent call last):" in verbose.stdout and f"(at {where})" in verbose.stdout


def test_where_is_relative_to_the_working_folder_when_inside_it(workdir):
    (workdir / "experiments").mkdir()
    (workdir / "experiments" / "mine.py").write_text(BAD.read_text())
    _, data = verify_json("--kernel", "experiments/mine.py:raises")
    assert data["results"][0]["message"].endswith(f"(at experiments/mine.py:{_line_of('raise RuntimeError')} in raises)")


def test_unwritten_row_is_counted(workdir):
    _, data = verify_json("--kernel", f"{BAD}:unwritten_row")
    (check,) = data["results"][0]["checks"]
    assert check["unwritten"] == 2 * 32  # one row of 32 in each of 2 heads
    assert check["nonfinite"] == 0


def test_articles_kernel_is_caught_and_flash_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    article = ROOT / "configs" / "article.toml"
    code, data = verify_json("--config", str(article), "--kernel", f"{ARTICLE}:flash_attention_forward",
                             "--kernel", "flash", "--set", f"logging.log_dir={tmp_path / 'logs'}")
    assert code == 1
    by_kernel = {r["kernel"]: r for r in data["results"]}
    assert by_kernel["flash"]["status"] == "pass"
    caught = by_kernel["article_kernel.py:flash_attention_forward"]
    assert caught["status"] == "fail" and "max error" in caught["message"]
    assert any("called as (q, k, v)" in note for note in caught["notes"])


def test_correct_user_kernel_passes_with_grad(workdir):
    code, data = verify_json("--kernel", f"{BAD}:correct", "--grad")
    assert code == 0, data["results"][0]["message"]
    assert len(data["results"][0]["checks"]) == 4


def test_deterministic_reaches_the_backward_verify_checks(workdir, monkeypatch):
    # experiment.deterministic: true picks flash's atomic-free backward, false the atomic one, unset
    # (None) the faster per call; flash-deterministic and flash-atomic fix the choice
    from flashrun.kernels.flash import attention as flash

    seen = []
    real = flash._attn_backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic", args[9] if len(args) > 9 else True))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash, "_attn_backward", spy)
    for args, expected in ((["--set", "experiment.deterministic=false"], [False]), ([], [None]),
                           (["--set", "experiment.deterministic=true"], [True]),
                           (["--kernel", "flash-deterministic"], [True]), (["--kernel", "flash-atomic"], [False])):
        seen.clear()
        code, data = verify_json("--grad", "--set", "verify.seq_len=[17]", *args)
        assert code == 0, data
        assert seen == expected, args


def test_sweep_expands_cartesian_product(workdir):
    code, data = verify_json("--set", "verify.seq_len=[1,17]", "--set", "verify.causal=[false,true]",
                             "--set", "verify.num_kv_heads=[1,2]")
    assert code == 0
    labels = [r["label"] for r in data["results"]]
    assert len(labels) == 8 and len(set(labels)) == 8


def test_minimal_refusal_is_a_skip_not_a_failure(workdir):
    code, data = verify_json("--kernel", "minimal", "--set", "verify.seq_len=[17,65]")
    statuses = [r["status"] for r in data["results"]]
    assert statuses == ["pass", "unsupported"] and code == 0
    assert "flash" in data["results"][1]["message"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kernel", "nope"], "unknown kernel"),
        (["--kernel", "missing.py:attention"], "not found"),
        (["--rerun", "20990101-000000-beef"], "no run"),
        (["--set", "experiment.head_dim=300"], "experiment.head_dim"),
        (["--device", "tpu"], "experiment.device"),
    ],
)
def test_input_errors_exit_2(workdir, args, message):
    result = verify(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_cuda_request_falls_back_to_the_interpreter_with_a_notice(workdir):
    result = verify("--device", "cuda")
    assert result.exit_code == 0
    assert "running through Triton's interpreter on the CPU" in result.output


def test_diagnose_reports_logit_range(workdir):
    _, data = verify_json("--diagnose")
    (result,) = data["results"]
    low, high = result["logit_range"]
    assert low < 0 < high
    # in range is an answer too: the range is shown, without the saturation warning
    assert result["notes"] == [f"logits q·kᵀ·scale span [{low:.2f}, {high:.2f}], within ±10"]
    table = verify("--diagnose")
    assert table.exit_code == 0
    assert f"flash B1 H2 N37 D32 fp32 causal: logits q·kᵀ·scale span [{low:.2f}, {high:.2f}], within ±10" in table.stdout
    assert "saturates" not in table.output


def test_diagnose_warns_outside_ten(workdir, monkeypatch):
    import flashrun.harness.reference

    monkeypatch.setattr(flashrun.harness.reference, "logit_range", lambda q, k, sm_scale=None: (-12.5, 3.0))
    _, data = verify_json("--diagnose")
    assert data["results"][0]["logit_range"] == [-12.5, 3.0]
    assert data["results"][0]["notes"] == ["logits q·kᵀ·scale span [-12.50, 3.00], outside about ±10: softmax saturates"]


def test_run_record_and_rerun(workdir, monkeypatch):
    monkeypatch.setenv("FLASHRUN_HOPPER", "0")  # a kernel switch (no Gluon on a CPU anyway): the record names it
    code, first = verify_json("--set", "verify.seq_len=[1,17]", "--seed", "5")
    assert code == 0
    records = [json.loads(line) for line in (workdir / "logs" / "runs.jsonl").read_text().splitlines()]
    record = records[-1]
    assert record["id"] == first["run_id"] and record["command"] == "verify"
    assert record["kernels"] == ["flash"] and record["n_cases"] == 2
    assert {"config", "env", "plan", "results", "time", "argv"} <= set(record)
    assert record["env"]["triton_interpret"] is True
    assert record["env"]["switches"] == {"FLASHRUN_HOPPER": "0"}
    # change the config: the rerun must still repeat the recorded run
    (workdir / "config.toml").write_text('[experiment]\nseq_len = 999\n[logging]\nlog_dir = "logs"\n')
    code, again = verify_json("--rerun", first["run_id"][:15])
    assert code == 0
    assert [r["label"] for r in again["results"]] == [r["label"] for r in first["results"]]
    assert [r["checks"][0]["max_abs"] for r in again["results"]] == [r["checks"][0]["max_abs"] for r in first["results"]]
    listing = runner.invoke(app, ["runs", "--json"])
    assert listing.exit_code == 0
    assert [r["id"] for r in json.loads(listing.stdout)][-2:] == [first["run_id"], again["run_id"]]


@pytest.mark.parametrize(
    "args,named",
    [
        (["--grad"], "--grad"),
        (["--diagnose"], "--diagnose"),
        (["-k", "minimal"], "--kernel"),
        (["--cases", "cases.json"], "--cases"),
        (["--device", "cpu"], "--device"),
        (["--seed", "3"], "--seed"),
        (["--set", "experiment.dtype=bfloat16"], "--set experiment.dtype=bfloat16"),
    ],
)
def test_rerun_refuses_options_that_would_change_the_plan(workdir, args, named):
    result = verify("--rerun", "20990101-000000-beef", *args)  # refused before the record is even looked up
    assert result.exit_code == 2, result.output
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: --rerun 20990101-000000-beef repeats that run exactly as recorded")
    assert named in first and "--rerun" in result.stderr.splitlines()[1]  # the hint
    assert not (workdir / "logs").exists()  # nothing ran, nothing recorded


def test_rerun_names_every_conflicting_option_and_keeps_logging_overrides(workdir):
    code, first = verify_json("--set", "experiment.seq_len=1")
    assert code == 0
    records = (workdir / "logs" / "runs.jsonl").read_text()
    result = verify("--rerun", first["run_id"], "--grad", "-k", "minimal", "--set", "verify.seq_len=[1,2]",
                    "--set", "logging.level=debug")
    assert result.exit_code == 2
    assert "--kernel, --grad, --set verify.seq_len=[1,2] would be ignored" in result.stderr
    assert (workdir / "logs" / "runs.jsonl").read_text() == records
    # --config and --set logging.* only say where the record is: accepted, and the note says so
    code, again = verify_json("--rerun", first["run_id"], "--config", "config.toml", "--set", "logging.log_dir=logs")
    assert code == 0 and [r["label"] for r in again["results"]] == [r["label"] for r in first["results"]]
    noted = verify("--rerun", first["run_id"], "--config", "config.toml")
    assert "--rerun repeats the recorded config; --config only located" in noted.stderr


def test_table_output(workdir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a pipe's width: numbers are still printed whole
    result = verify("--kernel", f"{BAD}:no_scale", "--kernel", "flash")
    assert result.exit_code == 1
    assert "1 passed, 1 failed" in result.output
    table = result.stdout.split("\n  ")[0]  # the notes under the table quote numbers of their own
    assert "…" not in table
    assert len(re.findall(r"\b\d\.\d\de[+-]\d\d\b", table)) == 4  # max err and rel L2 of both rows
    assert len(re.findall(r"\b\d+\.\d\dx\b", table)) == 2  # ×torch


def test_verify_as_a_subprocess(workdir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "flashrun", "verify"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1 passed, 0 failed" in proc.stdout


def test_cases_file_from_gen_cases_offline(workdir):
    made = runner.invoke(app, ["gen-cases", "--offline", "--max-seq-len", "40", "--count", "4", "--out", "cases.json"])
    assert made.exit_code == 0, made.output
    code, data = verify_json("--cases", "cases.json")
    assert code == 0
    cases = json.loads((workdir / "cases.json").read_text())["cases"]
    assert [(r["case"]["seq_len"], r["case"]["head_dim"]) for r in data["results"]] == \
        [(c["seq_len"], c["head_dim"]) for c in cases]
    # fields a case leaves out come from [experiment]
    assert {r["case"]["dtype"] for r in data["results"]} == {"float32"}


def test_short_dtype_names_and_comma_separated_kernels(workdir):
    (workdir / "cases.json").write_text('[{"seq_len": 16, "dtype": "fp16"}]')
    code, data = verify_json("-k", "flash,minimal", "--cases", "cases.json")
    assert code == 0, data
    assert [(r["kernel"], r["case"]["dtype"], r["label"]) for r in data["results"]] == [
        ("flash", "float16", "B1 H2 N16 D32 fp16 causal"), ("minimal", "float16", "B1 H2 N16 D32 fp16 causal")]
    code, data = verify_json("--set", "experiment.dtype=fp32", "--set", "experiment.seq_len=3")
    assert code == 0 and data["results"][0]["case"]["dtype"] == "float32"
    record = json.loads((workdir / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["config"]["experiment"]["dtype"] == "float32" and record["plan"]["cases"][0]["dtype"] == "float32"


def test_cases_file_errors(workdir):
    (workdir / "bad.json").write_text('{"cases": [{"seq_len": 0, "head_dim": 64}]}')
    result = verify("--cases", "bad.json")
    assert result.exit_code == 2 and "bad.json" in result.output
    result = verify("--cases", "missing.json")
    assert result.exit_code == 2
