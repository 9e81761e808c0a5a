"""End-to-end speed and memory of one model under several attention implementations (GPU only).

For each implementation, on the same weights and the same copy-task batch:

* prefill: one forward over the batch that builds the KV cache and keeps the last logits
  (what ``generate`` does first);
* train step: forward + backward of the loss (``use_cache=False``; no optimizer step, which
  costs the same for every implementation);
* decode: one token per sequence against the prefilled ``DynamicCache`` (the cache's own
  ``torch.cat`` per step is part of every implementation's time); for flashrun's own kernels also
  over an e4m3 KV cache (:class:`~flashrun.model.fp8cache.Fp8Cache`: one kernel call per layer
  appends the new key and attends), a row of its own with decode only;
* peak memory of the train step and of the prefill (``torch.cuda.max_memory_allocated``,
  weights included).

The baseline ``none`` runs the model with no attention at all (:func:`swap.floor_attention`):
its times are what each phase costs around the attention, so ``baseline / none`` bounds the
speedup any attention kernel can give the model (Amdahl).

Each phase is warmed up for every implementation (compiling and tuning happen there), then
timed with CUDA events with the implementations interleaved - one repetition of each in turn - so
that a drift of the GPU's clocks or of the host over the run falls on all of them alike; the
median of each one's repetitions is reported. An implementation that is not installed, cannot run
this family faithfully, runs out of memory or fails is a row with the reason, and the others go on.
"""

from __future__ import annotations

import inspect
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from flashrun.errors import is_oom
from flashrun.model import swap
from flashrun.model.data import Batch

WARMUP = 2
DECODE_STEPS = 32
FP8_KV = "e4m3-kv"  # the label's suffix of the kernel's row over an fp8 KV cache
FLOOR = "none"  # the baseline that times the model without attention (swap.floor_attention)
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


def _event_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _peak(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB


def cache_kwarg(model: Any) -> str:
    """transformers 5.24 calls the forward's cache argument ``cache``, 5.17 ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class _Subject:
    """One implementation being timed: its row, and its call for the phase at hand."""
    impl: str
    row: SpeedRow
    fp8_kv: bool = False  # decodes over an e4m3 KV cache (and times nothing else)
    call: Callable[[], Any] | None = None
    times: list[float] = field(default_factory=list)

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, swap.Unsupported):
            self.row.status, self.row.note = "n/a", exc.message
        elif is_oom(exc):
            self.row.status, self.row.note = "OOM", "out of memory"
        else:
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            self.row.status, self.row.note = "error", f"{type(exc).__name__}: {first_line}"


def _phases(model: Any, batch: Batch) -> dict[str, Callable[[_Subject], Callable[[], Any]]]:
    """Per phase, what makes a subject's call under the implementation the model is set to
    (decode's prefills a cache of its own first)."""
    from transformers import DynamicCache

    ids = batch.input_ids
    cache_arg = cache_kwarg(model)

    def prefill(fp8_kv: bool = False) -> Any:
        if fp8_kv:
            from flashrun.model import fp8cache

            room = fp8cache.capacity(ids.shape[1], WARMUP + DECODE_STEPS)
            cache = fp8cache.Fp8Cache(model.config.num_hidden_layers, room)
        else:
            cache = DynamicCache(config=model.config)
        with torch.no_grad():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def decode(subject: _Subject) -> Callable[[], Any]:
        out = prefill(subject.fp8_kv)
        cache, token = getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1:].argmax(-1)

        def decode_step() -> None:
            with torch.no_grad():
                model(input_ids=token, use_cache=True, **{cache_arg: cache})
        return decode_step

    return {"prefill": lambda _: prefill, "train": lambda _: train_step, "decode": decode}


def _guarded(model: Any, subject: _Subject, fn: Callable[[], Any]) -> Any:
    """``fn()`` under the subject's implementation; a failure becomes its row's status."""
    try:
        model.set_attn_implementation(subject.impl)
        return fn()
    except Exception as exc:  # noqa: BLE001 - one implementation's failure is its row, not the run's
        subject.fail(exc)
        return None


def measure(model: Any, subjects: list[_Subject], batch: Batch, reps: int,
            progress: Callable[[str], None] = lambda _: None) -> None:
    """Fill each subject's row: every phase warmed up per implementation, then timed
    interleaved (``reps`` rounds; decode :data:`DECODE_STEPS`), then the peak memory."""
    from flashrun.kernels import warmup  # (a GPU run: the kernels are loaded by now)

    tokens, sequences = batch.input_ids.numel(), batch.input_ids.shape[0]
    for phase, make in _phases(model, batch).items():
        live = [s for s in subjects if s.row.status == "ok" and (phase == "decode" or not s.fp8_kv)]
        progress(f"timing {phase}: {', '.join(s.row.attention for s in live)}")
        for subject in live:
            subject.times = []
            subject.call = _guarded(model, subject, lambda s=subject: make(s))
            for _ in range(WARMUP):
                if subject.row.status == "ok":
                    _guarded(model, subject, subject.call)
        warmup.settle()  # what a first call compiles in the background (its backward) is ready before timing
        for _ in range(DECODE_STEPS if phase == "decode" else reps):
            for subject in live:
                if subject.row.status == "ok":
                    subject.times.append(_guarded(model, subject, lambda s=subject: _event_ms(s.call)))
        for subject in live:
            if subject.row.status == "ok" and phase != "decode":
                peak = _guarded(model, subject, lambda s=subject: _peak(s.call))
                setattr(subject.row, f"{phase}_peak_gib", peak)
            if subject.row.status != "ok":
                continue
            ms = statistics.median(subject.times)
            setattr(subject.row, f"{phase}_ms", ms)
            setattr(subject.row, f"{phase}_tok_s", (sequences if phase == "decode" else tokens) / ms * 1e3)
            subject.call = None
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def available(impl: str) -> str | None:
    """None when transformers can use ``impl`` here, else why not."""
    if impl == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
    return None


def run(model: Any, kernel_label: str, baselines: list[str], baseline: str, unfaithful: dict[str, str],
        batch: Batch, reps: int, progress: Callable[[str], None] = lambda _: None, fp8_kv: bool = False
        ) -> list[SpeedRow]:
    """Time the kernel (registered as :data:`swap.NAME`) and each of ``baselines``; speedups are
    against ``baseline`` (sdpa, or eager where SDPA is not faithful). ``unfaithful``: baselines
    that would run but compute something else for this model, with why (skipped). ``fp8_kv``:
    also the kernel's decode over an e4m3 KV cache (flashrun's kernels: they have the KV-cache call)."""
    rows, subjects = [], []
    for impl in [swap.NAME, *baselines]:
        label = kernel_label if impl == swap.NAME else impl
        reason = unfaithful.get(impl) or available(impl)
        rows.append(SpeedRow(label, status="n/a", note=reason) if reason else SpeedRow(label))
        if impl == FLOOR:
            rows[-1].note = "no attention (V passed through): the floor, not a model"
        if not reason:
            subjects.append(_Subject(swap.FLOOR if impl == FLOOR else impl, rows[-1]))
    if fp8_kv:
        rows.insert(1, SpeedRow(f"{kernel_label} {FP8_KV}", note="decode only, one scale per key and kv head"))
        subjects.insert(1, _Subject(swap.NAME, rows[1], fp8_kv=True))
    measure(model, subjects, batch, reps, progress)
    base = next((r for r in rows if r.attention == baseline and r.status == "ok"), None)
    for row in rows:
        if base is not None and row.status == "ok" and row.train_ms is not None:
            row.speedup_train = base.train_ms / row.train_ms
            row.speedup_prefill = base.prefill_ms / row.prefill_ms
    return rows
