"""CLI basics: cheap startup, init, runs, and keys that never leak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrun import __version__, scaffold
from flashrun.records.runlog import RUNS_FILE, append_record, load_records

FAKE_KEY = "sk-fake-NEVER-SHOW-5f2a9c41d7e3"

# Runs the CLI in a fresh interpreter, then reports which heavy modules it imported.
IMPORTS_PROBE = """
import sys
from flashrun.cli import app
try:
    app(args=sys.argv[1:], prog_name="flashrun")
except SystemExit as exc:
    code = exc.code
print("HEAVY", sorted(m for m in ("torch", "triton") if m in sys.modules), "EXIT", code)
"""


@pytest.mark.parametrize(
    ("args", "exit_code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["check-env", "--help"], 0),
        (["check-env", "--config", "bad.toml"], 2),
        (["check-env", "--set", "experiment.seq_len=x"], 2),
        (["runs", "--config", "missing.toml"], 2),
    ],
)
def test_help_version_and_config_errors_import_neither_torch_nor_triton(
    python, tmp_path: Path, args: list[str], exit_code: int
) -> None:
    (tmp_path / "bad.toml").write_text("[experiment]\nseqlen = 1\n")
    proc = python("-c", IMPORTS_PROBE, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"HEAVY [] EXIT {exit_code}"


def test_version(cli) -> None:
    result = cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"flashrun {__version__}"


def test_version_in_a_real_process(flashrun) -> None:
    proc = flashrun("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"flashrun {__version__}")


def test_no_arguments_shows_help(cli) -> None:
    result = cli()
    assert "check-env" in result.output and "Usage" in result.output


COMMANDS = [["verify"], ["check-env"], ["gen-cases"], ["bench"], ["model"], ["init"], ["runs"], ["runs", "show"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_reads_whole_at_80_columns(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every help line fits 80 columns, and each worked example stays one line (none wraps)."""
    import typer
    from typer.testing import CliRunner

    from flashrun.cli import app

    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(app, [*command, "--help"], prog_name="flashrun")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]
    examples = [line.strip() for line in (click_command.help or "").splitlines() if line.strip().startswith("flashrun ")]
    shown = {line.strip() for line in lines}
    assert not [example for example in examples if example not in shown]
    assert "flashrun[model]" in result.output or command != ["model"]  # not swallowed as rich markup


def test_unknown_option_is_a_usage_error(cli) -> None:
    result = cli("check-env", "--bogus")
    assert result.exit_code == 2
    assert "Traceback" not in result.output


# -- init -----------------------------------------------------------------------------------------


@pytest.fixture
def templates() -> Path:
    """The shipped templates init copies (tests compare what it writes with them)."""
    return scaffold.DATA


def test_init_scaffolds_an_experiment_folder(cli, templates: Path, tmp_path: Path) -> None:
    result = cli("init", "exp")
    assert result.exit_code == 0, result.output
    for target, template in scaffold.FILES.items():
        path = tmp_path / "exp" / target
        assert path.is_file(), target
        if template is not None:
            assert path.read_text() == (templates / template).read_text()
        assert f"wrote {Path('exp') / target}" in result.stdout
    assert (tmp_path / "exp" / "logs" / ".gitignore").read_text() == "*\n!.gitignore\n"
    # What init writes is a valid config.
    check = cli("runs", "--config", "exp/config.toml")
    assert check.exit_code == 0, check.output


def test_init_refuses_to_overwrite_and_writes_nothing(cli, templates: Path, tmp_path: Path) -> None:
    assert cli("init", "exp").exit_code == 0
    config = tmp_path / "exp" / "config.toml"
    config.write_text("# mine\n")
    (tmp_path / "exp" / "settings.json").unlink()
    result = cli("init", "exp")
    assert result.exit_code == 2
    assert "error: would overwrite" in result.stderr and str(config.relative_to(tmp_path)) in result.stderr
    assert "--force" in result.stderr and "Traceback" not in result.output
    assert config.read_text() == "# mine\n"
    assert not (tmp_path / "exp" / "settings.json").exists()  # nothing at all was written


def test_init_force_overwrites(cli, templates: Path, tmp_path: Path) -> None:
    assert cli("init", "exp").exit_code == 0
    config = tmp_path / "exp" / "config.toml"
    config.write_text("# mine\n")
    result = cli("init", "exp", "--force")
    assert result.exit_code == 0, result.output
    assert config.read_text() == (templates / "init_config.toml").read_text()


def test_init_into_a_file_is_refused(cli, templates: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    result = cli("init", "afile")
    assert result.exit_code == 2 and "is not a folder" in result.stderr


def test_init_with_a_file_where_a_folder_goes_writes_nothing(cli, templates: Path, tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "experiments").write_text("not a folder")
    result = cli("init", "exp")
    assert result.exit_code == 2
    assert "is a file where a folder is needed" in result.stderr
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["experiments"]


# -- runs -----------------------------------------------------------------------------------------


def test_runs_when_nothing_was_recorded(cli, tmp_path: Path) -> None:
    result = cli("runs")
    assert result.exit_code == 0
    assert f"no runs recorded in {tmp_path / 'logs'}" in result.stdout
    assert json.loads(cli("runs", "--json").stdout) == []


def _record(log_dir: Path, run_id: str, outcome: str) -> None:
    append_record(log_dir, {"id": run_id, "time": "t", "command": "check-env", "results": {"outcome": outcome}})


def test_runs_lists_and_shows_records(cli, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    _record(logs, "20250101-000000-aaaa", "ok")
    _record(logs, "20250102-000000-bbbb", "failed: api_key")
    with (logs / RUNS_FILE).open("a") as handle:
        handle.write('{"id": "torn')  # a crash mid-write must not hide the earlier records
    listed = json.loads(cli("runs", "--json").stdout)
    assert [(r["id"], r["outcome"]) for r in listed] == [
        ("20250101-000000-aaaa", "ok"), ("20250102-000000-bbbb", "failed: api_key"),
    ]
    assert [r["id"] for r in json.loads(cli("runs", "--json", "-n", "1").stdout)] == ["20250102-000000-bbbb"]
    table = cli("runs")
    assert table.exit_code == 0 and "20250102-000000-bbbb" in table.stdout
    shown = cli("runs", "show", "20250101")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["id"] == "20250101-000000-aaaa"


def _long_records(log_dir: Path) -> list[str]:
    """Runs whose kernels and outcomes are long enough to crowd an 80-column table."""
    ids = [f"20261201-08152{i}-ab1{i}" for i in range(3)]
    for run_id in ids[:2]:
        append_record(log_dir, {"id": run_id, "time": "2026-12-01T08:15:20+01:00", "command": "verify",
                                "kernels": ["flash", "minimal", "/home/me/exp/experiments/my_attention.py:attention"],
                                "n_cases": 1234, "results": {"verdict": "1230 passed, 3 failed, 1 skipped"}})
    append_record(log_dir, {"id": ids[2], "time": "2026-12-01T08:15:22+01:00", "command": "bench",
                            "kernels": ["flash"], "n_cases": 48, "results": {"best_tflops": 612.345}})
    return ids


def _assert_whole(table: str, ids: list[str]) -> None:
    assert "…" not in table and "..." not in table
    for run_id in ids:
        assert run_id in table  # on one line, as `runs show` and `verify --rerun` take it
    for number in ("1234", "1230 passed", "48", "612.3"):
        assert number in table


def test_runs_table_keeps_ids_and_numbers_whole_when_piped_at_80_columns(flashrun, tmp_path: Path) -> None:
    ids = _long_records(tmp_path / "logs")
    proc = flashrun("runs", env={"COLUMNS": "80"})  # stdout is a pipe
    assert proc.returncode == 0, proc.stderr
    _assert_whole(proc.stdout, ids)
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    assert "my_attention.py" in proc.stdout and "/home/me" not in proc.stdout  # a user kernel by its file name


def test_runs_table_keeps_ids_whole_in_process(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _long_records(tmp_path / "logs")
    for columns in ("80", "40"):  # at 40 nothing fits: the table grows rather than cut an id
        monkeypatch.setenv("COLUMNS", columns)
        result = cli("runs")
        assert result.exit_code == 0, result.output
        _assert_whole(result.stdout, ids)
    monkeypatch.setenv("COLUMNS", "200")
    assert "2026-12-01T08:15:22+01:00" in cli("runs").stdout  # room enough: the time column is back


@pytest.mark.parametrize(("run_id", "message"), [("nope", "error: no run 'nope'"), ("2025", "is ambiguous (2 runs match)")])
def test_runs_show_bad_ids(cli, tmp_path: Path, run_id: str, message: str) -> None:
    _record(tmp_path / "logs", "20250101-000000-aaaa", "ok")
    _record(tmp_path / "logs", "20250102-000000-bbbb", "ok")
    result = cli("runs", "show", run_id)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_unwritable_log_dir_is_a_clear_error(tmp_path: Path) -> None:
    from flashrun.errors import InputError

    (tmp_path / "blocker").write_text("a file, not a folder")
    with pytest.raises(InputError, match="cannot record the run in .*blocker/logs/runs.jsonl"):
        _record(tmp_path / "blocker" / "logs", "x", "ok")


# -- secrets --------------------------------------------------------------------------------------


def _all_text_under(folder: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_a_key_in_the_environment_never_appears(cli, templates: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAOTOKEN_API_KEY", FAKE_KEY)
    assert cli("init", ".").exit_code == 0  # the article's layout: TAOTOKEN_API_KEY, settings.json with ${...}
    outputs = []
    for args in (["check-env", "--json"], ["check-env", "-v"], ["runs"], ["runs", "--json"]):
        result = cli(*args)
        assert result.exit_code in (0, 1), result.output
        outputs.append(result.output)
    records = load_records(tmp_path / "logs")
    assert len(records) == 2 and records[0]["command"] == "check-env"
    api_key = next(c for c in records[0]["results"]["checks"] if c["name"] == "api_key")
    assert api_key == {"name": "api_key", "status": "ok", "detail": "TAOTOKEN_API_KEY is set (value hidden)", "hint": None}
    outputs.append(cli("runs", "show", records[0]["id"]).output)
    for text in [*outputs, _all_text_under(tmp_path)]:
        assert FAKE_KEY not in text
        assert FAKE_KEY[3:12] not in text  # not even a fragment


def test_a_literal_key_in_settings_never_appears(cli, tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"api": {"api_key": FAKE_KEY}}))
    result = cli("check-env", "--settings", "settings.json", "--json")
    assert result.exit_code in (0, 1), result.output
    api_key = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "api_key")
    assert api_key["status"] == "warn" and "value hidden" in api_key["detail"]
    assert "literal key" in result.stderr  # the load-time warning
    for text in (result.output, _all_text_under(tmp_path / "logs")):
        assert FAKE_KEY not in text


def test_a_literal_key_on_the_command_line_never_reaches_a_file(flashrun, tmp_path: Path) -> None:
    # a real process: the record's argv is sys.argv, which CliRunner does not set
    proc = flashrun("gen-cases", "--offline", "--set", f"api.api_key={FAKE_KEY}")
    assert proc.returncode == 0, proc.stderr
    record = load_records(tmp_path / "logs")[0]
    assert record["command"] == "gen-cases" and record["argv"][-1] == "api.api_key=***"
    assert (tmp_path / "cases.json").is_file()
    for text in (proc.stdout, proc.stderr, _all_text_under(tmp_path)):
        assert FAKE_KEY not in text


def test_written_files_get_the_usual_mode(tmp_path):
    # atomic writes go through mkstemp (0600); the result must look like a normal file
    import os

    from flashrun.records.files import atomic_write_text

    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "new.txt", "x")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o644
        (tmp_path / "kept.txt").write_text("old")
        (tmp_path / "kept.txt").chmod(0o600)
        atomic_write_text(tmp_path / "kept.txt", "new")
        assert (tmp_path / "kept.txt").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(umask)


def test_the_file_writer_writes_what_it_is_given_and_records_mask_the_key(tmp_path: Path) -> None:
    from flashrun.records.files import atomic_write_json, atomic_write_text
    from flashrun.records.redact import register_secret
    from flashrun.records.runlog import make_record

    register_secret(FAKE_KEY)
    atomic_write_text(tmp_path / "plain.txt", f"key = {FAKE_KEY}\n")  # a file writer, not a filter
    assert (tmp_path / "plain.txt").read_text() == f"key = {FAKE_KEY}\n"
    atomic_write_json(tmp_path / "plain.json", {"key": FAKE_KEY})
    assert json.loads((tmp_path / "plain.json").read_text()) == {"key": FAKE_KEY}

    argv = ["verify", "--set", f"api.api_key={FAKE_KEY}"]
    append_record(tmp_path / "logs", make_record("verify", argv, {}, {"error": f"server said {FAKE_KEY}"}))
    text = (tmp_path / "logs" / RUNS_FILE).read_text()
    assert FAKE_KEY not in text
    record = load_records(tmp_path / "logs")[0]
    assert record["argv"][-1] == "api.api_key=***" and record["results"] == {"error": "server said ***"}
