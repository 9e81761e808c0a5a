#!/usr/bin/env bash
# `flashrun bench --metrics --profile` on a GPU (issue 23), in about 6 minutes: the default sweep
# (every default provider, float16, forward, 24 shapes), then this round's decode shapes (bf16,
# GQA 32/8, D = 128, one query against 4k-64k keys) and backward shapes (bf16 D = 128 causal
# N = 8192 with FlexAttention; GQA 32/8 causal N = 2048, 8192; D = 96 causal N = 4096), flash
# against cuDNN, then checks that
#   1. --metrics costs the timed numbers nothing: the default sweep is timed without it first and
#      with it after (warm caches both times), and the ms of every flash and cuDNN cell compared;
#   2. the registers and spilled bytes it read from the driver are ptxas -v's: every Triton kernel
#      the rows name is found in Triton's cache by its hash and its PTX compiled again with -v;
#   3. the GPU suite's metrics tests pass.
# Files under $OUT (or ./gpu-metrics), 8 at most: summary.txt (what is printed), sweep.json,
# decode.json, backward.json (bench's JSON with the metrics), sweep.png and sweep-roofline.png
# (--plot), profile.tar.gz (--profile's traces and per-kernel CSVs, every cell).
#
#   OUT=/tmp/out bash benchmarks/metrics_run.sh
# On an image without pydantic, carry its wheels in .whl/ (as benchmarks/gpu_session.sh does).
set -u
OUT=${OUT:-$PWD/gpu-metrics}
source "$(dirname "$0")/gpu_env.sh"
WORK=$(mktemp -d)
export COLUMNS=100
exec > >(tee "$OUT/summary.txt") 2>&1
TIMING=(--set bench.rep_ms=25 --set bench.warmup_ms=10)
start=$(date +%s)

echo "== the default sweep without --metrics, then with --metrics --profile --plot"
python3 -m flashrun bench "${TIMING[@]}" --out "$WORK/plain" --json > "$WORK/plain.json" \
  || echo "bench without --metrics: exit $?"
python3 -m flashrun bench "${TIMING[@]}" --out "$WORK/sweep" --metrics --profile "$WORK/profile/sweep" \
  --plot "$OUT/sweep.png" || echo "bench --metrics: exit $?"
cp "$WORK"/sweep/*.json "$OUT/sweep.json"
echo "== decode: bf16, GQA 32/8, D = 128, one query against 4k-64k keys"
GQA=(--set bench.hidden=4096 --set bench.num_kv_heads=8)
python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --dtype bf16 --head-dims 128 --causal no \
  "${GQA[@]}" --seq-lens 1 --seq-lens-k 4096,16384,65536 --mode fwd "${TIMING[@]}" --out "$WORK/decode" \
  --metrics --profile "$WORK/profile/decode" || echo "bench decode --metrics: exit $?"
cp "$WORK"/decode/*.json "$OUT/decode.json"
echo "== backward: bf16 causal, D = 128 N = 8192 (and FlexAttention), GQA 32/8 N = 2048 and 8192, D = 96 N = 4096"
python3 -m flashrun bench -k flash -p sdpa-cudnn,flex --baseline sdpa-cudnn --dtype bf16 --head-dims 128 --causal yes \
  --seq-lens 8192 --mode bwd "${TIMING[@]}" --out "$WORK/bwd-mha" --metrics --profile "$WORK/profile/bwd-mha" \
  || echo "bench backward --metrics: exit $?"
python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --dtype bf16 --head-dims 128 --causal yes \
  "${GQA[@]}" --seq-lens 2048,8192 --mode bwd "${TIMING[@]}" --out "$WORK/bwd-gqa" --metrics \
  --profile "$WORK/profile/bwd-gqa" || echo "bench backward GQA --metrics: exit $?"
python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --dtype bf16 --head-dims 96 --causal yes \
  --seq-lens 4096 --mode bwd "${TIMING[@]}" --out "$WORK/bwd-d96" --metrics --profile "$WORK/profile/bwd-d96" \
  || echo "bench backward D96 --metrics: exit $?"
python3 - "$OUT/backward.json" "$WORK"/bwd-*/*.json <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(runs[0], rows=[r for run in runs for r in run["rows"]], argv=[run["argv"] for run in runs])
open(sys.argv[1], "w").write(json.dumps(merged, indent=1) + "\n")
PY
tar -czf "$OUT/profile.tar.gz" -C "$WORK" profile
echo "profile: $(find "$WORK/profile" -type f | wc -l) files, $(du -sh "$OUT/profile.tar.gz" | cut -f1) packed"
grep -h "Proton\|no GPU activity" "$WORK"/profile/*/*.csv 2>/dev/null | cut -c1-200 | sort -u | head -5

echo "== 1. the timed numbers with and without --metrics; 2. the driver against ptxas -v"
python3 - "$WORK/plain.json" "$OUT/sweep.json" "$OUT/decode.json" "$OUT/backward.json" <<'PY'
import glob, json, os, sys, types
from pathlib import Path

from flashrun.harness.probe import ptxas_usage

plain, metrics, decode, backward = (json.load(open(p)) for p in sys.argv[1:])
key = lambda r: (r["provider"], r["mode"], r["seq_len"], r["seq_len_k"], r["head_dim"], r["causal"])
before = {key(r): r["ms"] for r in plain["rows"] if r["ms"]}
worst, changes = 0.0, []
for r in metrics["rows"]:
    if r["ms"] and key(r) in before and r["provider"] in ("flash", "sdpa-cudnn"):
        change = 100 * (r["ms"] / before[key(r)] - 1)
        worst = max(worst, abs(change))
        changes.append(change)
        print(f"  {r['provider']:10} {r['mode']:3} N{r['seq_len']} D{r['head_dim']} {'causal' if r['causal'] else 'full':6} {before[key(r)]:7.3f} -> {r['ms']:7.3f} ms "
              f"({change:+.1f}%)  gpu {r['gpu_us']} us, wall {r['wall_us']} us, {r['gbps']:.0f} GB/s, "
              f"{r['pct_roof']:.0f}% of the {r['bound']} roof")
import statistics
print(f"timed medians with --metrics against without, over {len(changes)} flash and cuDNN cells: median change "
      f"{statistics.median(changes):+.2f}%, largest {worst:.1f}% (target < 2%; run-to-run noise included)")

cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
by_hash = {}
for meta_path in glob.glob(str(cache / "*" / "*.json")):
    try:
        meta = json.load(open(meta_path))
    except (OSError, ValueError):
        continue
    if isinstance(meta, dict) and "hash" in meta and "name" in meta:
        by_hash[meta["hash"]] = (Path(meta_path), meta)
seen, agree = set(), 0
for r in metrics["rows"] + decode["rows"] + backward["rows"]:
    for k in r.get("kernels") or []:
        if k["hash"] in seen:
            continue
        seen.add(k["hash"])
        if k["hash"] not in by_hash:
            print(f"  {k['name']}: not in {cache}")
            continue
        path, meta = by_hash[k["hash"]]
        ptx = path.with_suffix(".ptx").read_text()
        usage = ptxas_usage(ptx, types.SimpleNamespace(**meta))[k["name"]]
        same = (usage.regs, usage.stack_bytes) == (k["regs"], k["spill_bytes"])
        agree += same
        print(f"  {k['name']:28} warps {k['num_warps']} shared {k['shared']:6}: driver {k['regs']:3} regs "
              f"{k['spill_bytes']:4} B local | ptxas -v {usage.regs:3} regs {usage.stack_bytes:4} B stack "
              f"({usage.spill_stores} B spill stores) {'agree' if same else 'DIFFER'}")
print(f"ptxas -v agrees with the driver on {agree} of {len(seen)} kernels")
PY

echo "== 3. the GPU suite's metrics tests"
TRITON_INTERPRET=0 python3 -m pytest -q tests/test_gpu.py -k "metrics or probe" -p no:cacheprovider 2>&1 | tail -5
echo "total: $(( $(date +%s) - start )) s"
rm -rf "$WORK"
