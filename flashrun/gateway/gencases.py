"""``flashrun gen-cases``: ask gateway models for ``(seq_len, head_dim)`` cases, keep the valid
ones, save them with provenance; or write the built-in edge cases with ``--offline``.

Each model is asked on its own: one model's failure is reported in its row and does not lose the
others' cases. A model whose reply holds no valid case is asked once more, with the reasons
appended, before it counts as failed. Nothing is written unless at least one model succeeded.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashrun.config import Config
from flashrun.errors import GatewayError, InputError
from flashrun.gateway.client import Gateway
from flashrun.gateway.replies import Rejected, extract_items, validate
from flashrun.harness.cases import CaseSpec, offline_cases, write_cases_file
from flashrun.limits import MAX_HEAD_DIM, MIN_HEAD_DIM
from flashrun.records.redact import redact_data
from flashrun.records.runlog import append_record, make_record, now_iso

DEFAULT_PROMPT = (
    "Choose the sequence lengths and head dimensions most likely to expose bugs in a tiled Triton "
    "attention kernel with block sizes from 16 to 128: length 1, lengths one below and one above a "
    "block size, primes, powers of two, the largest allowed length, and head dimensions that are not "
    "powers of two."
)


def build_messages(prompt: str, count: int, max_seq_len: int) -> list[dict[str, str]]:
    """The format contract goes in the system message, so a user's ``--prompt`` cannot lose it."""
    system = (
        "You write test cases for FlashAttention-style attention kernels. Reply with JSON only, no prose: "
        '{"cases": [{"seq_len": <integer>, "head_dim": <integer>}, ...]} with exactly '
        f"{count} distinct cases, 1 <= seq_len <= {max_seq_len}, {MIN_HEAD_DIM} <= head_dim <= {MAX_HEAD_DIM}."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def _reask(rejected: list[Rejected]) -> str:
    reasons = "; ".join(r.describe() for r in rejected[:10])
    return (f"None of those cases could be used ({reasons}). Answer again with only the JSON object, "
            "within the limits given.")


@dataclass
class ModelResult:
    model: str
    started: str
    cases: list[CaseSpec] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)  # summed over replies; empty: not reported
    latency_s: float = 0.0  # wall time of the whole exchange, retries and re-ask included
    requests: list[dict[str, Any]] = field(default_factory=list)
    mode: str | None = None
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    error: GatewayError | None = None

    def provenance(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "time": self.started,
            "response_format": self.mode,
            "response_format_refused": self.fallbacks,
            "usage": self.usage,
            "latency_s": round(self.latency_s, 3),
            "requests": self.requests,
            "cases": len(self.cases),
            "rejected": [r.to_dict() for r in self.rejected],
            "error": None if self.error is None else {"message": self.error.message, "hint": self.error.hint},
        }


@dataclass
class GenReport:
    generator: Literal["gateway", "offline"]
    out: Path
    cases: list[dict[str, Any]]  # as written (empty: nothing written)
    results: list[ModelResult]
    base_url: str | None = None

    @property
    def outcome(self) -> str:
        if not self.cases:
            return "failed"
        return "partial" if any(r.error for r in self.results) else "ok"

    @property
    def exit_code(self) -> int:
        return 0 if self.outcome == "ok" else 1

    @property
    def error(self) -> GatewayError | None:
        """The first model's error when nothing was written (the CLI reports it as the run's error)."""
        return None if self.cases else next((r.error for r in self.results if r.error), None)

    def to_json(self) -> dict[str, Any]:
        return redact_data({
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "generator": self.generator,
            "out": str(self.out.resolve()) if self.cases else None,
            "base_url": self.base_url,
            "n_cases": len(self.cases),
            "cases": self.cases,
            "models": [r.provenance() for r in self.results],
        })


def _as_dict(case: CaseSpec) -> dict[str, Any]:
    return case.model_dump(exclude_none=True)


def _model_names(cfg: Config, models: list[str], all_models: bool) -> list[str]:
    names = list(models)
    if all_models:
        if not cfg.api.models:
            raise InputError("--all-models: api.models is empty",
                             hint="list the models in settings.json (api.models), or name them with --model")
        names = list(cfg.api.models) + names
    return list(dict.fromkeys(names or [cfg.api.default_model]))


def _parse(reply_text: str, max_seq_len: int, count: int) -> tuple[list[CaseSpec], list[Rejected]]:
    items, why = extract_items(reply_text)
    cases, rejected = validate(items, max_seq_len, count)
    if why:
        excerpt = " ".join(reply_text.split())
        rejected.append(Rejected(excerpt[:80] + ("..." if len(excerpt) > 80 else ""), why))
    return cases, rejected


def _ask(gateway: Gateway, model: str, messages: list[dict[str, str]], max_seq_len: int, count: int) -> ModelResult:
    result = ModelResult(model, started=now_iso())
    started = time.perf_counter()
    try:
        conversation = list(messages)
        for attempt in (1, 2):  # the second only when the first gave nothing usable
            reply = gateway.ask_cases(model, conversation)
            result.requests.append({"response_format": reply.mode, "served_model": reply.served_model,
                                    "usage": reply.usage, "latency_s": round(reply.latency_s, 3)})
            for key, value in reply.usage.items():
                result.usage[key] = result.usage.get(key, 0) + value
            cases, rejected = _parse(reply.content, max_seq_len, count)
            result.rejected += rejected
            if cases:
                result.cases = cases
                break
            if attempt == 2:
                reasons = "; ".join(r.describe() for r in rejected[:3])
                raise GatewayError(f"model '{model}' gave no valid case, even when asked again ({reasons})",
                                   hint="try another model, a clearer --prompt, or --offline")
            conversation += [{"role": "assistant", "content": reply.content},
                             {"role": "user", "content": _reask(rejected)}]
    except GatewayError as exc:
        result.error = exc
    result.latency_s = time.perf_counter() - started
    result.mode = gateway.modes.get(model)
    result.fallbacks = gateway.fallbacks.get(model, [])
    return result


def _waiting(console: Console | None, text: str) -> Any:
    """A spinner with ``text`` while a model thinks; rich draws it only on a terminal (a pipe or
    file sees nothing), and never on stdout: the CLI passes its stderr console."""
    return nullcontext() if console is None else console.status(escape(text))


def run(
    cfg: Config,
    models: list[str] | None = None,
    all_models: bool = False,
    out: Path = Path("cases.json"),
    offline: bool = False,
    force: bool = False,
    console: Console | None = None,
) -> GenReport:
    """Generate cases and write ``out``; append a run record. Returns the report (never raises
    for a model's failure: see ``GenReport.error``). ``[cases]`` says how many cases, how long
    and what to ask; ``offline``'s fixed set is capped only when ``cases.count`` was set.
    An existing ``out`` is refused before anything is asked, unless ``force`` (like ``init``).
    ``console``: where a status line names the model being waited for (shown only on a terminal)."""
    out = Path(out)
    if out.is_dir():
        raise InputError(f"--out {out}: is a folder", hint="give a file name, e.g. --out cases.json")
    if out.exists() and not force:
        raise InputError(f"would overwrite {out}", hint="nothing was written or asked; pass --force to "
                                                         "overwrite, or pick another file with --out")
    limit = cfg.cases.max_seq_len
    if offline:
        if models or all_models:
            raise InputError("--offline asks no model", hint="drop --model / --all-models, or drop --offline")
        cap = cfg.cases.count if cfg.is_set("cases.count") else None  # the fixed set is capped only on request
        report = GenReport("offline", out, [_as_dict(c) for c in offline_cases(limit, cap)], [])
        write_cases_file(out, {"generator": "offline", "created": now_iso(), "max_seq_len": limit,
                               "cases": report.cases})
    else:
        names = _model_names(cfg, list(models or []), all_models)
        asked = cfg.cases.count
        messages = build_messages(cfg.cases.prompt or DEFAULT_PROMPT, asked, limit)
        gateway = Gateway(cfg)
        results = []
        for index, name in enumerate(names, 1):
            which = f" ({index} of {len(names)})" if len(names) > 1 else ""
            with _waiting(console, f"waiting for {name}{which} at {gateway.base_url}..."):
                results.append(_ask(gateway, name, messages, limit, asked))
        cases = [{**_as_dict(c), "model": r.model} for r in results if r.error is None for c in r.cases]
        report = GenReport("gateway", out, cases, results, base_url=gateway.base_url)
        if cases:
            write_cases_file(out, {
                "generator": "gateway", "created": now_iso(), "base_url": gateway.base_url,
                "max_seq_len": limit, "count": asked,
                "prompt": {m["role"]: m["content"] for m in messages},
                "cases": cases, "models": [r.provenance() for r in results],
            })
    record = report.to_json()
    record.pop("cases")
    append_record(cfg.logging.log_dir, make_record("gen-cases", sys.argv[1:], cfg.public_dict(), record,
                                                   n_cases=len(report.cases)))
    return report


def render(report: GenReport, out: Console, err: Console) -> None:
    """One table for the models (skipped for a lone failed model: the CLI prints its error)."""
    if report.generator == "offline":
        dims = sorted({c["head_dim"] for c in report.cases})
        lengths = [c["seq_len"] for c in report.cases]
        out.print(f"wrote {len(report.cases)} offline cases to {escape(str(report.out))} (seq_len "
                  f"{min(lengths)}..{max(lengths)}, head_dim {escape(str(dims))})")
        return
    if report.error is not None and len(report.results) == 1:
        return
    table = Table(title=f"gen-cases via {escape(str(report.base_url))}")
    table.add_column("model", no_wrap=True)
    table.add_column("valid /\nrejected", justify="right", no_wrap=True)
    table.add_column("tokens: prompt\n/ completion", justify="right", no_wrap=True)
    table.add_column("latency", justify="right", no_wrap=True)
    table.add_column("error")
    for r in report.results:
        usage = f"{r.usage.get('prompt_tokens', '-')} / {r.usage.get('completion_tokens', '-')}"
        # Errors are listed in full, with their hints, under the table; the cell shows the start.
        error = "" if r.error is None else r.error.message[:40] + ("..." if len(r.error.message) > 40 else "")
        table.add_row(escape(r.model), f"{len(r.cases)} / {len(r.rejected)}", usage, f"{r.latency_s:.2f} s",
                      f"[red]{escape(error)}[/]")
    out.print(table)
    for r in report.results:
        for rejected in r.rejected:
            err.print(f"[dim]rejected from {escape(r.model)}:[/] {escape(rejected.describe())}")
    for r in report.results:
        if r.error is not None and report.cases:  # with nothing written, the CLI reports the error
            err.print(f"[red]error ({escape(r.model)}):[/] {escape(r.error.message)}")
            if r.error.hint:
                err.print(f"[dim]hint:[/] {escape(r.error.hint)}")
    if report.cases:
        ok = sum(1 for r in report.results if r.error is None)
        out.print(f"wrote {len(report.cases)} cases from {ok} of {len(report.results)} model(s) "
                  f"to {escape(str(report.out))}")
