#!/usr/bin/env bash
# `flashrun bench --metrics` on a GPU (issue 23), in about 3 minutes: flash against cuDNN on a small
# sweep with forward and backward (bf16, D = 128, causal, N = 1024 and 4096) and on decode (one
# query against 4096 and 16384 keys), then checks that
#   1. --metrics costs the timed numbers nothing: the sweep and decode are timed without it first,
#      the same with it after (warm caches both times), and the ms of every cell compared;
#   2. the registers and spilled bytes it read from the driver are ptxas -v's: every Triton kernel
#      the rows name is found in Triton's cache by its hash and its PTX compiled again with -v;
#   3. the GPU suite's metrics tests pass.
# Then --profile writes traces (and Proton's view) for the decode cells at 16384 keys, last: a
# profiler that fails there costs only profile.tar.gz. Files under $OUT (or ./gpu-metrics), 8 at
# most; summary.txt holds what is printed.
#
#   OUT=/tmp/out bash benchmarks/metrics_run.sh
# On an image without pydantic, carry its wheels in .whl/ (as benchmarks/gpu_session.sh does).
set -u
OUT=${OUT:-$PWD/gpu-metrics}
mkdir -p "$OUT"
WORK=$(mktemp -d)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 COLUMNS=100
exec > >(tee "$OUT/summary.txt") 2>&1
TIMING=(--set bench.rep_ms=25 --set bench.warmup_ms=10)
SWEEP=(-k flash -p sdpa-cudnn --baseline sdpa-cudnn --dtype bf16 --head-dims 128 --causal yes "${TIMING[@]}")
start=$(date +%s)

DECODE=(--seq-lens 1 --seq-lens-k 4096,16384 --mode fwd)
echo "== 1. the sweep and decode without --metrics, then with it (and --plot)"
python3 -m flashrun bench "${SWEEP[@]}" --seq-lens 1024,4096 --mode fwd,bwd --out "$WORK/plain" --json \
  > "$OUT/plain.json" || echo "bench without --metrics: exit $?"
python3 -m flashrun bench "${SWEEP[@]}" "${DECODE[@]}" --out "$WORK/plain-decode" --json \
  > "$OUT/plain-decode.json" || echo "bench decode without --metrics: exit $?"
python3 -m flashrun bench "${SWEEP[@]}" --seq-lens 1024,4096 --mode fwd,bwd --out "$WORK/metrics" \
  --metrics --plot "$OUT/bench.png" || echo "bench --metrics: exit $?"
cp "$WORK"/metrics/*.json "$OUT/metrics.json"
python3 -m flashrun bench "${SWEEP[@]}" "${DECODE[@]}" --out "$WORK/decode" --metrics \
  || echo "bench decode --metrics: exit $?"
cp "$WORK"/decode/*.json "$OUT/decode.json"

echo "== --profile (traces, per-kernel CSV, Proton's view): decode at 16384 keys, last"
python3 -m flashrun bench "${SWEEP[@]}" --seq-lens 1 --seq-lens-k 16384 --mode fwd --out "$WORK/prof-decode" \
  --profile "$WORK/profile" > /dev/null || echo "bench decode --profile: exit $?"
tar -czf "$OUT/profile.tar.gz" -C "$WORK" profile
ls -l "$WORK/profile" | tail -n +2 | awk '{print "  " $5 "  " $9}'
grep -h "Proton\|no GPU activity" "$WORK"/prof-*/*.csv | cut -c1-200 | sort -u | head -5

echo "== 1. the timed numbers with and without --metrics; 2. the driver against ptxas -v"
python3 - "$OUT/plain.json" "$OUT/plain-decode.json" "$OUT/metrics.json" "$OUT/decode.json" <<'PY'
import glob, json, os, sys, types
from pathlib import Path

from flashrun.harness.probe import ptxas_usage

plain, plain_decode, metrics, decode = (json.load(open(p)) for p in sys.argv[1:])
key = lambda r: (r["provider"], r["mode"], r["seq_len"], r["seq_len_k"])
before = {key(r): r["ms"] for r in plain["rows"] + plain_decode["rows"] if r["ms"]}
worst = 0.0
for r in metrics["rows"] + decode["rows"]:
    if r["ms"] and key(r) in before:
        change = 100 * (r["ms"] / before[key(r)] - 1)
        worst = max(worst, abs(change))
        print(f"  {r['provider']:10} {r['mode']:3} N{r['seq_len']}x{r['seq_len_k']:<5} {before[key(r)]:7.3f} -> {r['ms']:7.3f} ms "
              f"({change:+.1f}%)  gpu {r['gpu_us']} us, wall {r['wall_us']} us, {r['gbps']:.0f} GB/s, "
              f"{r['pct_roof']:.0f}% of the {r['bound']} roof")
print(f"largest change of a timed median with --metrics: {worst:.1f}% (target < 2%; run-to-run noise included)")

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
for r in metrics["rows"] + decode["rows"]:
    for k in r["kernels"]:
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
