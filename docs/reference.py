"""Generate the docs' reference parts from the code, so they cannot drift from it:

* ``docs/cli.md``: every command of the Typer app, its help, options and examples;
* the key-by-key table in ``docs/configuration.md`` (between its ``generated`` markers), from the
  pydantic schema (each field's type, default and docstring).

    python docs/reference.py            # rewrite them
    python docs/reference.py --check    # exit 1 if either differs from what the code gives (CI)
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import typing
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashrun.cli import app  # noqa: E402
from flashrun.config.schema import SECTIONS  # noqa: E402

CLI_PAGE = ROOT / "docs" / "cli.md"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
CONFIG_BLOCK = re.compile(r"(<!-- generated: config-reference -->\n).*?(<!-- /generated -->)", re.S)


# -- the command line ------------------------------------------------------------------------------------
def _unescape(text: str) -> str:
    """Help text is rich markup (``\\[model]`` is a literal ``[model]``) and becomes Markdown, where
    ``<out>`` outside code would be taken for an HTML tag."""
    parts = text.replace("\\[", "[").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def _value_name(annotation: typing.Any) -> str:
    """What an option takes, from its annotation: ``Optional[list[str]]`` -> ``TEXT...``."""
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation
    args = [a for a in typing.get_args(base) if a is not type(None)]
    if typing.get_origin(base) is typing.Union and len(args) == 1:
        base = args[0]
    repeated = typing.get_origin(base) is list
    if repeated:
        (base,) = typing.get_args(base)
    name = {Path: "PATH", int: "INTEGER", float: "NUMBER", str: "TEXT", bool: ""}[base]
    return f"{name}..." if repeated else name


def _callbacks() -> dict[str, typing.Callable]:
    """Command name (``runs show`` for a sub-command) -> the function that implements it."""
    found = {}
    for info in app.registered_commands:
        found[info.name or info.callback.__name__] = info.callback
    for group in app.registered_groups:
        found[group.name] = group.typer_instance.registered_callback.callback
        for info in group.typer_instance.registered_commands:
            found[f"{group.name} {info.name or info.callback.__name__}"] = info.callback
    return found


def _split_help(text: str) -> tuple[list[str], list[str]]:
    """A command docstring -> (its paragraphs, each one line; its example lines)."""
    paragraphs, examples = [], []
    for block in inspect.cleandoc(text).split("\n\n"):
        lines = [line.strip() for line in block.splitlines()]
        if lines == ["Examples:"]:
            continue
        if lines[0].startswith("flashrun "):
            examples.extend(lines)
        else:
            paragraphs.append(_unescape(" ".join(lines)))
    return paragraphs, examples


def cli_page() -> str:
    root = typer.main.get_command(app)
    callbacks = _callbacks()
    out = ["# Command reference", "",
           "Generated from the command-line app by `python docs/reference.py`; the tests fail when it "
           "differs from the code. The same text is in `flashrun COMMAND --help`.", ""]
    commands = [(name, command) for name, command in root.commands.items()]
    commands += [(f"runs {name}", command) for name, command in root.commands["runs"].commands.items()]
    commands.sort(key=lambda item: list(root.commands).index(item[0].split()[0]))
    out += ["| command | what it does |", "|---|---|"]
    for name, command in commands:
        summary = _split_help(command.help or "")[0][0]
        out.append(f"| [`flashrun {name}`](#flashrun-{name.replace(' ', '-')}) | {summary} |")
    out.append("")
    out += ["Every command exits 0 when everything ran and passed, 1 when a check, verification or "
            "gateway request failed, 2 on a usage, config or input error (one line and a hint, no traceback; "
            "`-v` shows one), 130 when interrupted (what finished is kept).", ""]
    for name, command in commands:
        paragraphs, examples = _split_help(command.help or "")
        hints = typing.get_type_hints(callbacks[name], include_extras=True)
        arguments = [p for p in command.params if not p.opts[0].startswith("-")]
        usage = " ".join(["flashrun", name, "[OPTIONS]"] + [p.name.upper() for p in arguments])
        out += [f"## flashrun {name}", "", *[line for p in paragraphs for line in (p, "")]]
        out += ["```text", usage, "```", ""]
        out += ["| option | meaning |", "|---|---|"]
        for param in command.params:
            if param.opts[0].startswith("-"):
                names = ", ".join(f"`{opt}`" for opt in sorted(param.opts, key=len, reverse=True))
                value = _value_name(hints[param.name]) if param.name in hints else ""
            else:
                names, value = f"`{param.name.upper()}`", ""
            meaning = _unescape(param.help or "").replace("|", "\\|")
            out.append(f"| {names}{' ' + value if value else ''} | {meaning} |")
        out.append("| `--help` | Show the help and exit. |")
        out.append("")
        if examples:
            out += ["Examples:", "", "```text", *examples, "```", ""]
    return "\n".join(out)


# -- the configuration ------------------------------------------------------------------------------------
def _type_name(schema: dict[str, typing.Any]) -> str:
    """A JSON-schema node as a short human type: ``integer > 0``, ``list of string``, ``one of a, b``."""
    if "anyOf" in schema:
        parts = [s for s in schema["anyOf"] if s.get("type") != "null"]
        text = " or ".join(_type_name(s) for s in parts)
        return text + (" (or unset)" if len(parts) < len(schema["anyOf"]) else "")
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(value) if value == '' else value}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type_name(s) for s in schema["prefixItems"]) + "]"
        return "list of " + _type_name(schema.get("items", {}))
    bounds = [f"{op} {schema[key]}" for key, op in (("exclusiveMinimum", ">"), ("minimum", ">="),
                                                     ("exclusiveMaximum", "<"), ("maximum", "<="))
              if key in schema]
    name = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}.get(kind, kind)
    if schema.get("format") == "path":
        name = "path"
    return f"{name} {', '.join(bounds)}".strip() if not bounds else f"{name} {' and '.join(bounds)}"


def _default(value: typing.Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value) if not isinstance(value, (str, Path)) or value == '' else value}`"


def config_reference() -> str:
    out = []
    for section, model in SECTIONS.items():
        schema = model.model_json_schema()
        defs = schema.get("$defs", {})
        out += [f"### `[{section}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, field in model.model_fields.items():
            node = schema["properties"].get(key, {})
            if "$ref" in node:
                node = defs[node["$ref"].rsplit("/", 1)[1]]
            default = field.get_default(call_default_factory=True) if not field.exclude else None
            meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{section}.{key}` | {_type_name(node)} | {_default(default)} | {meaning} |")
        out.append("")
    return "\n".join(out)


def config_page(current: str) -> str:
    if not CONFIG_BLOCK.search(current):
        raise SystemExit(f"{CONFIG_PAGE}: no <!-- generated: config-reference --> ... <!-- /generated --> block")
    return CONFIG_BLOCK.sub(lambda m: m.group(1) + config_reference() + m.group(2), current)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated part differs from the code")
    check = parser.parse_args().check
    pages = {CLI_PAGE: cli_page() + "\n", CONFIG_PAGE: config_page(CONFIG_PAGE.read_text(encoding="utf-8"))}
    stale = [path for path, text in pages.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from the code: run `python docs/reference.py`")
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path], encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
