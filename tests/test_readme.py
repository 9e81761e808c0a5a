"""The README is the contract: its test command is what CI runs, and every config key is in it."""

from pathlib import Path

from flashrun.config import SECTIONS

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


def test_every_config_key_is_documented():
    missing = [f"{section}.{key}" for section, model in SECTIONS.items() for key in model.model_fields
               if f"`{section}.{key}`" not in README and f"`{key}`" not in README]
    assert not missing, f"README lacks: {missing}"


def test_shipped_default_config_is_the_packaged_one():
    assert (ROOT / "configs" / "default.toml").read_text() == (ROOT / "flashrun" / "data" / "default.toml").read_text()
