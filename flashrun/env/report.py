"""``flashrun check-env``: can this machine run Triton kernels, and if not, why not.

:func:`run_checks` wires the probes (:mod:`flashrun.env.probes`) to the verdicts
(:mod:`flashrun.env.checks`); each probe runs once, when a check first needs it. An unexpected
crash inside one check becomes a failed row (with the traceback in the ``-v`` log), and the
other rows are still reported. Two checks act rather than only look: the smoke test compiles
and runs a tiny kernel, and ``--online`` sends one request to the gateway.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashrun.config import Config
from flashrun.env import probes
from flashrun.env.checks import (
    Check,
    check_api_key,
    check_base_url,
    check_cuda,
    check_cuda_home,
    check_driver,
    check_driver_vs_torch,
    check_gpus,
    check_libcuda,
    check_log_dir,
    check_nvcc,
    check_os,
    check_ptxas,
    check_python,
    check_torch,
    check_triton,
    smoke_hint,
    smoke_verdict,
)
from flashrun.env.probes import (
    DriverInfo,
    PtxasInfo,
    Toolkit,
    TorchInfo,
    TritonInfo,
    wsl_version,
)
from flashrun.errors import FlashrunError
from flashrun.records.redact import redact, redact_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Report:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def outcome(self) -> str:
        failed = [c.name for c in self.checks if c.status == "fail"]
        if failed:
            return "failed: " + ", ".join(failed)
        warned = sum(c.status == "warn" for c in self.checks)
        return "ok" + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else "")

    def to_json(self) -> dict[str, Any]:
        return redact_data({"ok": self.ok, "outcome": self.outcome, "checks": [asdict(c) for c in self.checks]})


# --------------------------------------------------------------------------------------------
# Checks that act: a kernel run, a gateway request


def smoke_test(torch: TorchInfo, triton_ok: bool) -> Check:
    """Compile and run a tiny kernel on the GPU, or through the interpreter without one."""
    if torch.version is None or not triton_ok:
        return Check("smoke", "skip", "needs importable torch and Triton (see their rows)")
    from flashrun import device

    try:
        chosen = device.select("auto")  # before the kernel is defined: it sets TRITON_INTERPRET
    except FlashrunError as exc:
        return Check("smoke", "fail", exc.message, exc.hint or smoke_hint(exc.message))
    where = f"GPU ({torch.gpus[0].name})" if chosen.kind == "cuda" and torch.gpus else device.INTERPRETER_NOTICE
    try:
        from flashrun.env import smoke

        result = smoke.run(chosen.torch_device)
    except Exception as exc:  # compile and launch errors come in many types; the text says which
        log.debug("smoke test failed", exc_info=True)
        text = f"{type(exc).__name__}: {exc}"
        first = text.strip().splitlines()[0]
        return Check("smoke", "fail", f"{where}: {first}", smoke_hint(text))
    return smoke_verdict(where, smoke.KERNEL, result.seconds, result.max_error, result.ok)


def check_gateway(cfg: Config, online: bool) -> Check:
    if not online:
        return Check("gateway", "skip", "not contacted (pass --online to send one request)")
    from flashrun.gateway.client import check_online

    fallback = "check api.base_url, the key variable and the network"
    try:
        status, detail, hint = check_online(cfg)
    except FlashrunError as exc:
        return Check("gateway", "fail", exc.message, exc.hint or fallback)
    return Check("gateway", status, detail, hint or (fallback if status in ("warn", "fail") else None))


# --------------------------------------------------------------------------------------------
# Running and reporting


class _Facts:
    """Each probe runs once, when a check first needs it."""

    @cached_property
    def torch(self) -> TorchInfo:
        return probes.probe_torch()

    @cached_property
    def driver(self) -> DriverInfo:
        return probes.probe_driver()

    @cached_property
    def triton(self) -> TritonInfo:
        return probes.probe_triton()

    @cached_property
    def ptxas(self) -> PtxasInfo | None:
        gpu = self.torch.gpus[0] if self.torch.gpus else None
        arch = gpu.capability[0] * 10 + gpu.capability[1] if gpu and gpu.capability else None
        return probes.probe_ptxas(arch)

    @cached_property
    def toolkits(self) -> list[Toolkit]:
        return probes.probe_toolkits()


def _guarded(name: str, build: Callable[[], Check]) -> Check:
    try:
        return build()
    except Exception as exc:
        log.debug("check %s crashed", name, exc_info=True)
        return Check(name, "fail", f"the check itself crashed: {type(exc).__name__}: {exc}",
                     "a flashrun bug: please report it with the output of `flashrun check-env -v`")


def run_checks(cfg: Config, online: bool = False) -> Report:
    facts = _Facts()
    release = platform.release()
    wsl = wsl_version(release) if platform.system() == "Linux" else None
    rows: list[tuple[str, Callable[[], Check]]] = [
        ("os", lambda: check_os(platform.system(), release, Path("/dev/dxg").exists())),
        ("python", lambda: check_python((sys.version_info.major, sys.version_info.minor, sys.version_info.micro),
                                        sys.executable, probes.dist_version("tomli"))),
        ("torch", lambda: check_torch(facts.torch)),
        ("cuda", lambda: check_cuda(facts.torch, facts.driver, os.environ.get("CUDA_VISIBLE_DEVICES"))),
        ("gpu", lambda: check_gpus(facts.torch, facts.driver)),
        ("driver", lambda: check_driver(facts.driver, facts.torch.available)),
        ("driver_vs_torch", lambda: check_driver_vs_torch(facts.driver.cuda, facts.torch.cuda)),
        ("triton", lambda: check_triton(facts.triton)),
        ("ptxas", lambda: check_ptxas(facts.ptxas, facts.driver.cuda)),
        ("cuda_home", lambda: check_cuda_home(facts.toolkits, facts.torch.cuda)),
        ("nvcc", lambda: check_nvcc(probes.probe_nvcc(), facts.toolkits, facts.torch.cuda)),
        ("libcuda", lambda: check_libcuda(probes.probe_libcuda(), wsl, facts.driver.found or facts.torch.available)),
        ("log_dir", lambda: check_log_dir(cfg.logging.log_dir, probes.probe_log_dir(cfg.logging.log_dir))),
        ("api_key", lambda: check_api_key(cfg, online)),
        ("base_url", lambda: check_base_url(cfg.api.base_url)),
        ("smoke", lambda: smoke_test(facts.torch, facts.triton.usable)),
        ("gateway", lambda: check_gateway(cfg, online)),
    ]
    checks = []
    for name, build in rows:
        start = time.perf_counter()
        checks.append(_guarded(name, build))
        log.debug("check %s took %.2f s", name, time.perf_counter() - start)
    return Report(checks)


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render(report: Report, console: Console) -> None:
    table = Table(title="flashrun check-env", title_justify="left")
    for column in ("check", "status", "detail", "hint"):
        table.add_column(column, overflow="fold")
    for check in report.checks:
        table.add_row(check.name, Text(check.status, style=_STYLE[check.status]),
                      Text(redact(check.detail)), Text(redact(check.hint or ""), style="dim"))
    console.print(table)
    console.print(Text(report.outcome, style="green" if report.ok else "bold red"))


def record(cfg: Config, report: Report, argv: list[str]) -> Path | None:
    """Append the run to runs.jsonl; None when the log_dir check already said it cannot."""
    from flashrun.records.runlog import append_record, make_record

    if any(c.name == "log_dir" and c.status == "fail" for c in report.checks):
        return None
    return append_record(cfg.logging.log_dir, make_record("check-env", argv, cfg.public_dict(), report.to_json()))
