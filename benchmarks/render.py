"""Render every published performance table and plot from the committed results.

``benchmarks/claims.toml`` lists the claims: each names the results files it was measured into
(under ``benchmarks/results/``, described in ``results/MANIFEST.toml``), the command that measures
it again, and the tables and plots drawn from those files. A table appears in the README or the
docs as a block between ``<!-- claim:ID -->`` and ``<!-- /claim -->``; this script rewrites the
block's content (the table, then a line with the card, versions, date, file and command), and
draws the plots into ``docs/assets/perf/``.

    python benchmarks/render.py            # rewrite the blocks and plots
    python benchmarks/render.py --check    # exit 1 if a block differs from its results (CI)

Templates. A cell is a format string whose fields are Python expressions over the rows of one
cell of the sweep (rows sharing every key field but ``by``, the provider by default), each row
named by its ``by`` value (``-`` becomes ``_``): ``{flash.tflops:.0f}``,
``{sdpa_cudnn.ms / flash.ms:.2f}``. A missing provider or a missing value renders ``-``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLAIMS = HERE / "claims.toml"
MANIFEST = HERE / "results" / "MANIFEST.toml"
PAGES = ("README.md", "docs/**/*.md")
BLOCK = re.compile(r"(<!-- claim:(?P<id>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /claim -->)", re.S)
FIELD = re.compile(r"\{([^{}]+)\}")
SPEC = re.compile(r":([<>^=]?[+\- ]?#?0?\d*[,_]?(?:\.\d+)?[bcdeEfFgGnosxX%]?)$")
# the fields that make two bench rows the same measurement (flashrun.harness.results.KEY, less the
# provider): the rows of one cell
CELL_KEY = ("mode", "dtype", "causal", "batch", "heads", "kv_heads", "seq_len", "seq_len_k", "head_dim",
            "window", "softcap", "alibi", "seqlens", "seqlens_k", "cache_seqlens", "page_size", "new_keys")
HEADERS = {"dtype": "dtype", "head_dim": "D", "causal": "causal", "seq_len": "N", "seq_len_k": "keys",
           "batch": "B", "heads": "heads", "kv_heads": "KV heads", "mode": "mode", "page_size": "page",
           "window": "window", "softcap": "softcap", "alibi": "ALiBi", "provider": "provider"}
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


class ClaimError(Exception):
    """A claim that cannot be rendered: a missing file, a bad template, a checksum that differs."""


class Fields:
    """A row (a dict, nested dicts too) whose keys read as attributes in templates."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self._data, self._where = data, where

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._data:
            raise Missing(f"{self._where}.{name}")  # a field this row lacks renders as -
        value = self._data[name]
        return Fields(value, f"{self._where}.{name}") if isinstance(value, dict) else value

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)


BUILTINS = {"True": True, "False": False, "None": None, "min": min, "max": max, "abs": abs, "round": round,
            "len": len, "sum": sum, "str": str}


class Missing(Exception):
    """A cell without the provider or value a template asks for: it renders as ``-``."""


class Cell(dict):
    """One cell's rows by provider; a provider it lacks is :class:`Missing`."""

    def __missing__(self, name: str) -> Any:
        if name in BUILTINS:
            return BUILTINS[name]
        raise Missing(name)


def evaluate(expression: str, names: dict[str, Any]) -> Any:
    try:
        value = eval(expression, {"__builtins__": {}}, Cell(names))  # noqa: S307 - our own claims file
    except (Missing, TypeError, ZeroDivisionError):
        return None  # a provider absent from this cell, or a value that is None
    return value


def fill(template: str, names: dict[str, Any]) -> str:
    """``template`` with each ``{expression:spec}`` evaluated; ``-`` where a value is missing."""
    def one(match: re.Match) -> str:
        inner = match.group(1)
        spec = SPEC.search(inner)
        expression, fmt = (inner[:spec.start()], spec.group(1)) if spec else (inner, "")
        value = evaluate(expression, names)
        if value is None:
            return "-"
        return format(value, fmt) if fmt else show(value)

    return FIELD.sub(one, template)


def show(value: Any) -> str:
    """A field as a table shows it: yes/no, short dtypes, lists as written."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return DTYPES.get(value, value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(show, value)) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def label(row: dict[str, Any], spec: str | list[str]) -> Any:
    """A row label: a field path, or ``[header, template]`` filled from the row's fields."""
    if isinstance(spec, str):
        return lookup(row, spec)
    return fill(spec[1], row_names(row))


def header(spec: str | list[str], headers: dict[str, str]) -> str:
    return headers.get(spec, spec) if isinstance(spec, str) else spec[0]


def row_names(row: dict[str, Any]) -> dict[str, Any]:
    """A row's fields as template names (nested dicts as Fields), and the whole row as ``row``."""
    names = {k: (Fields(v, f"{row['file']}.{k}") if isinstance(v, dict) else v)
             for k, v in row.items() if k.isidentifier()}
    return {**names, "row": Fields(row, row["file"])}


def lookup(row: dict[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return tuple(value) if isinstance(value, list) else value


def matches(row: dict[str, Any], where: dict[str, Any] | list[dict[str, Any]]) -> bool:
    """``where``: field -> wanted value (or a list of values); a list of such dicts: any of them."""
    if isinstance(where, list):
        return any(matches(row, w) for w in where)

    def same(value: Any, wanted: Any) -> bool:
        if isinstance(wanted, list) and not (isinstance(value, tuple) and len(wanted) and not isinstance(
                wanted[0], list)):
            return any(same(value, w) for w in wanted)
        wanted = tuple(wanted) if isinstance(wanted, list) else wanted
        return value == wanted or (isinstance(value, str) and DTYPES.get(value) == wanted)

    return all(same(lookup(row, key), wanted) for key, wanted in where.items())


# -- results -----------------------------------------------------------------------------------------
def load_rows(path: Path, rows_from: str = "rows") -> list[dict[str, Any]]:
    """A results file's rows, each with ``meta`` (the file's other top-level keys) and ``file``.
    ``flashrun bench``/``flashrun model`` files and the probes hold ``rows`` (or the list named
    ``rows_from``); a dict of named records (a summary) gives one row per record, its key as ``name``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    meta: dict[str, Any] = {}
    if isinstance(data, dict) and rows_from in data:
        meta = {key: value for key, value in data.items() if key != rows_from}
        data = data[rows_from]
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        data = [{"name": name, **record} for name, record in data.items()]
    if not isinstance(data, list):
        raise ClaimError(f"{path}: neither a list of rows ({rows_from!r}) nor named records")
    return [{**row, "meta": meta, "file": path.name} for row in data]


@dataclass
class Claim:
    name: str
    title: str
    command: str
    results: list[Path]
    rows_from: str = "rows"
    tables: list[dict[str, Any]] = field(default_factory=list)
    plots: list[dict[str, Any]] = field(default_factory=list)
    _rows: list[dict[str, Any]] | None = None

    @property
    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            missing = [str(p.relative_to(ROOT)) for p in self.results if not p.is_file()]
            if missing:
                raise ClaimError(f"claim {self.name}: missing results {', '.join(missing)}")
            self._rows = [row for path in self.results for row in load_rows(path, self.rows_from)]
        return self._rows


def load_claims() -> dict[str, Claim]:
    data = tomllib.loads(CLAIMS.read_text(encoding="utf-8"))
    claims = {}
    for name, spec in data.items():
        claims[name] = Claim(name, spec["title"], spec["command"], [HERE / p for p in spec["results"]],
                             spec.get("rows_from", "rows"), spec.get("table", []), spec.get("plot", []))
    return claims


def load_manifest() -> dict[str, dict[str, Any]]:
    return tomllib.loads(MANIFEST.read_text(encoding="utf-8"))


# -- tables ------------------------------------------------------------------------------------------
def cells(rows: Iterable[dict[str, Any]], by: str, key: tuple[str, ...],
          alias: dict[str, str] | None = None) -> dict[tuple, dict[str, Any]]:
    """Rows grouped into cells (same key fields), each a dict of its rows by ``by``, as Fields.
    ``by`` empty: every row is a cell, its fields named directly (and the whole row as ``row``).
    ``alias``: name -> a field whose value names one of the cell's rows (``baseline`` ->
    ``meta.model.baseline``), that row under the name too."""
    grouped: dict[tuple, dict[str, Any]] = {}
    for number, row in enumerate(rows):
        if not by:
            grouped[(number,)] = row_names(row)
            continue
        cell = grouped.setdefault(tuple(lookup(row, k) for k in key), {})
        name = re.sub(r"\W", "_", fill(by, row_names(row)) if "{" in by else str(lookup(row, by)))
        if name in cell:
            raise ClaimError(f"two rows named {name} in one cell ({row['file']}): narrow the claim's where")
        cell[name] = Fields(row, f"{row['file']}:{name}")
    for cell in grouped.values():
        for name, path in (alias or {}).items():
            target = str(lookup(_first_row(cell), path)).replace("-", "_")
            if target in cell:
                cell[name] = cell[target]
    return grouped


def markdown(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in body)]


def render_table(claim: Claim, spec: dict[str, Any]) -> list[str]:
    rows = [r for r in claim.rows if matches(r, spec.get("where", {}))
            and ("filter" not in spec or evaluate(spec["filter"], row_names(r)))]
    if not rows:
        raise ClaimError(f"claim {claim.name}, table {spec['id']}: no row matches {spec.get('where')}")
    by = spec.get("by", "provider")
    kind = spec.get("kind", "grid")
    labels = spec.get("rows", [])
    header_of = {**HEADERS, **spec.get("headers", {})}
    key = tuple(spec.get("cell_key", CELL_KEY))
    grouped = cells(rows, by, key, spec.get("alias"))
    first = {cell_key: _first_row(names) for cell_key, names in grouped.items()}
    if kind == "stats":
        return _stats(spec, grouped, first, labels, header_of)

    def label_values(cell_key: tuple) -> tuple:
        return tuple(label(first[cell_key], f) for f in labels)

    ordered = sorted({label_values(k) for k in grouped}, key=_order) if labels else [()]
    if kind == "grid":
        column = spec["cols"]
        values = sorted({lookup(first[k], column) for k in grouped}, key=_order)
        head = [header(f, header_of) for f in labels] + [spec.get("col_label", "{}").format(show(v)) for v in values]
        body = []
        for labels_of_row in ordered:
            line = [show(v) for v in labels_of_row]
            for value in values:
                found = [names for k, names in grouped.items() if label_values(k) == labels_of_row and
                         lookup(first[k], column) == value]
                line.append(fill(spec["cell"], found[0]) if found else "-")
            body.append(line)
        return markdown(head, body)
    if kind == "list":  # one line per cell, columns as templates
        head = [header(f, header_of) for f in labels] + [name for name, _ in spec["columns"]]
        body = []
        for cell_key, names in sorted(grouped.items(), key=lambda item: _order(label_values(item[0]))):
            body.append([show(v) for v in label_values(cell_key)] + [fill(t, names) for _, t in spec["columns"]])
        return markdown(head, body)
    raise ClaimError(f"claim {claim.name}, table {spec['id']}: unknown kind {kind!r}")


def _first_row(names: dict[str, Any]) -> dict[str, Any]:
    """The data of one row of a cell (the fields its rows share)."""
    if isinstance(names.get("row"), Fields):
        return names["row"]._data
    return next(v for v in names.values() if isinstance(v, Fields))._data


def _stats(spec: dict[str, Any], grouped: dict[tuple, dict[str, Any]], first: dict[tuple, dict[str, Any]],
           labels: list[str], header_of: dict[str, str]) -> list[str]:
    """min, median and max of ``value`` over the cells, one line per group of ``rows`` (and all)."""
    values = spec["values"] if "values" in spec else [["", spec["value"]]]
    groups: dict[tuple, list[float]] = {}
    for cell_key, names in grouped.items():
        for name, expression in values:
            value = evaluate(expression, names)
            if value is not None:
                group = tuple(label(first[cell_key], f) for f in labels)
                groups.setdefault((name, *group), []).append(value)
                if labels and spec.get("total", True):
                    groups.setdefault((name, *("all",) * len(labels)), []).append(value)
    head = (["ratio"] if "values" in spec else []) + [header(f, header_of) for f in labels]
    head += ["cells", "min", "median", "max"]
    fmt = spec.get("format", ".2f")
    order = {name: i for i, (name, _) in enumerate(values)}
    body = [([group[0]] if "values" in spec else []) + [show(v) for v in group[1:]]
            + [str(len(found)), *(format(f(found), fmt) for f in (min, statistics.median, max))]
            for group, found in sorted(groups.items(), key=lambda g: (order[g[0][0]], _order(g[0][1:])))]
    return markdown(head, body)


def _order(values: Any) -> tuple:
    """Sort labels naturally: numbers as numbers, None and "all" last."""
    values = values if isinstance(values, tuple) else (values,)
    return tuple((2, "") if v is None or v == "all" else (0, v) if isinstance(v, (int, float)) else (1, str(v))
                 for v in values)


def conditions(claim: Claim, manifest: dict[str, dict[str, Any]]) -> str:
    """The line under a table: where and how its numbers were measured, and how to measure them again."""
    entries = []
    for path in claim.results:
        entry = manifest.get(path.name)
        if entry is None:
            raise ClaimError(f"{path.name} (claim {claim.name}) is not in results/MANIFEST.toml")
        entries.append(entry)

    def joined(name: str) -> str:
        return " / ".join(dict.fromkeys(str(e[name]) for e in entries))

    files = ", ".join(f"`benchmarks/results/{p.name}`" for p in claim.results)
    return (f"*{joined('gpu')}, driver {joined('driver')}, torch {joined('torch')}, triton {joined('triton')}, "
            f"{joined('date')}, commit {joined('commit')}; from {files}; measure again: `{claim.command}`*")


def render_block(block_id: str, claims: dict[str, Claim], manifest: dict[str, dict[str, Any]]) -> str:
    for claim in claims.values():
        for spec in claim.tables:
            if spec["id"] == block_id:
                lines = render_table(claim, spec)
                return "\n".join([*lines, "", conditions(claim, manifest)]) + "\n"
    raise ClaimError(f"no table {block_id!r} in benchmarks/claims.toml")


# -- plots ------------------------------------------------------------------------------------------
def draw(claim: Claim, spec: dict[str, Any]) -> Path:
    """``y`` against ``x``: one colour per ``series`` label, one line style per ``style`` label
    (solid for the first, dashed for the next), into ``spec["file"]``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in claim.rows:
        names = row_names(row)
        if not matches(row, spec.get("where", {})) or (y := evaluate(spec["y"], names)) is None:
            continue
        key = (fill(spec["series"], names), fill(spec.get("style", ""), names))
        lines.setdefault(key, []).append((lookup(row, spec["x"]), y))
    series = sorted({s for s, _ in lines}, key=_order)
    styles = sorted({s for _, s in lines}, key=lambda s: s != spec.get("first_style", ""))
    figure = Figure(figsize=(7, 4), dpi=110)
    axes = figure.subplots()
    colours = matplotlib.colormaps["tab10"].colors
    for (name, style), points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        axes.plot(xs, ys, marker="o", color=colours[series.index(name) % 10],
                  linestyle=("-", "--", ":")[styles.index(style) % 3], label=f"{style} {name}".strip())
    xs = sorted({x for points in lines.values() for x, _ in points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(xs, [str(x) for x in xs])
    axes.set_xlabel(spec.get("x_label", spec["x"]))
    axes.set_ylabel(spec.get("y_label", spec["y"]))
    axes.set_title(spec.get("title", claim.title))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    target = ROOT / spec["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    return target


# -- checks ------------------------------------------------------------------------------------------
def manifest_problems(claims: dict[str, Claim], manifest: dict[str, dict[str, Any]]) -> list[str]:
    """Every results file is in the manifest with its checksum, and belongs to a claim; and back."""
    problems = []
    cited: dict[str, set[str]] = {}
    for claim in claims.values():
        for path in claim.results:
            cited.setdefault(path.name, set()).add(claim.name)
    on_disk = {p.name for p in (HERE / "results").iterdir() if p.name != MANIFEST.name}
    for name in sorted(on_disk - set(manifest)):
        problems.append(f"results/{name} is not in results/MANIFEST.toml")
    for name in sorted(set(manifest) - on_disk):
        problems.append(f"results/MANIFEST.toml lists {name}, which is not in results/")
    for name in sorted(on_disk - set(cited)):
        problems.append(f"results/{name} backs no claim in claims.toml")
    for name in sorted(on_disk & set(manifest)):
        digest = hashlib.sha256((HERE / "results" / name).read_bytes()).hexdigest()
        if manifest[name].get("sha256") != digest:
            problems.append(f"results/{name}: sha256 differs from results/MANIFEST.toml")
        if name in cited and manifest[name].get("claim") not in cited[name]:
            problems.append(f"results/{name}: the manifest says claim {manifest[name].get('claim')!r}, "
                            f"claims.toml cites it in {', '.join(sorted(cited[name]))}")
    return problems


def pages() -> list[Path]:
    return sorted({p for pattern in PAGES for p in ROOT.glob(pattern)})


def render_pages(claims: dict[str, Claim], manifest: dict[str, dict[str, Any]]) -> dict[Path, str]:
    """Each page holding claim blocks -> its text with every block rendered afresh."""
    rendered = {}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if BLOCK.search(text):
            rendered[page] = BLOCK.sub(lambda m: m.group(1) + render_block(m.group("id"), claims, manifest)
                                       + m.group(4), text)
    return rendered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a claim block differs from its results or a results file from the manifest")
    check = parser.parse_args().check
    claims, manifest = load_claims(), load_manifest()
    try:
        problems = manifest_problems(claims, manifest)
        rendered = render_pages(claims, manifest)
    except ClaimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stale = [page for page, text in rendered.items() if page.read_text(encoding="utf-8") != text]
    if check:
        problems += [f"{page.relative_to(ROOT)}: a claim block differs from its results: run "
                     "`python benchmarks/render.py`" for page in stale]
        missing = [spec["file"] for c in claims.values() for spec in c.plots if not (ROOT / spec["file"]).is_file()]
        problems += [f"{path}: plot missing: run `python benchmarks/render.py`" for path in missing]
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for page in stale:
        page.write_text(rendered[page], encoding="utf-8")
        print(f"wrote {page.relative_to(ROOT)}")
    for claim in claims.values():
        for spec in claim.plots:
            print(f"drew {draw(claim, spec).relative_to(ROOT)}")
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
