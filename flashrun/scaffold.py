"""``flashrun init``: scaffold an experiment folder like the article's."""

from __future__ import annotations

from pathlib import Path

from flashrun.errors import InputError
from flashrun.records.files import atomic_write_text

DATA = Path(__file__).parent / "data"

# target (relative to the folder) -> template file in flashrun/data
FILES = {
    "config.toml": "init_config.toml",
    "settings.json": "init_settings.json",
    "experiments/my_attention.py": "attention_template.py",
    "logs/.gitignore": None,  # run records stay out of git
}


def scaffold(directory: Path, force: bool = False) -> list[Path]:
    """Write the files; refuse (writing nothing) if any exists and ``force`` is off."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{directory} exists and is not a folder")
    targets = {directory / name: template for name, template in FILES.items()}
    blocking = sorted({str(up) for path in targets for up in path.parents if up.exists() and not up.is_dir()})
    if blocking:
        raise InputError(f"{', '.join(blocking)} is a file where a folder is needed", hint="nothing was written")
    existing = [str(path) for path in targets if path.exists()]
    if existing and not force:
        raise InputError(
            f"would overwrite {', '.join(existing)}",
            hint="nothing was written; pass --force to overwrite, or pick another folder",
        )
    texts = {
        path: "*\n!.gitignore\n" if template is None else (DATA / template).read_text(encoding="utf-8")
        for path, template in targets.items()
    }
    for path, text in texts.items():
        try:
            atomic_write_text(path, text)
        except OSError as exc:  # a read-only folder, a full disk, ...
            raise InputError(f"cannot write {path}: {exc.strerror or exc}", hint="pick a folder you can write") from None
    return list(targets)
