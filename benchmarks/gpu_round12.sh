#!/usr/bin/env bash
# H200 runs of round 12 (results/h200-v12-*, NOTES v12), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout of 7cd7cbd> for the A/Bs:
#   OLD=... bash benchmarks/gpu_round12.sh api     # first_call.py new-key, cold, alternating OLD and this checkout
#   OLD=... bash benchmarks/gpu_round12.sh decode  # decode_probe.py over issue 22's grid, OLD and this checkout
#   bash benchmarks/gpu_round12.sh gluon           # the Gluon forward's GPU tests, its host path, its config
#                                                  # space at the 1b prefill shapes (prefill_forward_ab.py --gluon-sweep)
#   bash benchmarks/gpu_round12.sh gate            # gate_d128_causal.py, then qwen2 at 1b: checks and speed
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120
case "${1:-}" in
  api)
    work=$(mktemp -d)
    for rep in 1 2; do
      for tree in ${OLD:-} "$PWD"; do
        export TRITON_CACHE_DIR=$(mktemp -d -p "$work") FLASHRUN_CACHE_DIR=$(mktemp -d -p "$work")
        echo "$rep $(basename "$tree"): $(timeout 60 python3 "$tree/benchmarks/first_call.py" new-key 2>/dev/null | tail -1)"
      done
    done | tee "$OUT/api-new-key.txt"
    export TRITON_CACHE_DIR=$(mktemp -d -p "$work") FLASHRUN_CACHE_DIR=$(mktemp -d -p "$work")
    timeout 60 python3 benchmarks/first_call.py new-key --timeline > "$OUT/api-timeline.txt" 2>&1 ;;
  decode)
    for tree in ${OLD:-} "$PWD"; do
      d="$OUT/decode-$(basename "$tree")"; mkdir -p "$d"
      OUT="$d" timeout 250 python3 "$tree/benchmarks/decode_probe.py" > "$d/log" 2>&1
      echo "decode $(basename "$tree") rc $?"; tail -22 "$d/log" | head -18
    done ;;
  gluon)
    timeout 240 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "gluon or deterministic or flash_on_gpu or heads_do_not_leak or decode_replays or kvcache or launcher" \
      > "$OUT/gpu-tests.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests.log"
    OUT="$OUT" timeout 120 python3 benchmarks/gluon_path.py
    OUT="$OUT" timeout 200 python3 benchmarks/prefill_forward_ab.py --gluon-sweep > "$OUT/gluon-sweep.log" 2>&1 ;;
  gate)
    OUT="$OUT" timeout 200 python3 benchmarks/gate_d128_causal.py
    timeout 150 python3 -m flashrun model --size 1b --arch qwen2 --batch 1 --no-speed --json > "$OUT/qwen2-checks.json"
    python3 -m flashrun model --size 1b --arch qwen2 --batch 4 --set "model.checks=[]" --set "model.baselines=['sdpa']" \
      --set model.reps=6 > "$OUT/qwen2-speed.txt" ;;
  *)
    echo "usage: bash benchmarks/gpu_round12.sh api|decode|gluon|gate" >&2; exit 2 ;;
esac
