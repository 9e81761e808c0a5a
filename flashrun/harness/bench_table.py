"""``flashrun bench``'s output on a terminal: one table, a section per shape, then what the
table leaves out (why cells are n/a, which forward flash ran, setup times, the % peak bar), the
``flashrun verify`` command for each wrong row of our kernels, and ``--compare``'s ratios."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashrun.harness import results

if TYPE_CHECKING:
    from flashrun.harness.bench import BenchReport


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _tflops(value: float | None) -> str:
    """One decimal for GPU-sized numbers; three significant digits for the CPU's small ones."""
    return "" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def render(report: BenchReport, console: Console) -> None:
    """One table, a section per shape; why cells are n/a (or notes on how a provider ran) are
    listed once per provider and reason below it, so the table stays narrow."""
    rows = report.rows
    shown = [r for r in rows if r.status != "n/a"]
    optional = {"% peak": any(r.pct_peak is not None for r in rows), "MB": any(r.peak_mem_mb is not None for r in rows)}
    gpus = list(dict.fromkeys(r.gpu for r in rows if r.gpu))  # several on a mixed Ray cluster
    columns = [c for c in ("provider", "mode", "ms", "TFLOP/s", "% peak", "MB", "speedup", "check")
               if optional.get(c, True)]
    style = {"ok": "green", "wrong": "bold red", "OOM": "yellow", "error": "bold red"}
    sections: dict[str, list[list[str | Text]]] = {}
    for r in shown:
        values = {"provider": r.provider, "mode": r.mode, "ms": _fmt(r.ms, 3), "TFLOP/s": _tflops(r.tflops),
                  "% peak": _fmt(r.pct_peak, 0), "MB": _fmt(r.peak_mem_mb, 0),
                  "speedup": _fmt(r.speedup, 2) + ("x" if r.speedup is not None else ""),
                  "check": Text(r.status.upper() if r.status != "ok" else "ok", style=style[r.status])}
        sections.setdefault(r.shape.label, []).append([values[c] for c in columns])
    table = _table(columns, sections, first_width=24)
    table.title, table.title_justify = f"flashrun bench ({', '.join(gpus) if gpus else report.device})", "left"
    if report.gpu_types:
        _render_per_type(report, console)
    elif shown:
        console.print(table)
    reasons: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r.note:
            key = (r.provider, r.status if r.status in ("n/a", "wrong", "error") else "note", r.note)
            reasons[key] = reasons.get(key, 0) + 1
    for (provider, kind, note), count in reasons.items():
        style = {"n/a": "dim", "wrong": "bold red", "error": "bold red", "note": "dim"}[kind]
        cells = f"{count} cell{'s' if count > 1 else ''}"
        console.print(f"[{style}]{kind}[/] {provider} ({cells}): {note}", markup=True, highlight=False)
    paths: dict[tuple[str, str], dict[str, int]] = {}  # (forward|backward, provider) -> implementation -> cells
    for r in rows:
        if r.path:
            counts = paths.setdefault(("forward" if r.mode == "fwd" else "backward", r.provider), {})
            counts[r.path] = counts.get(r.path, 0) + 1
    for (which, provider), counts in paths.items():
        ran = ", ".join(f"{path} ({n} cell{'s' if n > 1 else ''})" for path, n in counts.items())
        console.print(f"{which} path {provider}: {ran}", highlight=False)
    setup: dict[str, dict[str, float]] = {}  # provider -> shape -> seconds (once per shape, not per mode)
    for r in rows:
        if r.setup_s is not None:
            setup.setdefault(r.provider, {})[r.shape.label] = r.setup_s
    if setup:
        spent = ", ".join(f"{name} {sum(shapes.values()):.1f} s" for name, shapes in setup.items())
        console.print(f"setup (prepare + first checked call, compiling and autotuning included): {spent}")
    if report.compiled is not None:
        console.print(f"{report.compiled.line()}, before the sweep (not in the setup times)", highlight=False)
    if shown:
        console.print(f"speedup: against {report.baseline}, same shape and mode")
    if report.ceiling_tflops is not None:
        fp8 = report.ceiling_fp8_tflops
        console.print(f"% peak: of a bf16 8192³ matrix product measured in this run, "
                      f"{report.ceiling_tflops:.0f} TFLOP/s"
                      + (f" (fp8 providers': of the same in e4m3, {fp8:.0f} TFLOP/s)" if fp8 is not None else ""))
    if report.metrics:
        _render_metrics(report, console)
    for notice in report.notices:
        console.print(f"[yellow]note:[/] {notice}")
    wrong = sorted({r.provider for r in rows if r.status == "wrong"})
    if wrong:
        console.print(f"[bold red]wrong results from {', '.join(wrong)}[/]: their times are not reported")
        _render_reproduce(report, console)
    if report.compare_file is not None:
        _render_compare(report, console)
    for kind, path in report.files.items():
        console.print(f"wrote {kind}: {path}")


_LIMITERS = {"registers": "regs", "shared": "smem", "threads": "threads", "programs": "blocks"}


def _table(columns: list[str], sections: dict[str, list[list[str | Text]]], first_width: int) -> Table:
    """Rows under a bold heading row per section (a shape). At 80 columns or in a pipe only the
    first column wraps - the headings, and names longer than ``first_width`` - while every other
    cell keeps its full width: a number cut to "123…" would be another number."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    body = [row for rows in sections.values() for row in rows]
    table.add_column(columns[0], overflow="fold",
                     min_width=min(first_width, max([len(columns[0])] + [len(row[0]) for row in body])))
    for i, column in enumerate(columns[1:], 1):
        table.add_column(column, justify="left" if column in ("mode", "bound", "check") else "right", no_wrap=True,
                         min_width=max([len(column)] + [len(row[i]) for row in body]))
    for n, (heading, rows) in enumerate(sections.items()):
        if n:
            table.add_section()
        table.add_row(Text(heading, style="bold"))
        for row in rows:
            table.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in row))
    return table


def _render_metrics(report: BenchReport, console: Console) -> None:
    """--metrics: per timed cell, where it sits on the roofline and how much of its wall time the
    GPU was busy; then every Triton kernel it launched, as compiled and launched."""
    rows = [r for r in report.rows if r.valid]
    why: dict[str, list[list[str | Text]]] = {}
    kernels: dict[str, list[list[str | Text]]] = {}
    for r in rows:
        why.setdefault(r.shape.label, []).append(
            [r.provider, r.mode, _fmt(r.gbps, 0), _intensity(r.intensity), r.bound, _fmt(r.pct_roof, 0),
             _fmt(r.gpu_us, 1), _fmt(r.wall_us, 1)])
        if r.kernels:
            kernels[f"{r.shape.label}  {r.provider} {r.mode}"] = [
                [k.name + (f" x{k.launches}" if k.launches > 1 else ""), "x".join(map(str, k.grid)), str(k.regs),
                 str(k.spill_bytes), f"{k.shared / 1024:.1f}", str(k.num_warps),
                 f"{k.occupancy_pct:.0f} {_LIMITERS.get(k.limiter, k.limiter)}", _fmt(k.waves, 2)]
                for k in r.kernels]
    if not why:
        return
    console.print(_table(["provider", "mode", "GB/s", "FLOP/B", "bound", "% roof", "GPU µs", "wall µs"], why, 24))
    if report.ceiling_gbps is not None and report.ceiling_tflops is not None:
        ridge = report.ceiling_tflops * 1e3 / report.ceiling_gbps
        console.print(f"% roof: of min(matmul TFLOP/s, FLOP/B x {report.ceiling_gbps:,.0f} GB/s), the copy bandwidth "
                      f"measured in this run: below {ridge:,.0f} FLOP/B a call is memory-bound. GPU µs: the "
                      "profiler's kernel time per call; wall µs: calls back to back")
    if kernels:
        console.print(_table(["kernel", "grid", "regs", "spill", "KiB", "warps", "occ %", "waves"], kernels, 20))
        console.print("per Triton kernel launched: registers and spilled (local) bytes per thread, shared KiB per "
                      "program, theoretical occupancy of an SM and what limits it, waves of programs over the SMs")


def _intensity(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _render_per_type(report: BenchReport, console: Console) -> None:
    """--per-gpu-type: TFLOP/s of each (shape, provider, mode) on each GPU type, side by side."""
    cells: dict[tuple[str, str, str], dict[str, results.Row]] = {}
    for row, gpu_type in zip(report.rows, report.row_types):
        if row.status != "n/a":
            cells.setdefault((row.shape.label, row.provider, row.mode), {})[gpu_type] = row
    table = Table(title="flashrun bench: TFLOP/s on each GPU type")
    for column in ("shape", "provider", "mode", *report.gpu_types):
        table.add_column(column, justify="left" if column in ("shape", "provider", "mode") else "right")
    previous = None
    for (shape, provider, mode), by_type in cells.items():
        if previous is not None and shape != previous:
            table.add_section()
        values = [("" if t not in by_type else _tflops(by_type[t].tflops) if by_type[t].status == "ok"
                   else by_type[t].status.upper()) for t in report.gpu_types]
        table.add_row(shape if shape != previous else "", provider, mode, *values)
        previous = shape
    console.print(table)


def _render_reproduce(report: BenchReport, console: Console) -> None:
    """For each wrong (kernel, shape): the verify command that draws the same inputs."""
    from flashrun.harness.providers import is_kernel_spec
    from flashrun.harness.verify import reproduce_command

    seen = set()
    for r in report.rows:
        key = (r.provider, r.shape)
        if r.status == "wrong" and is_kernel_spec(r.provider) and key not in seen:
            seen.add(key)
            console.print(f"  reproduce: {reproduce_command(r.provider, r.shape, report.seed, grad=r.mode != 'fwd')}",
                          markup=False, highlight=False)


def _render_compare(report: BenchReport, console: Console) -> None:
    if not report.ratios:
        console.print(f"[yellow]compare:[/] no row of this run matches one in {report.compare_file} "
                      "(same provider, mode, dtype and shape)")
        return
    table = Table(title=f"against {report.compare_file} (ratio = before / now: above 1 is faster now)")
    for column in ("provider", "mode", "dtype", "causal", "shape (B, H, Nq, Nk, D)", "before ms", "now ms", "ratio"):
        table.add_column(column, justify="left" if column in ("provider", "mode", "dtype") else "right",
                         overflow="fold")  # a long shape (a cache's lengths) wraps whole, never cut to "…"
    for ratio in report.ratios:
        r = ratio.row
        table.add_row(r.provider, r.mode, r.dtype, "yes" if r.causal else "no",
                      f"{r.batch}, {r.heads}, {r.seq_len}, {r.seq_len_k}, {r.head_dim}"
                      + (f" {r.shape.variant_label}" if r.shape.variant_label else ""),
                      _fmt(ratio.before_ms, 3), _fmt(r.ms, 3),
                      f"{ratio.ratio:.2f}x" if ratio.ratio is not None else "n/a")
    console.print(table)
