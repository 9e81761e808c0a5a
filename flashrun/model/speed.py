"""End-to-end speed and memory of one model under several attention implementations (GPU only).

For each implementation, on the same weights and the same copy-task batch:

* prefill: one forward over the batch that builds the KV cache and keeps the last logits
  (what ``generate`` does first);
* train step: forward + backward of the loss (``use_cache=False``; no optimizer step, which
  costs the same for every implementation);
* decode: one token per sequence against the prefilled ``DynamicCache`` (the cache's own
  ``torch.cat`` per step is part of every implementation's time);
* peak memory of the train step and of the prefill (``torch.cuda.max_memory_allocated``,
  weights included).

Each phase is warmed up (compiling and tuning happen there) and timed with CUDA events; the
median of the repetitions is reported. An implementation that is not installed, cannot run
this family faithfully, runs out of memory or fails is a row with the reason, and the sweep
goes on.
"""

from __future__ import annotations

import inspect
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from flashrun.errors import is_oom
from flashrun.model import swap
from flashrun.model.data import Batch

WARMUP = 2
DECODE_STEPS = 32
GIB = 1 << 30


@dataclass
class SpeedRow:
    attention: str  # the kernel's spec, or transformers' implementation name
    prefill_ms: float | None = None
    prefill_tok_s: float | None = None
    train_ms: float | None = None
    train_tok_s: float | None = None
    decode_ms: float | None = None  # per decode step (one token per sequence)
    decode_tok_s: float | None = None
    train_peak_gib: float | None = None
    prefill_peak_gib: float | None = None
    speedup_train: float | None = None  # baseline's train_ms / this one's
    speedup_prefill: float | None = None
    status: str = "ok"  # ok | n/a | OOM | error
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _timed(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after WARMUP untimed ones."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB


def _cache_kwarg(model: Any) -> str:
    """transformers 5.24 calls the forward's cache argument ``cache``, 5.17 ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def measure(model: Any, impl: str, label: str, batch: Batch, reps: int) -> SpeedRow:
    from transformers import DynamicCache

    row = SpeedRow(label)
    ids = batch.input_ids
    tokens = ids.numel()
    cache_arg = _cache_kwarg(model)

    def prefill() -> Any:
        with torch.no_grad():
            cache = {cache_arg: DynamicCache(config=model.config)}
            return model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache)

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    try:
        model.set_attn_implementation(impl)
        row.prefill_ms = _timed(prefill, reps)
        row.prefill_peak_gib = _peak(prefill)
        row.train_ms = _timed(train_step, reps)
        row.train_peak_gib = _peak(train_step)
        model.zero_grad(set_to_none=True)
        out = prefill()
        cache, token = getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1:].argmax(-1)

        def decode_step() -> None:
            with torch.no_grad():
                model(input_ids=token, use_cache=True, **{cache_arg: cache})

        row.decode_ms = _timed(decode_step, DECODE_STEPS)
        row.prefill_tok_s, row.train_tok_s = tokens / row.prefill_ms * 1e3, tokens / row.train_ms * 1e3
        row.decode_tok_s = ids.shape[0] / row.decode_ms * 1e3
    except swap.Unsupported as exc:
        row.status, row.note = "n/a", exc.message
    except Exception as exc:  # noqa: BLE001 - one implementation's failure is its row, not the run's
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        row.status, row.note = (("OOM", "out of memory") if is_oom(exc)
                                else ("error", f"{type(exc).__name__}: {first_line}"))
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    return row


def available(impl: str) -> str | None:
    """None when transformers can use ``impl`` here, else why not."""
    if impl == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
    return None


def run(model: Any, kernel_label: str, baselines: list[str], baseline: str, unfaithful: dict[str, str],
        batch: Batch, reps: int, progress: Callable[[str], None] = lambda _: None) -> list[SpeedRow]:
    """Time the kernel (registered as :data:`swap.NAME`) and each of ``baselines``; speedups are
    against ``baseline`` (sdpa, or eager where SDPA is not faithful). ``unfaithful``: baselines
    that would run but compute something else for this model, with why (skipped)."""
    rows = []
    for impl in [swap.NAME, *baselines]:
        label = kernel_label if impl == swap.NAME else impl
        reason = unfaithful.get(impl) or available(impl)
        if reason:
            rows.append(SpeedRow(label, status="n/a", note=reason))
            continue
        progress(f"timing {label}")
        rows.append(measure(model, impl, label, batch, reps))
    base = next((r for r in rows if r.attention == baseline and r.status == "ok"), None)
    for row in rows:
        if base is not None and row.status == "ok":
            row.speedup_train = base.train_ms / row.train_ms
            row.speedup_prefill = base.prefill_ms / row.prefill_ms
    return rows
