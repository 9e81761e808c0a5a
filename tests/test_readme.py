"""The README is the contract: its test command is what CI runs, and its quickstart runs as printed
(every config key is documented by the generated reference: tests/test_docs.py)."""

import re
import shlex
from pathlib import Path

import typer

from flashrun.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _quickstart_commands():
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```bash\n")[1:]
    return [block.split("```", 1)[0].strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    main_job, tests, *_ = _quickstart_commands()
    assert "flashrun verify" in main_job
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_shipped_default_config_is_the_packaged_one():
    assert (ROOT / "configs" / "default.toml").read_text() == (ROOT / "flashrun" / "data" / "default.toml").read_text()


def _flashrun_calls(block: str) -> list[tuple[int, list[str]]]:
    """``(line number, argv)`` of every ``flashrun`` call in a shell block (comments dropped)."""
    calls = []
    for number, line in enumerate(block.splitlines()):
        for part in re.split(r"&&|;|\|", line.split(" #")[0]):
            words = shlex.split(part)
            if words and words[0].endswith("flashrun"):
                calls.append((number, words))
    return calls


def test_quickstart_flashrun_is_found_as_printed():
    # pip puts flashrun in .venv/bin, which is not on PATH: each block calls it by that path, or
    # activates the venv on an earlier line first
    for block in _quickstart_commands():
        lines = block.splitlines()
        for number, words in _flashrun_calls(block):
            activated = any(re.match(r"(source|\.) \.venv/bin/activate\b", line) for line in lines[:number])
            assert words[0] == ".venv/bin/flashrun" or (words[0] == "flashrun" and activated), lines[number]


def test_quickstart_commands_and_options_exist():
    commands = typer.main.get_command(app).commands
    for block in _quickstart_commands():
        for _, words in _flashrun_calls(block):
            command = commands[words[1]]
            options = {opt for param in command.params for opt in param.opts}
            unknown = [w for w in words[2:] if w.startswith("-") and w.split("=")[0] not in options]
            assert not unknown, f"{' '.join(words)}: {unknown}"
