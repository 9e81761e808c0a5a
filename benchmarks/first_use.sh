#!/usr/bin/env bash
# First use on a cold machine (issue: "fast first GPU call"): regenerate the tuned table, then with
# empty Triton and flashrun caches time flash's setup in the default `flashrun bench` and the
# first call of verify for head dims it has not compiled yet. Results under $OUT (or ./gpu-session).
set -u
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200
python3 benchmarks/tune_table.py 2>&1 | tail -3
cp flashrun/kernels/tuned/*.json "$OUT/" 2>/dev/null
export TRITON_CACHE_DIR=$(mktemp -d) FLASHRUN_CACHE_DIR=$(mktemp -d)
start=$(date +%s%N)
python3 -m flashrun bench -p flash --set bench.rep_ms=20 --set bench.warmup_ms=5 --out "$OUT/first-use" --json \
  > "$OUT/first-use-bench.json"
echo "bench wall: $(( ($(date +%s%N) - start) / 1000000 )) ms"
python3 - "$OUT/first-use-bench.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
setup = {}
for r in rows:
    setup.setdefault(r["provider"], {})[(r["head_dim"], r["causal"], r["seq_len"])] = r["setup_s"] or 0
for name, shapes in setup.items():
    print(f"{name}: setup {sum(shapes.values()):.1f} s over {len(shapes)} shapes (max {max(shapes.values()):.2f} s)")
PY
export TRITON_CACHE_DIR=$(mktemp -d)
python3 -m flashrun verify --set verify.head_dim=[40,80,96,112] --set verify.seq_len=[1024] \
  --set experiment.batch_size=2 --set experiment.num_heads=8 --set experiment.num_kv_heads=8 --json \
  > "$OUT/first-use-verify.json"
python3 -m flashrun verify --grad --set verify.head_dim=[48,72] --set verify.seq_len=[1024] \
  --set experiment.batch_size=2 --set experiment.num_heads=8 --set experiment.num_kv_heads=8 --json \
  > "$OUT/first-use-verify-grad.json"
python3 - "$OUT"/first-use-verify*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["results"]:
        print(path.rsplit("/", 1)[-1], r["label"], r["status"], "first_call_s", r["first_call_s"], "ms", r["ms"])
PY
