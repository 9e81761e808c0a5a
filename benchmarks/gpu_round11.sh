#!/usr/bin/env bash
# H200 runs of round 11 (results/h200-v11-*, NOTES v11), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round11.sh ab       # the GPU suite; prefill_forward_ab.py (dense and model
#                                           # layouts) and the forward bench, this checkout and, with
#                                           # OLD=<a checkout of the commit before>, that one too
#   bash benchmarks/gpu_round11.sh models   # flashrun model at 1b: every family's checks, then speed
#   bash benchmarks/gpu_round11.sh sweep    # prefill_forward_ab.py --sweep: launch configs, model layout
#   bash benchmarks/gpu_round11.sh first-use  # benchmarks/first_use.sh (issue 24's cold timings)
#   OLD=<checkout> bash benchmarks/gpu_round11.sh api   # first_call.py new-key, cold, twice each,
#                                           # alternating OLD and this checkout
# gpu_round9.sh decode ran in round 12 (gpu_round12.sh decode, results/h200-v12-decode-*).
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120
fwd() { python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --dtype bf16 --seq-lens 512,1024,2048,4096 \
  --head-dims 64,128 --causal both --set bench.rep_ms=25 "$@"; }
model() { python3 -m flashrun model --size 1b "$@"; }
case "${1:-}" in
  ab)
    timeout 240 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 \
      > "$OUT/gpu-suite.log" 2>&1
    echo "GPU suite rc $?"; tail -1 "$OUT/gpu-suite.log"
    for tree in "$PWD" ${OLD:-}; do
      name=$(basename "$tree"); mkdir -p "$OUT/$name"
      OUT="$OUT/$name" timeout 90 python3 "$tree/benchmarks/prefill_forward_ab.py"
      (cd "$tree" && timeout 110 bash -c "$(declare -f fwd); fwd --out '$OUT/$name/fwd'" > "$OUT/$name/fwd.txt" 2>&1)
    done ;;
  models)
    for arch in llama qwen2 mistral gemma2; do
      timeout 230 bash -c "$(declare -f model); model --arch $arch --batch 1 --no-speed --json" > "$OUT/$arch-checks.json"
    done
    for arch in llama qwen2 mistral gemma2; do
      base="['sdpa']"; [ $arch = gemma2 ] && base="['eager', 'sdpa']"
      model --arch $arch --batch 4 --set "model.checks=[]" --set "model.baselines=$base" --set model.reps=6 \
        --plot "$OUT/$arch-speed.png" > "$OUT/$arch-speed.txt"
    done
    timeout 120 python3 benchmarks/model_profile.py --arch llama --out "$OUT" ;;
  sweep)
    OUT="$OUT" timeout 300 python3 benchmarks/prefill_forward_ab.py --sweep ;;
  first-use)
    DEADLINE=520 bash benchmarks/first_use.sh ;;
  api)
    work=$(mktemp -d)
    for rep in 1 2; do
      for tree in ${OLD:-} "$PWD"; do
        export TRITON_CACHE_DIR=$(mktemp -d -p "$work") FLASHRUN_CACHE_DIR=$(mktemp -d -p "$work")
        echo "$rep $(basename "$tree"): $(timeout 60 python3 "$tree/benchmarks/first_call.py" new-key 2>/dev/null | tail -1)"
      done
    done | tee "$OUT/api-new-key.txt" ;;
  *)
    echo "usage: bash benchmarks/gpu_round11.sh ab|models|sweep|first-use|api" >&2; exit 2 ;;
esac
