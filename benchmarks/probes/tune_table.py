"""Regenerate the tuned table shipped for this GPU and Triton version (run on the GPU).

    python benchmarks/probes/tune_table.py            # -> flashrun/kernels/tuned/<gpu>-triton<x.y>.json
    python benchmarks/probes/tune_table.py --keep-forward   # tune the backward only (about half the time)
    python benchmarks/probes/tune_table.py --keep-forward --budget-s 200   # no new shape after 200 s
    python benchmarks/probes/tune_table.py --head-dims 96,256 --budget-s 480   # add those head dims' keys

Tunes flash's forward and backward kernels, in a fresh cache, for the shapes people run most: first
the attention of `flashrun model`'s 1b families at 4 x 2048 tokens in bf16 (their GQA groups are
keys of their own: llama/mistral 32/8 at head_dim 64, qwen2 12/2 at 128), then the default
`flashrun bench` sweep (fp16 and bf16, head_dim 64 and 128, causal and not, N 512..16384).
On sm_90 the backward's dK/dV of plain and causal head_dim 64/128 is the Gluon kernel's (fixed
launches, not tuned): those keys tune dQ's kernel and the atomic backward's.
(verify does not tune: it runs each kernel's default config.) Then writes the winners with the
GPU name, Triton version and launch-config space version they are valid for.

``--keep-forward`` carries the present table's forward winners over instead of re-tuning them: for
when only the backward's candidates changed (launch-config space 1 -> 2, NOTES v6: the forward's
candidate lists are the same in both).

``--head-dims 96,256`` keeps every winner of the present table and tunes only the shapes at those
head dims: the 1b families that use them at 4 x 2048 tokens in bf16, with their variants (phi3 24/8
heads at 96; gemma3 4/1 at 256, plain and with its 1024-key window; gemma2 8/4 at 256 with its
softcap of 50, plain and windowed), then the bench sweep at those head dims. Run again after a
budget stop, it goes on where it stopped (the keys it tuned are in the table then).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FLASHRUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashrun-tune-")
os.environ["FLASHRUN_TUNE"] = "1"  # tune every key the table misses (the default takes a heuristic config)

import torch  # noqa: E402
import triton  # noqa: E402

from flashrun.kernels import flash_attention, tuning  # noqa: E402

HIDDEN, TOKENS = 2048, 32768  # the bench convention: heads = hidden / D, batch = tokens / N
WINDOW = {"window": (1023, -1)}  # flashrun model's 1b families: a 1024-key sliding window
SOFTCAP = {"softcap": 50.0}  # gemma2's attention softcap


def main() -> None:
    tuning.USE_SHIPPED = False  # tune every key afresh
    start = time.perf_counter()
    target = tuning.SHIPPED / f"{tuning.table_name()}.json"
    present = json.loads(target.read_text()) if target.exists() else {"configs": {}}
    added = sys.argv[sys.argv.index("--head-dims") + 1] if "--head-dims" in sys.argv else None
    if added is not None:
        tuning._memory.update(present["configs"])  # every present key hits memory: only new ones tune
        print(f"kept all {len(present['configs'])} winners of {target}", flush=True)
    elif "--keep-forward" in sys.argv[1:]:
        kept = {key: cfg for key, cfg in present["configs"].items() if key.startswith("fwd|")}
        tuning._memory.update(kept)  # those forward calls hit memory and tune nothing
        print(f"kept {len(kept)} forward winners of {target}", flush=True)
    budget_s = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else float("inf")
    head_dims = tuple(map(int, added.split(","))) if added is not None else (64, 128)
    # (dtype, head_dim, causal, N, batch, heads, k/v heads, variants)
    models = [(torch.bfloat16, 64, True, 2048, 4, 32, 8, {}), (torch.bfloat16, 128, True, 2048, 4, 12, 2, {}),
              (torch.bfloat16, 96, True, 2048, 4, 24, 8, {}),
              (torch.bfloat16, 256, True, 2048, 4, 4, 1, {}), (torch.bfloat16, 256, True, 2048, 4, 4, 1, WINDOW),
              (torch.bfloat16, 256, True, 2048, 4, 8, 4, SOFTCAP),
              (torch.bfloat16, 256, True, 2048, 4, 8, 4, {**SOFTCAP, **WINDOW})]
    shapes = [shape for shape in models if shape[1] in head_dims]
    shapes += [(dtype, d, causal, n, max(1, TOKENS // n), max(1, HIDDEN // d), max(1, HIDDEN // d), {})
               for dtype, d, causal, n in itertools.product(
                   (torch.float16, torch.bfloat16), head_dims, (False, True), (512, 1024, 2048, 4096, 8192, 16384))]
    skipped = []
    for i, (dtype, d, causal, n, batch, heads, kv_heads, variants) in enumerate(shapes):
        label = " ".join([f"{dtype} D={d} {'causal' if causal else 'full'} N={n} H={heads}/{kv_heads}", *variants])
        if time.perf_counter() - start > budget_s:
            skipped.append(label)
            continue
        q = torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        for deterministic in (False, True):  # bwd_fused, then bwd_dkdv and bwd_dq
            out = flash_attention(q, k, v, causal=causal, deterministic=deterministic, **variants)
            out.backward(do)
        print(f"[{i + 1}/{len(shapes)}] {label}: {time.perf_counter() - start:.0f} s", flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
    made_by = "benchmarks/probes/tune_table.py"
    if added is not None:  # the present table's own account, then what this run added (once)
        made_by, note = present.get("made_by", made_by), f"head_dim {added} added by tune_table.py --head-dims {added}"
        made_by += "" if note in made_by else f"; {note}"
    document = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                "space_version": tuning.SPACE_VERSION, "made_by": made_by,
                "configs": dict(sorted(tuning._memory.items()))}
    if skipped:  # the budget ran out: those keys keep the heuristic config
        document["not_tuned"] = skipped
        print(f"not tuned (budget): {len(skipped)} shapes", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {target} ({len(document['configs'])} winners) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
