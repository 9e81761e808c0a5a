"""The checks of ``flashrun model``: is a model with the kernel swapped in still the same model?

Every check runs the model three ways on the same weights and inputs - the *reference* (a
float64 copy on the CPU, float32 on a GPU, with transformers' ``eager`` attention of the family,
padded query rows zeroed: :func:`~flashrun.model.swap.reference_attention`), the
*yardstick* (the model in its own dtype with the family's baseline attention: ``sdpa``, or
``eager`` where SDPA cannot run the family faithfully) and the *kernel* - and judges the kernel
by :func:`flashrun.harness.judge.compare_scaled`: no worse than twice the yardstick's own error.

* ``logits`` (and ``logits-padded``, ``logits-packed``): the forward logits on the compared
  positions; each layer's attention output is judged too, so a failure names the first layer
  that diverges (and whether it is a sliding-window layer);
* ``train-step``: each labelled token's loss and every parameter's gradient after one backward,
  naming the worst;
* ``training``: a fixed-seed AdamW run of ``steps`` steps on the copy task, the kernel's loss
  curve against the reference's with the yardstick's distance as the scale;
* ``generate``: greedy generation with the KV cache in float32 (bf16 logits of a random model
  tie too often for exact token equality), whose tokens must equal the yardstick's; a
  difference reports the first differing position and the logit margin there.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from flashrun.errors import is_oom
from flashrun.harness.judge import Comparison, compare_scaled
from flashrun.model import swap
from flashrun.model.data import PAD, Batch

CHECKS = ("logits", "train-step", "training", "generate", "generate-fp8")


@dataclass
class Check:
    name: str
    passed: bool
    summary: str  # one line, for the table
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "summary": self.summary, **self.detail}


@dataclass
class Subject:
    """The model under test (its attention switched between the baseline and the kernel) and
    its high-precision reference copy."""

    model: Any
    reference: Any
    baseline: str  # "sdpa" or "eager"
    dtype: torch.dtype

    @classmethod
    def of(cls, model: Any, baseline: str, reference_dtype: torch.dtype) -> Subject:
        reference = copy.deepcopy(model).to(reference_dtype)
        reference.set_attn_implementation(swap.REFERENCE)
        return cls(model, reference, baseline, next(model.parameters()).dtype)

    def runs(self) -> list[tuple[str, Any, str]]:
        """(role, model, attention implementation), the reference first."""
        return [("reference", self.reference, swap.REFERENCE), ("yardstick", self.model, self.baseline),
                ("kernel", self.model, swap.NAME)]


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """Run one check; what the kernel refuses or raises fails that check with the reason."""
    try:
        return check()
    except swap.Unsupported as exc:
        return Check(name, False, f"unsupported: {exc.message}", {"error": exc.message})
    except Exception as exc:  # noqa: BLE001 - a kernel's failure is this check's result, not a crash
        if is_oom(exc):
            return Check(name, False, "out of memory", {"error": "OOM"})
        text = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        return Check(name, False, f"error: {text.splitlines()[0] if text else type(exc).__name__}", {"error": text})


# -- logits ----------------------------------------------------------------------------------------


def attention_modules(model: Any) -> list[Any]:
    """The attention module of every layer, in order (the modules carrying ``layer_idx``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


@contextmanager
def _tapped(model: Any) -> Iterator[list[torch.Tensor]]:
    """Capture each attention module's output (before the residual add) during a forward."""
    outputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _in, out: outputs.append(out[0].detach()))
             for m in attention_modules(model)]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def _forward(model: Any, impl: str, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.set_attn_implementation(impl)
    with torch.no_grad(), _tapped(model) as layers:
        logits = model(**batch.kwargs(), use_cache=False).logits
    return logits, layers


def _layer_kind(model: Any, index: int) -> str:
    types = getattr(model.config, "layer_types", None)
    window = getattr(model.config, "sliding_window", None)
    if types is not None and index < len(types):
        kind = types[index]
        return f"{kind.replace('_attention', '')}" + (f", window {window}" if "sliding" in kind and window else "")
    return f"window {window}" if window else "full"


def check_logits(subject: Subject, batch: Batch, name: str = "logits") -> Check:
    outputs = {role: _forward(model, impl, batch) for role, model, impl in subject.runs()}
    valid = batch.valid().to(outputs["reference"][0].device)
    (ref, ref_layers), (yard, yard_layers), (ker, ker_layers) = (outputs[r] for r in ("reference", "yardstick",
                                                                                       "kernel"))
    result = compare_scaled("logits", ker[valid], ref[valid], yard[valid])
    first = None
    for index, (r, y, k) in enumerate(zip(ref_layers, yard_layers, ker_layers)):
        if not compare_scaled(f"layer {index}", k[valid], r[valid], y[valid]).passed:
            first = index
            break
    detail = {**_numbers(result), "layers": len(ref_layers), "first_diverging_layer": first}
    if first is not None:
        detail["first_diverging_layer_kind"] = _layer_kind(subject.model, first)
    if result.passed:
        return Check(name, True, _within(result, subject.baseline), detail)
    where = f"; first diverging layer: {first} ({detail['first_diverging_layer_kind']})" if first is not None else ""
    return Check(name, False, result.reason() + where, detail)


def _numbers(c: Comparison) -> dict[str, Any]:
    return {"max_abs": c.max_abs, "rel_l2": c.rel_l2, "bound": c.bound, "rel_bound": c.rel_bound,
            "yardstick": c.yardstick, "nonfinite": c.nonfinite}


def _within(c: Comparison, baseline: str) -> str:
    return (f"max error {c.max_abs:.3g} <= {c.bound:.3g} allowed ({baseline}'s own {c.yardstick:.3g}); "
            f"rel-L2 {c.rel_l2:.3g}")


# -- one training step -----------------------------------------------------------------------------


def _labels(batch: Batch) -> torch.Tensor:
    return batch.input_ids.masked_fill(~batch.valid(), -100)


def _gradients(model: Any, impl: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss, each labelled token's loss, every parameter's gradient) after one backward."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    labels = _labels(batch)
    out = model(**batch.kwargs(), labels=labels, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    targets = labels[:, 1:].flatten()  # token t + 1 predicted at t, as the model's loss shifts them
    logits = out.logits.detach()[:, :-1].flatten(0, 1)[targets != -100]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss's own precision, or more
    tokens = torch.nn.functional.cross_entropy(logits, targets[targets != -100], reduction="none")
    return out.loss.detach(), tokens, grads


def check_train_step(subject: Subject, batch: Batch) -> Check:
    """The loss is judged token by token (each labelled position's cross-entropy, whose mean the
    loss is): the rule's yardstick error on one number is one noise sample, and a kernel as
    accurate as the yardstick failed it in about a fifth of random models (NOTES v11)."""
    runs = {role: _gradients(model, impl, batch) for role, model, impl in subject.runs()}
    (ref_loss, ref_tokens, ref), (_, yard_tokens, yard), (ker_loss, ker_tokens, ker) = (
        runs[r] for r in ("reference", "yardstick", "kernel"))
    results = [compare_scaled("token losses", ker_tokens, ref_tokens, yard_tokens)]
    missing = sorted(set(ref) - set(ker))
    if missing:
        return Check("train-step", False, f"{len(missing)} parameter(s) got no gradient through the kernel, e.g. "
                     f"{missing[0]}", {"missing": missing})
    results += [compare_scaled(name, ker[name], ref[name], yard[name]) for name in ref]
    worst = max(results, key=_severity)
    failed = [c for c in results if not c.passed]
    detail = {"loss": float(ker_loss), "reference_loss": float(ref_loss), "tokens": len(ref_tokens),
              "token_losses": _numbers(results[0]), "parameters": len(results) - 1,
              "failed": [c.name for c in failed], "worst": worst.name, "worst_fraction": _severity(worst),
              "worst_numbers": _numbers(worst)}
    if failed:
        return Check("train-step", False, f"{len(failed)} of {len(results)} failed; worst {worst.reason()}", detail)
    return Check("train-step", True, f"{len(ref_tokens)} token losses and {len(results) - 1} gradients within "
                 f"bounds; worst {worst.name} at {_severity(worst):.2f} of its bound", detail)


def _severity(c: Comparison) -> float:
    """How close a comparison is to failing: the larger of error / bound on its two measures."""
    fractions = [c.max_abs / c.bound if c.bound > 0 else (math.inf if c.max_abs > 0 else 0.0)]
    if c.rel_bound:
        fractions.append(c.rel_l2 / c.rel_bound)
    return math.inf if c.nonfinite else max(fractions)


# -- a short training run --------------------------------------------------------------------------


def _train(model: Any, impl: str, batch: Batch, steps: int, lr: float) -> list[float]:
    model.set_attn_implementation(impl)
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch.kwargs(), labels=_labels(batch), use_cache=False).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        model.load_state_dict(start)  # the next run starts from the same weights
        model.zero_grad(set_to_none=True)
    return losses


def check_training(subject: Subject, batch: Batch, steps: int, lr: float) -> Check:
    curves = {role: _train(model, impl, batch, steps, lr) for role, model, impl in subject.runs()}
    as_tensor = {role: torch.tensor(curve, dtype=torch.float64) for role, curve in curves.items()}
    result = compare_scaled("loss curve", as_tensor["kernel"], as_tensor["reference"], as_tensor["yardstick"],
                            dtype=subject.dtype)
    kernel = curves["kernel"]
    if not all(math.isfinite(loss) for loss in curves["reference"]):
        return Check("training", False, f"the reference run diverged (loss {curves['reference']}): nothing to judge "
                     "against", {"reference_losses": curves["reference"], "hint": "lower model.lr"})
    detail = {"steps": steps, "lr": lr, "losses": kernel, "reference_losses": curves["reference"],
              "baseline_losses": curves["yardstick"], **_numbers(result)}
    fell = f"loss {kernel[0]:.3f} -> {kernel[-1]:.3f}" if kernel else "no steps"
    if result.passed:
        return Check("training", True, f"{steps} steps, {fell}; curve within {result.bound:.3g} of the reference "
                     f"({subject.baseline}'s {result.yardstick:.3g})", detail)
    step = result.first_bad[0] if result.first_bad else None
    return Check("training", False, f"{result.reason()} (step {step}); {fell}",
                 detail)


# -- greedy generation -----------------------------------------------------------------------------


def _generate(model: Any, impl: str, prompt: torch.Tensor, tokens: int, cache: Any = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (B, T) and their logits (B, T, V); ``cache``: a cache of one's own (else
    transformers' dynamic one)."""
    from flashrun.model.speed import cache_kwarg

    model.set_attn_implementation(impl)
    given = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True, **given)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, dim=1)  # (B, T), (B, T, V)


def _float32(subject: Subject) -> Any:
    return subject.model if subject.dtype == torch.float32 else copy.deepcopy(subject.model).float()


def _prompt(batch: Batch) -> torch.Tensor:
    return batch.input_ids[:, : max(1, batch.input_ids.shape[1] // 2)]


def check_generate(subject: Subject, batch: Batch, tokens: int) -> Check:
    model, prompt = _float32(subject), _prompt(batch)
    base_tokens, base_logits = _generate(model, subject.baseline, prompt, tokens)
    ker_tokens, ker_logits = _generate(model, swap.NAME, prompt, tokens)
    differ = (base_tokens != ker_tokens).nonzero()
    detail = {"prompt_tokens": prompt.shape[1], "new_tokens": tokens, "dtype": "float32", "rows": prompt.shape[0]}
    if not len(differ):
        return Check("generate", True, f"{prompt.shape[0]} x {tokens} greedy tokens equal to {subject.baseline}'s "
                     f"(float32, prompt {prompt.shape[1]})", detail)
    row, position = (int(i) for i in differ[differ[:, 1].argmin()])
    top, ker_top = (logits[row, position].float().topk(2).values for logits in (base_logits, ker_logits))
    detail.update(row=row, position=position, baseline_token=int(base_tokens[row, position]),
                  kernel_token=int(ker_tokens[row, position]), baseline_margin=float(top[0] - top[1]),
                  kernel_margin=float(ker_top[0] - ker_top[1]), differing=len(differ))
    return Check("generate", False, f"tokens differ from {subject.baseline}'s first at row {row}, new token "
                 f"{position} ({detail['kernel_token']} vs {detail['baseline_token']}; {subject.baseline}'s top-2 "
                 f"logit margin there {detail['baseline_margin']:.3g})", detail)


def check_generate_fp8(subject: Subject, batch: Batch, tokens: int) -> Check:
    """Generation with the kernel reading an fp8 KV cache (:class:`~flashrun.model.fp8cache.Fp8Cache`),
    judged as verify judges fp8: the truth is the reference attention in float32 over what that
    cache holds (:class:`~flashrun.model.fp8cache.HeldCache`) - the quantization is the format's,
    the arithmetic is the kernel's. The truth generates greedily; the kernel and the yardstick
    (the same reference on inputs rounded to the kernel's float16 queries) follow its tokens
    step by step, and every step's logits must be within twice the yardstick's error
    (:func:`~flashrun.harness.judge.compare_scaled`). Beside, not gated: how often the kernel's
    own greedy choice is the truth's token, and how the kernel's greedy tokens compare with the
    baseline's over the unquantized cache - on random weights that says how far e4m3 moves the
    tokens, not how a trained model fares."""
    from flashrun.model import fp8cache

    fp8cache.register()
    model, prompt = _float32(subject), _prompt(batch)
    layers = model.config.num_hidden_layers
    truth_tokens, truth = _generate(model, swap.REFERENCE, prompt, tokens, fp8cache.HeldCache(layers))
    room = fp8cache.capacity(prompt.shape[1], tokens)
    kernel = _forced(model, swap.NAME, prompt, truth_tokens, fp8cache.Fp8Cache(layers, room))
    yardstick = _forced(model, fp8cache.ROUNDED, prompt, truth_tokens, fp8cache.HeldCache(layers))
    result = compare_scaled("logits", kernel, truth, yardstick)
    own_tokens, _ = _generate(model, swap.NAME, prompt, tokens, fp8cache.Fp8Cache(layers, room))
    plain_tokens, _ = _generate(model, subject.baseline, prompt, tokens)
    agree = float((kernel.argmax(-1) == truth_tokens).float().mean())
    unquantized = float((own_tokens == plain_tokens).float().mean())
    detail = {**_numbers(result), "prompt_tokens": prompt.shape[1], "new_tokens": tokens, "rows": prompt.shape[0],
              "dtype": "float32", "queries": "float16", "cache": "e4m3, one scale per key and kv head",
              "argmax_is_truth_token": agree, "greedy_equal_to_unquantized": unquantized}
    beside = (f"argmax = the truth's token at {agree:.0%} of steps; greedy tokens vs {subject.baseline} over the "
              f"unquantized cache: {unquantized:.0%} equal")
    if result.passed:
        within = _within(result, "the float16-query reference")
        return Check("generate-fp8", True, f"{prompt.shape[0]} x {tokens} steps: {within}; {beside}", detail)
    return Check("generate-fp8", False, f"{result.reason()}; {beside}", detail)


def _forced(model: Any, impl: str, prompt: torch.Tensor, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    """The logits (B, T, V) of each step of a generation made to follow ``tokens`` (B, T): the
    prompt's last position, then each token fed in turn against ``cache``."""
    from flashrun.model.speed import cache_kwarg

    model.set_attn_implementation(impl)
    given, steps = {cache_kwarg(model): cache}, []
    with torch.no_grad():
        for fed in [prompt, *tokens[:, :-1].split(1, dim=1)]:
            steps.append(model(input_ids=fed, use_cache=True, logits_to_keep=1, **given).logits[:, -1])
    return torch.stack(steps, dim=1)
