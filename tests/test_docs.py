"""The README and the docs stay true: their commands run, their links resolve, their numbers come
from committed results, their generated parts match the code, and the site builds strictly."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flashrun import __version__
from flashrun.cli import app
from flashrun.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
GENERATED = {ROOT / "docs" / "cli.md"}  # its examples are the --help text's, run or not by their own tests
# ```bash blocks; a `<!-- flags-only: REASON -->` line right before one: its commands are only checked
# against the CLI (they need a GPU, a gateway, a cluster, or a fresh machine to install on)
BASH = re.compile(r"(?:<!-- flags-only: (?P<reason>[\w -]+) -->\n)?```bash\n(?P<body>.*?)```", re.S)
# a measured figure: digits with a unit of speed, time or throughput, or a ratio like 0.97x
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:TFLOP/s|TFLOPS|PFLOP/s|GB/s|TB/s|ms|µs|us|tok/s)\b|\b\d+\.\d+\s?[x×]\b"
                    r"|\b\d+(?:\.\d+)?\s?% of (?:cuDNN|peak|the roof)")
CLAIM = re.compile(r"<!-- claim:[\w.-]+ -->.*?<!-- /claim -->", re.S)


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _blocks() -> list[tuple[str, int, str | None, str]]:
    """(page, block number, flags-only reason, body) of every ```bash block of the README and docs."""
    found = []
    for page in PAGES:
        if page in GENERATED:
            continue
        for number, match in enumerate(BASH.finditer(_text(page))):
            found.append((str(page.relative_to(ROOT)), number, match.group("reason"), match.group("body")))
    return found


def _steps(body: str) -> list[list[str]]:
    """A block's shell lines as argv lists, continuation lines joined, comments and pipes dropped;
    ``&&`` and ``;`` split steps. A trailing ``# exit N`` is kept as the step's expected code."""
    steps = []
    for line in body.replace("\\\n", " ").splitlines():
        code, _, comment = line.partition(" #")
        expected = re.search(r"\bexit (\d+)\b", comment)
        for part in re.split(r"&&|;", code):
            words = [os.path.expanduser(w) for w in shlex.split(part.split(" | ")[0], comments=True)]
            if words:
                steps.append(words + ([f"#exit={expected.group(1)}"] if expected else []))
    return steps


def test_readme_is_a_front_door() -> None:
    text = _text(README)
    assert len(text.splitlines()) <= 300
    assert "<!-- claim:" in "\n".join(text.splitlines()[:120]), "the performance table comes early"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_round_history_outside_the_changelog(page: Path) -> None:
    text = CLAIM.sub("", _text(page))
    text = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # code (a tensor named v8) is not history
    # vNN as the notebook numbered its rounds; not a /v1 API path
    assert not re.findall(r"\b[Rr]ound \d+|(?<![/\w.-])v\d{1,2}\b(?![./])|\bNOTES\.md\b|gpu_round", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_comes_from_a_claim_block(page: Path) -> None:
    """Outside the blocks the renderer writes, no measured number: prose may read a table, not
    restate it."""
    outside = CLAIM.sub("", _text(page))
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # commands and their output
    assert not FIGURE.findall(outside)


def test_claim_blocks_and_plots_match_the_committed_results() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_generated_reference_pages_match_the_code() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "reference.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_every_config_key_has_a_meaning() -> None:
    """The configuration reference is generated from these descriptions."""
    missing = [f"{section}.{key}" for section, model in SECTIONS.items()
               for key, info in model.model_fields.items() if not info.description]
    assert not missing


def test_the_changelog_has_this_version() -> None:
    assert f"## [{__version__}]" in _text(ROOT / "CHANGELOG.md")


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs (and, near enough, GitHub) gives a page's headings."""
    slugs = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", _text(page), flags=re.S), flags=re.M):
        text = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", r"\1", heading).strip().lower()  # _ stays, as in mkdocs
        slugs.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text)))
    return slugs


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue  # offline: the web is not checked
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken


def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_hand_written_docs_stay_readable_in_an_afternoon() -> None:
    lines = sum(len(_text(page).splitlines()) for page in PAGES[1:] if page not in GENERATED)
    lines -= sum(len(match.group(0).splitlines()) for page in PAGES[1:] for match in CLAIM.finditer(_text(page)))
    lines -= len(re.search(r"<!-- generated: config-reference -->.*?<!-- /generated -->",
                           _text(ROOT / "docs" / "configuration.md"), re.S).group(0).splitlines())
    assert lines <= 2500


def test_benchmarks_are_suites_not_scripts() -> None:
    outside = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and "results" not in p.parts]
    assert len(outside) <= 25, sorted(map(str, outside))
    assert not list((ROOT / "benchmarks").glob("gpu_round*"))
    size = sum(p.stat().st_size for p in (ROOT / "benchmarks" / "results").iterdir())
    assert size <= 3 << 20


# -- every command in the README and the docs ------------------------------------------------------------
def _validate(words: list[str]) -> None:
    """The command and its options exist (a flags-only block's check)."""
    command = typer.main.get_command(app)
    rest = words[1:]
    while rest and hasattr(command, "commands") and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
    unknown = [w for w in rest if w.startswith("-") and w.split("=")[0] not in options]
    assert not unknown, f"{' '.join(words)}: unknown options {unknown}"


BLOCKS = _blocks()


@pytest.mark.slow
@pytest.mark.parametrize(("page", "number", "reason", "body"), BLOCKS,
                         ids=[f"{page}#{number}" for page, number, _, _ in BLOCKS])
def test_documented_commands_run(page: str, number: int, reason: str | None, body: str, isolated: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block runs in order in a fresh experiment folder (``flashrun init``; HOME is a scratch
    folder), on this CPU, through the interpreter. flags-only blocks are checked against the CLI."""
    home = isolated / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("COLUMNS", "100")
    runner = CliRunner()
    if reason is None:
        assert runner.invoke(app, ["init", str(isolated / "exp")]).exit_code == 0
        monkeypatch.chdir(isolated / "exp")
    for words in _steps(body):
        expected = int(words.pop()[len("#exit="):]) if words[-1].startswith("#exit=") else 0
        if words[0] == "cd" and reason is None:
            monkeypatch.chdir(Path(words[1]).expanduser())
            continue
        if not words[0].endswith("flashrun"):
            continue  # pip, python, source, export: set-up the test's own environment already has
        _validate(words)
        if reason is not None:
            continue
        result = runner.invoke(app, words[1:], prog_name="flashrun")
        assert result.exit_code == expected, f"{' '.join(words)} -> {result.exit_code}\n{result.output}"


@pytest.mark.parametrize("suite", sorted((ROOT / "benchmarks" / "suites").glob("*.toml")), ids=lambda p: p.name)
def test_every_suite_loads_and_its_committed_runs_compare(suite: Path) -> None:
    """A suite is a config as a user passes it; the runs it compares with are flashrun results."""
    from flashrun.config import load_config
    from flashrun.harness import results

    cfg = load_config(suite, None, None, None)
    for path in cfg.bench.compare or ():
        assert results.load_rows(path), path
    assert f"--config benchmarks/suites/{suite.name}" in _text(suite)  # it says how it is run
