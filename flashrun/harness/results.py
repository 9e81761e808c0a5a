"""Bench results: rows, the CSV/JSON files (and ``--profile``'s per-kernel CSV), ``--compare`` and
``--plot`` (TFLOP/s, and the roofline). No torch here.

CSV columns are :data:`COLUMNS` in that order, then :data:`EXTRA_COLUMNS` (new columns are
appended - the KV cache's ``cache_seqlens, page_size, new_keys`` last - so files written before
them keep their columns; lists are written as JSON, ``[128, 0]``, empty for plain attention, and
so are the kernels of ``--metrics``). The JSON file holds
the same rows plus the environment fingerprint, the command and the settings of the run. Both
are rewritten atomically after every provider, so an interrupted run leaves the rows measured
so far (its JSON says ``"complete": false``).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from flashrun.errors import InputError
from flashrun.harness.metrics import Ceilings, KernelLaunch, KernelTime
from flashrun.limits import FP8_PROVIDERS
from flashrun.harness.shapes import MODES, Shape
from flashrun.records.files import atomic_write_json, atomic_write_text
from flashrun.records.redact import redact, redact_data

COLUMNS = ("provider", "mode", "dtype", "causal", "batch", "heads", "kv_heads", "seq_len", "head_dim",
           "ms", "ms_p20", "ms_p80", "tflops", "pct_peak", "peak_mem_mb", "speedup", "correct")
EXTRA_COLUMNS = ("seq_len_k", "status", "max_err", "note", "setup_s", "gpu", "torch", "triton", "timestamp",
                 "window", "softcap", "alibi", "seqlens", "seqlens_k", "where", "path",
                 "gbps", "intensity", "pct_roof", "bound", "gpu_us", "wall_us", "kernels", "gpu_kernels",
                 "config", "cache_seqlens", "page_size", "new_keys", "kv_scale")  # new columns go at the end
# What makes two rows the same measurement, across runs (for --compare).
KEY = ("provider", "mode", "dtype", "causal", "batch", "heads", "kv_heads", "seq_len", "seq_len_k", "head_dim",
       "window", "softcap", "alibi", "seqlens", "seqlens_k", "cache_seqlens", "page_size", "new_keys", "kv_scale")


@dataclass(frozen=True)
class Row:
    provider: str
    mode: str
    dtype: str
    causal: bool
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    ms: float | None  # median
    ms_p20: float | None
    ms_p80: float | None
    tflops: float | None
    pct_peak: float | None  # of the bf16 matmul ceiling measured in the same run (an fp8 provider's: the e4m3 one)
    peak_mem_mb: float | None
    speedup: float | None  # baseline ms / this ms, same case and mode
    correct: bool | None  # None: never checked (n/a, OOM before the check)
    seq_len_k: int
    status: str  # ok | wrong | n/a | OOM | error (its worker died twice: a Ray run)
    max_err: float | None
    note: str
    setup_s: float | None  # prepare + first checked call (compile, autotune), once per provider and shape
    gpu: str
    torch: str | None
    triton: str | None
    timestamp: str
    window: tuple[int, int] = (-1, -1)  # the variants (shapes.Shape's fields)
    softcap: float = 0.0
    alibi: bool = False
    seqlens: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    where: str = ""  # the node and device that measured it (flashrun.device.where)
    path: str = ""  # which implementation of the provider ran the forward (flash: gluon-sm90 or triton)
    # the roofline (harness.metrics): bytes_moved / ms, FLOP per byte, TFLOP/s over the roof of
    # this intensity, and which roof that is (memory | compute; GPU runs)
    gbps: float | None = None
    intensity: float | None = None
    pct_roof: float | None = None
    bound: str = ""
    # --metrics (harness.probe): GPU and wall time per call, the Triton kernels it launched as
    # compiled, and every GPU kernel as profiled
    gpu_us: float | None = None
    wall_us: float | None = None
    kernels: tuple[KernelLaunch, ...] = ()
    gpu_kernels: tuple[KernelTime, ...] = ()
    # our kernels' launch configs and where each came from: "fwd 128x64 w4 s3 (table); ..." (table, tuned,
    # heuristic, pinned, default)
    config: str = ""
    cache_seqlens: tuple[int, ...] | None = None  # a KV-cache call (shapes.Shape's fields)
    page_size: int = 0
    new_keys: int = 0
    kv_scale: str = ""  # the KV cache's format: "" the dtype, "tensor"/"token" e4m3

    @property
    def valid(self) -> bool:
        """Checked correct and timed: the only rows whose speed counts."""
        return self.status == "ok" and self.ms is not None

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.heads, self.kv_heads, self.seq_len, self.seq_len_k, self.head_dim,
                     self.dtype, self.causal, self.window, self.softcap, self.alibi, self.seqlens, self.seqlens_k,
                     self.cache_seqlens, self.page_size, self.new_keys, self.kv_scale)

    def key(self) -> tuple:
        return tuple(getattr(self, name) for name in KEY)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


assert tuple(f.name for f in fields(Row)) == COLUMNS + EXTRA_COLUMNS, "Row must list the columns in order"

def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):  # the kernels' columns: a list of objects
        return json.dumps([asdict(v) if is_dataclass(v) else v for v in value])
    if isinstance(value, float):
        return f"{value:.6g}"  # beyond the timer's precision; the JSON keeps every digit
    return str(value)


def to_csv(rows: list[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS + EXTRA_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(getattr(row, name)) for name in COLUMNS + EXTRA_COLUMNS])
    return buffer.getvalue()


def write(csv_path: Path, json_path: Path, rows: list[Row], header: dict[str, Any], complete: bool,
          kernels_path: Path | None = None) -> None:
    """Both files, with the key masked: the header holds the command line, a row's note an error text.
    With ``kernels_path`` (``--profile DIR``), the per-kernel breakdown as well."""
    document = {**header, "complete": complete, "columns": list(COLUMNS + EXTRA_COLUMNS),
                "rows": [row.to_json() for row in rows]}
    atomic_write_text(csv_path, redact(to_csv(rows)))
    atomic_write_json(json_path, redact_data(document))
    if kernels_path is not None:
        atomic_write_text(kernels_path, redact(kernels_csv(rows)))


KERNEL_COLUMNS = ("shape", "provider", "mode", "kernel", "launches", "gpu_us", "share_pct", "grid", "regs",
                  "spill_bytes", "shared", "num_warps", "occupancy_pct", "waves", "limiter")


def kernels_csv(rows: list[Row]) -> str:
    """Every GPU kernel of every profiled call, one line each, longest first within a call: its
    launches and GPU time per call (torch.profiler) and, for a Triton kernel, how it was compiled
    and launched (the launch metadata; several grids are joined with ``;``). A Triton kernel the
    profiler did not see gets a line with its time empty."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(KERNEL_COLUMNS)
    for row in rows:
        total = sum(k.us for k in row.gpu_kernels)
        timed = {k.name: k for k in row.gpu_kernels}
        names = list(timed) + [k.name for k in row.kernels if k.name not in timed]
        for name in dict.fromkeys(names):
            time = timed.get(name)
            launched = [k for k in row.kernels if k.name == name]

            def joined(field: str) -> str:
                return ";".join(dict.fromkeys(_csv_value(getattr(k, field)) for k in launched))

            writer.writerow([row.shape.label, row.provider, row.mode, name,
                             _csv_value(time.launches if time else None), _csv_value(time.us if time else None),
                             _csv_value(100 * time.us / total if time and total else None),
                             ";".join("x".join(map(str, k.grid)) for k in launched),
                             *(joined(field) for field in ("regs", "spill_bytes", "shared", "num_warps",
                                                           "occupancy_pct", "waves", "limiter"))])
    return buffer.getvalue()


# -- earlier results (--compare) -------------------------------------------------------------------
def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of an earlier ``flashrun bench`` CSV or JSON file, with typed key fields."""
    if not path.is_file():
        raise InputError(f"--compare {path}: no such file", hint="give a .csv or .json written by flashrun bench")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        if path.suffix.lower() == ".json":
            raw = json.loads(text)["rows"]
        else:
            raw = list(csv.DictReader(io.StringIO(text)))
        rows = [_typed(r) for r in raw]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise InputError(f"--compare {path}: not a flashrun bench results file",
                         hint="give a .csv or .json written by flashrun bench") from None
    if not rows:
        raise InputError(f"--compare {path}: holds no rows")
    return rows


def _typed(raw: dict[str, Any]) -> dict[str, Any]:
    def integer(name: str) -> int:
        return int(raw[name])

    causal = raw["causal"]
    causal = causal if isinstance(causal, bool) else str(causal).strip().lower() == "true"
    ms = raw.get("ms")
    status = raw.get("status") or "ok"
    return {
        "provider": str(raw["provider"]), "mode": str(raw["mode"]), "dtype": str(raw["dtype"]), "causal": causal,
        "batch": integer("batch"), "heads": integer("heads"), "kv_heads": integer("kv_heads"),
        "seq_len": integer("seq_len"), "seq_len_k": int(raw.get("seq_len_k") or raw["seq_len"]),
        "head_dim": integer("head_dim"),
        "ms": float(ms) if ms not in (None, "") and status == "ok" else None,
        # the variants; files written before them are plain attention
        "window": tuple(_listed(raw.get("window")) or (-1, -1)), "softcap": float(raw.get("softcap") or 0.0),
        "alibi": str(raw.get("alibi")).strip().lower() == "true",
        "seqlens": _tuple_or_none(raw.get("seqlens")), "seqlens_k": _tuple_or_none(raw.get("seqlens_k")),
        "cache_seqlens": _tuple_or_none(raw.get("cache_seqlens")), "page_size": int(raw.get("page_size") or 0),
        "new_keys": int(raw.get("new_keys") or 0), "kv_scale": str(raw.get("kv_scale") or ""),
    }


def _listed(value: Any) -> list | None:
    """A list column: JSON gives a list, CSV its JSON text, an old file nothing."""
    if value in (None, ""):
        return None
    return list(json.loads(value) if isinstance(value, str) else value)


def _tuple_or_none(value: Any) -> tuple | None:
    listed = _listed(value)
    return None if listed is None else tuple(listed)


@dataclass(frozen=True)
class Ratio:
    row: Row
    before_ms: float | None

    @property
    def ratio(self) -> float | None:
        """before / now: above 1 means faster now."""
        if self.before_ms is None or not self.row.valid:
            return None
        return self.before_ms / self.row.ms


def compare(rows: list[Row], earlier: list[dict[str, Any]]) -> list[Ratio]:
    """Each row of this run matched (same provider, mode and shape) with an earlier one."""
    before = {tuple(r[name] for name in KEY): r["ms"] for r in earlier}
    return [Ratio(row, before[row.key()]) for row in rows if row.key() in before]


# -- plot --------------------------------------------------------------------------------------------
def check_plot_target(path: Path) -> None:
    """Fail before the sweep, not after it: matplotlib present, format known, folder writable."""
    try:
        from matplotlib.figure import (
            Figure,  # a bare Figure, not pyplot: no display, Agg renders it
        )
    except ImportError:
        raise InputError("--plot needs matplotlib", hint="pip install 'flashrun[plot]'") from None

    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise InputError(f"--plot {path}: unknown image format {path.suffix or '(none)'}",
                         hint=f"use one of: {', '.join('.' + f for f in sorted(formats))}")
    if path.parent.exists() and not path.parent.is_dir():
        raise InputError(f"--plot {path}: {path.parent} is not a folder")


def plot(rows: list[Row], path: Path) -> Path:
    """TFLOP/s against sequence length, one line per provider: a row of panels per (dtype when
    the run has several, head_dim, causal), a column per mode. Only valid rows are drawn."""
    check_plot_target(path)
    from matplotlib.figure import Figure

    # Decode-like runs fix the queries and sweep the keys: then the keys are the x axis.
    x_name = "seq_len_k" if len({r.seq_len for r in rows}) == 1 and len({r.seq_len_k for r in rows}) > 1 else "seq_len"
    other_name, other_label = ("seq_len", "Nq") if x_name == "seq_len_k" else ("seq_len_k", "Nk")
    # One line per provider, unless the other length varies on its own (Nq list x Nk list).
    split = len({getattr(r, other_name) for r in rows}) > 1 and any(r.seq_len != r.seq_len_k for r in rows)
    several_dtypes = len({r.dtype for r in rows}) > 1
    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    groups = sorted({(r.dtype if several_dtypes else "", r.head_dim, r.causal) for r in rows})
    ticks = sorted({getattr(r, x_name) for r in rows})
    fig = Figure(figsize=(5.5 * len(modes), 3.8 * len(groups)))
    for row_index, (dtype, head_dim, causal) in enumerate(groups):
        for col_index, mode in enumerate(modes):
            ax = fig.add_subplot(len(groups), len(modes), row_index * len(modes) + col_index + 1)
            series: dict[str, list[Row]] = {}
            for r in rows:
                if (r.valid and r.tflops is not None and r.mode == mode and r.head_dim == head_dim
                        and r.causal == causal and (not dtype or r.dtype == dtype)):
                    variant = r.shape.variant_label  # one line per provider and variant
                    label = (r.provider + (f" [{variant}]" if variant else "")
                             + (f" ({other_label}={getattr(r, other_name)})" if split else ""))
                    series.setdefault(label, []).append(r)
            for label, points in sorted(series.items()):
                points.sort(key=lambda r: getattr(r, x_name))
                ax.plot([getattr(r, x_name) for r in points], [r.tflops for r in points], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xlabel("keys (Nk)" if x_name == "seq_len_k" else "sequence length")
            ax.set_ylabel("TFLOP/s")
            title = f"{mode}, head_dim {head_dim}, {'causal' if causal else 'full'}"
            ax.set_title(title + (f", {dtype}" if dtype else ""))
            ax.grid(True, alpha=0.3)
            if series:
                ax.legend(fontsize="small")
            else:
                ax.text(0.5, 0.5, "no valid measurement", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def roofline_path(plot_path: Path) -> Path:
    """Where ``--plot bench.png`` puts the roofline: ``bench-roofline.png``."""
    return plot_path.with_name(f"{plot_path.stem}-roofline{plot_path.suffix}")


def _roofs(points: list[Row], ceilings: Ceilings) -> list[tuple[Ceilings, str]]:
    """The roofs a roofline draws, with their labels: the bf16 one, and where rows of a provider
    that computes in e4m3 are plotted and the e4m3 matmul was measured, that one."""
    roofs = [(ceilings, f"roof: copy {ceilings.gbps:,.0f} GB/s, bf16 matmul {ceilings.tflops:,.0f} TFLOP/s")]
    if ceilings.fp8_tflops and any(r.provider in FP8_PROVIDERS for r in points):
        roofs.append((ceilings.in_fp8(), f"e4m3 matmul {ceilings.fp8_tflops:,.0f} TFLOP/s (the fp8 providers' roof)"))
    return roofs


def plot_roofline(rows: list[Row], ceilings: Ceilings, path: Path) -> Path:
    """Each valid row as a point, (FLOP/B, TFLOP/s) on log axes, under the GPU's two measured roofs:
    ``GB/s x intensity`` to the ridge point, the matmul's TFLOP/s after it; with rows of a provider
    that computes in e4m3, the e4m3 matmul's roof too, dashed. A colour per provider, a marker per mode."""
    check_plot_target(path)
    from matplotlib.figure import Figure

    points = [r for r in rows if r.valid and r.tflops and r.intensity]
    ridge = ceilings.ridge
    assert ridge is not None, "a roofline needs both ceilings"
    roofs = _roofs(points, ceilings)
    spread = [r.intensity for r in points] + [roof.ridge for roof, _ in roofs]
    lo, hi = min(spread) / 4, max(spread) * 4
    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot()
    for (roof, label), style in zip(roofs, ("-", "--")):
        ax.plot([lo, roof.ridge, hi], [roof.roof(lo), roof.tflops, roof.tflops], color="black", ls=style, lw=1.5,
                label=label)
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    providers = list(dict.fromkeys(r.provider for r in points))
    markers = {"fwd": "o", "bwd": "s", "fwd_bwd": "^"}
    for i, provider in enumerate(providers):
        for mode, marker in markers.items():
            mine = [r for r in points if r.provider == provider and r.mode == mode]
            if mine:
                ax.scatter([r.intensity for r in mine], [r.tflops for r in mine], marker=marker,
                           color=f"C{i % 10}", label=f"{provider} {mode}", alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline (ridge at {ridge:,.0f} FLOP/B: memory-bound left of it)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
