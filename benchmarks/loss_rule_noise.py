"""How often does a kernel that is as accurate as SDPA fail the train-step check's loss rule?
(NOTES v11; CPU only, no Triton.)

For many random mini models of a family in bfloat16 (fresh weights and copy-task batch per seed),
the loss and the per-token losses of ``flashrun model``'s train-step check
(:func:`flashrun.model.checks._gradients`) for the float64 reference, the yardstick (SDPA) and two
stand-in kernels: ``sdpa32``, SDPA computed in float32 and rounded (at least as accurate as
SDPA), and ``eager``, transformers' eager attention (slightly less accurate). Each is judged by
:func:`flashrun.harness.judge.compare_scaled` two ways: the loss as one number (the rule before
v11) and token by token (the rule since). Prints how many seeds fail each.

    python benchmarks/loss_rule_noise.py [--seeds 100] [--arch qwen2,llama]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from flashrun.harness.judge import compare_scaled  # noqa: E402
from flashrun.model import checks, data, families, swap  # noqa: E402


def sdpa32(module, query, key, value, attention_mask, **kwargs):
    """SDPA in float32, its output rounded to the model's dtype."""
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--arch", default="qwen2,llama")
    args = parser.parse_args()
    swap.register(None)  # the reference attention (no kernel is run here)
    AttentionInterface.register("sdpa32", sdpa32)
    AttentionMaskInterface.register("sdpa32", sdpa_mask)
    for arch in args.arch.split(","):
        config = families.build_config(arch, "mini")
        size = families.family(arch).sizes["mini"]
        fails = {(kernel, rule): 0 for kernel in ("sdpa32", "eager") for rule in ("one number", "per token")}
        for seed in range(args.seeds):
            model = families.build(config, torch.bfloat16, "cpu", seed)
            batch = data.copy_task(config.vocab_size, size.batch, size.seq_len, seed)
            subject = checks.Subject.of(model, "sdpa", torch.float64)
            ref_loss, ref_tokens, _ = checks._gradients(subject.reference, swap.REFERENCE, batch)
            yard_loss, yard_tokens, _ = checks._gradients(model, "sdpa", batch)
            for kernel in ("sdpa32", "eager"):
                loss, tokens, _ = checks._gradients(model, kernel, batch)
                one = compare_scaled("loss", loss.reshape(1), ref_loss.reshape(1), yard_loss.reshape(1))
                fails[kernel, "one number"] += not one.passed
                fails[kernel, "per token"] += not compare_scaled("token losses", tokens, ref_tokens, yard_tokens).passed
        for (kernel, rule), count in fails.items():
            print(f"{arch:6s} {kernel:7s} loss judged {rule:10s}: {count:3d} of {args.seeds} seeds fail", flush=True)


if __name__ == "__main__":
    main()
