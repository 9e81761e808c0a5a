"""Regenerate the tuned table shipped for this GPU and Triton version (run on the GPU).

    python benchmarks/probes/tune_table.py            # -> flashrun/kernels/tuned/<gpu>-triton<x.y>.json
    python benchmarks/probes/tune_table.py --keep-forward   # tune the backward only (about half the time)
    python benchmarks/probes/tune_table.py --keep-forward --budget-s 200   # no new shape after 200 s

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


def main() -> None:
    tuning.USE_SHIPPED = False  # tune every key afresh
    start = time.perf_counter()
    target = tuning.SHIPPED / f"{tuning.table_name()}.json"
    if "--keep-forward" in sys.argv[1:]:
        kept = {key: cfg for key, cfg in json.loads(target.read_text())["configs"].items() if key.startswith("fwd|")}
        tuning._memory.update(kept)  # those forward calls hit memory and tune nothing
        print(f"kept {len(kept)} forward winners of {target}", flush=True)
    budget_s = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else float("inf")
    # (dtype, head_dim, causal, N, batch, heads, k/v heads)
    shapes = [(torch.bfloat16, 64, True, 2048, 4, 32, 8), (torch.bfloat16, 128, True, 2048, 4, 12, 2)]
    shapes += [(dtype, d, causal, n, max(1, TOKENS // n), max(1, HIDDEN // d), max(1, HIDDEN // d))
               for dtype, d, causal, n in itertools.product(
                   (torch.float16, torch.bfloat16), (64, 128), (False, True), (512, 1024, 2048, 4096, 8192, 16384))]
    skipped = []
    for i, (dtype, d, causal, n, batch, heads, kv_heads) in enumerate(shapes):
        if time.perf_counter() - start > budget_s:
            skipped.append(f"{dtype} D={d} {'causal' if causal else 'full'} N={n} H={heads}/{kv_heads}")
            continue
        q = torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        for deterministic in (False, True):  # bwd_fused, then bwd_dkdv and bwd_dq
            out = flash_attention(q, k, v, causal=causal, deterministic=deterministic)
            out.backward(do)
        print(f"[{i + 1}/{len(shapes)}] {dtype} D={d} {'causal' if causal else 'full'} N={n} H={heads}/{kv_heads}: "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
    document = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                "space_version": tuning.SPACE_VERSION, "made_by": "benchmarks/probes/tune_table.py",
                "configs": dict(sorted(tuning._memory.items()))}
    if skipped:  # the budget ran out: those keys keep the heuristic config
        document["not_tuned"] = skipped
        print(f"not tuned (budget): {len(skipped)} shapes", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {target} ({len(document['configs'])} winners) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
