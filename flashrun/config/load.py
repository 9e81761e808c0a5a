"""Loading: ``config.toml`` + optional ``settings.json`` + flags + ``--set`` -> one :class:`Config`.

Precedence, lowest first: built-in defaults < settings.json < config.toml < command-line
flags < ``--set section.key=value``. Both files are validated against the same schema
(unknown keys forbidden); every mistake becomes a :class:`ConfigError` that names the file
the bad value came from, the key path, what was expected and what was found.

This module must stay cheap to import: no torch, no triton.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from flashrun.config.schema import DEFAULT_CONFIG, SECTIONS, Config
from flashrun.errors import ConfigError, MissingKeyError
from flashrun.limits import DTYPE_ALIASES
from flashrun.records.redact import register_secret

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# --------------------------------------------------------------------------------------------
# Reading files


def _read_text(path: Path, label: str, what: str) -> str:
    try:
        if not path.exists():
            raise ConfigError(f"{label}: no such file", hint=f"check the path, or run `flashrun init` to create a {what}")
        if path.is_dir():
            raise ConfigError(f"{label}: is a folder, not a file", hint=f"point at the {what} inside it")
        data = path.read_bytes()
    except OSError as exc:  # unreadable, name too long, a file where a folder should be, ...
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}", hint=f"check the path to the {what}") from None
    if not data.strip():
        raise ConfigError(f"{label}: the file is empty", hint=f"a {what} needs at least one section; see README")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{label}: not a UTF-8 text file (binary?)", hint=f"is this really the {what}?") from None


def _read_toml(path: Path, label: str) -> dict[str, Any]:
    text = _read_text(path, label, "config file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML: {exc}", hint="fix the syntax at that line and column") from None


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _read_settings(path: Path, label: str) -> dict[str, Any]:
    text = _read_text(path, label, "settings.json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{label}: invalid JSON: {exc.msg} (at line {exc.lineno}, column {exc.colno})",
            hint="JSON needs double quotes and no trailing commas",
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{label}: expected a JSON object at the top level, got {type(data).__name__}",
            hint='settings.json maps sections to tables: {"api": {...}, "request": {...}, "logging": {...}}',
        )
    api = data.get("api")
    if isinstance(api, dict) and isinstance(api.get("api_key"), str):
        match = _VAR.fullmatch(api["api_key"].strip())
        if match:  # "${VAR}": a reference to a variable, read only when the key is needed
            api = dict(api)
            del api["api_key"]
            api["api_key_env"] = match.group(1)
            data = {**data, "api": api}
    return _expand(data)


def _expand(value: Any) -> Any:
    """Replace ``${VAR}`` in strings from the environment; an unset variable is left as written."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: os.environ.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [_expand(v) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------
# Merging with provenance


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["experiment.seq_len=1024", ...]`` -> ``{"experiment.seq_len": 1024}`` (values parsed as TOML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(
                f"--set {item!r}: expected section.key=value",
                hint="for example --set experiment.seq_len=1024 or --set experiment.dtype=bfloat16",
            )
        out[key] = _parse_value(raw.strip(), item)
    return out


def _parse_value(raw: str, item: str) -> Any:
    """A TOML value; ``[a, b]`` of bare words as a list of them; else a bare word as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as exc:
        inner = raw[1:-1]
        if raw.startswith("[") and raw.endswith("]") and not any(c in inner for c in "\"'[]{}"):
            return [_parse_value(part.strip(), item) for part in inner.split(",") if part.strip()]
        if raw[:1] in ('"', "'", "[", "{"):  # meant as TOML (a quoted string, a list, a table)
            reason = str(exc).split(" (at ")[0]  # positions would count the "v = " we added
            raise ConfigError(
                f"--set {item!r}: invalid TOML value: {reason}",
                hint='quote strings and close lists: --set experiment.kernel=\'["flash", "minimal"]\'',
            ) from None
        return raw  # a bare word: take it as a string


def _merge(
    target: dict[str, Any], origins: dict[tuple[str, ...], str], data: dict[str, Any], source: str
) -> None:
    for section, body in data.items():
        origins[(section,)] = source
        if isinstance(body, dict) and isinstance(target.get(section, {}), dict):
            dest = target.setdefault(section, {})
            for key, value in body.items():
                dest[key] = value
                origins[(section, key)] = source
        else:
            target[section] = body


def _dotted_to_nested(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return nested


def _found(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected(error: dict[str, Any], loc: tuple[Any, ...]) -> str:
    kind, ctx = error["type"], error.get("ctx", {})
    simple = {
        "int_type": "expected an integer", "int_parsing": "expected an integer",
        "int_from_float": "expected an integer", "float_type": "expected a number",
        "float_parsing": "expected a number", "bool_type": "expected true or false",
        "bool_parsing": "expected true or false", "string_type": "expected a string",
        "list_type": "expected a list", "model_type": "expected a table", "dict_type": "expected a table",
        "model_attributes_type": "expected a table", "missing": "a value is required",
        "path_type": "expected a path (a string)",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        expected = str(ctx.get("expected"))
        short = [alias for alias, name in DTYPE_ALIASES.items() if f"'{name}'" in expected]
        aliases = f" (or {', '.join(short)})" if "dtype" in loc[-2:] and short else ""  # dtype, or dtype.<index>
        return f"expected one of {expected}{aliases}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"expected a value {bounds[kind]} {limit}"
    if kind == "extra_forbidden":
        options = list(SECTIONS) if len(loc) == 1 else list(SECTIONS[loc[0]].model_fields) if loc[0] in SECTIONS else []
        close = difflib.get_close_matches(str(loc[-1]), options, n=1)
        what = "unknown section" if len(loc) == 1 else "unknown key"
        return f"{what}" + (f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(options)}")
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return error["msg"]


def _config_error(exc: ValidationError, origins: dict[tuple[str, ...], str]) -> ConfigError:
    error = exc.errors()[0]
    loc = tuple(part for part in error["loc"] if part not in ("function-after",))
    source = "defaults"
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in origins:
            source = origins[loc[:depth]]
            break
    key = ".".join(str(p) for p in loc) or "(top level)"
    message = f"{source}: {key}: {_expected(error, loc)}"
    if error["type"] not in ("extra_forbidden", "missing") and not isinstance(error.get("input"), dict):
        message += f", got {_found(error['input'])}"
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(message, hint="see the README's config reference for every key, its type and default")


# --------------------------------------------------------------------------------------------
# Public entry points


def find_config(path: Path | None) -> Path:
    """``--config`` if given, else ``./config.toml`` if present, else the shipped default."""
    if path is not None:
        return path
    local = Path("config.toml")
    return local if local.is_file() else DEFAULT_CONFIG


def load_config(
    config: Path | None = None,
    settings: Path | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> Config:
    """Load, merge and validate. ``flags`` maps ``"section.key"`` to values from CLI options."""
    config_path = find_config(config)
    shipped = config_path == DEFAULT_CONFIG
    config_label = "default config" if shipped else str(config)
    if config is None and not shipped:
        config_label = "config.toml"
    if settings is None and not shipped:
        candidate = config_path.parent / "settings.json"
        settings = candidate if candidate.is_file() else None

    merged: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    bases: dict[str, Path] = {}  # source label -> folder its relative paths resolve against
    if settings is not None:
        label = str(settings)
        _merge(merged, origins, _read_settings(settings, label), label)
        bases[label] = settings.resolve().parent
    _merge(merged, origins, _read_toml(config_path, config_label), config_label)
    if not shipped:
        bases[config_label] = config_path.resolve().parent
    if flags:
        _merge(merged, origins, _dotted_to_nested({k: v for k, v in flags.items() if v is not None}), "command line")
    if sets:
        _merge(merged, origins, _dotted_to_nested(parse_set(sets)), "--set")

    try:
        cfg = Config.model_validate(merged)
    except ValidationError as exc:
        raise _config_error(exc, origins) from None

    cfg = _resolve_paths(cfg, origins, bases)
    cfg._set_keys = frozenset(".".join(loc) for loc in origins if len(loc) == 2)
    cfg._files = [str(p) for p in (settings, config_path) if p is not None]
    key_source = origins.get(("api", "api_key"))
    if cfg.api.api_key is not None:
        register_secret(cfg.api.api_key)  # masked from now on: --set api.api_key=... sits in every record's argv
        cfg._key_source = key_source or "config"
        cfg._warnings.append(
            f"{key_source}: api.api_key holds a literal key; it is used but never shown. "
            f"Keep keys in an environment variable instead (api.api_key_env)"
        )
    return cfg


def _resolve_paths(cfg: Config, origins: dict[tuple[str, ...], str], bases: dict[str, Path]) -> Config:
    """Relative paths resolve against the folder of the file that set them (else the cwd)."""

    def base(section: str, key: str) -> Path:
        return bases.get(origins.get((section, key), ""), Path.cwd())

    log_dir = cfg.logging.log_dir
    if not log_dir.is_absolute():
        log_dir = base("logging", "log_dir") / log_dir
    kernels = [_resolve_kernel(spec, base("experiment", "kernel")) for spec in cfg.experiment.kernel]
    providers = [_resolve_kernel(spec, base("bench", "providers")) for spec in cfg.bench.providers]
    def bench_path(key: str, path: Path) -> Path:
        return path if path.is_absolute() else base("bench", key) / path

    bench_paths = {"out": cfg.bench.out and bench_path("out", cfg.bench.out),
                   "compare": cfg.bench.compare and [bench_path("compare", path) for path in cfg.bench.compare]}
    updated = cfg.model_copy(
        update={
            "logging": cfg.logging.model_copy(update={"log_dir": log_dir}),
            "experiment": cfg.experiment.model_copy(update={"kernel": kernels}),
            "bench": cfg.bench.model_copy(update={**bench_paths, "providers": providers}),
        }
    )
    updated._warnings = list(cfg._warnings)
    return updated


def _resolve_kernel(spec: str, base: Path) -> str:
    """``experiments/x.py:fn`` relative to the config's folder; names like ``flash`` unchanged."""
    path, sep, func = spec.rpartition(":")
    if sep and path.endswith(".py") and not Path(path).is_absolute():
        return f"{base / path}:{func}"
    return spec


def base_url_root(url: str) -> str:
    """``api.base_url`` as the client uses it (stripped, no trailing slash), or a ConfigError.

    The one test of whether a base URL can be a gateway root at all: no unset ``${VAR}`` left in
    it, an http(s) scheme and a host. What is merely suspect (an endpoint path, a query,
    credentials, plain http) ``check-env`` points out; the gateway diagnoses it from the reply.
    """
    unresolved = _VAR.search(url)
    if unresolved:
        raise ConfigError(
            f"api.base_url refers to ${{{unresolved.group(1)}}}, which is not set",
            hint=f"export {unresolved.group(1)}=... in this shell, or write the URL in the config",
        )
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"api.base_url {url!r} is not an http(s) URL with a host",
            hint='write the API root, for example base_url = "https://api.openai.com/v1"',
        )
    return url.strip().rstrip("/")


def key_variable(cfg: Config) -> str | None:
    """Name of the variable the key is read from (None when a literal key is configured)."""
    return None if cfg.api.api_key is not None else cfg.api.api_key_env


def resolve_api_key(cfg: Config) -> str:
    """The API key, from the environment (or a literal in a config file). Never print it."""
    if cfg.api.api_key is not None:
        unresolved = _VAR.search(cfg.api.api_key)
        if unresolved:
            raise MissingKeyError(
                f"api.api_key refers to ${{{unresolved.group(1)}}}, which is not set",
                hint=f"export {unresolved.group(1)}=... in this shell (IDEs may not inherit it)",
            )
        return cfg.api.api_key
    name = cfg.api.api_key_env
    value = os.environ.get(name, "")
    if not value.strip():
        raise MissingKeyError(
            f"the API key variable {name} is not set" + (" (it is empty)" if name in os.environ else ""),
            hint=f"export {name}=... in this shell (an IDE or service may not inherit your shell's variables)",
        )
    return value.strip()
