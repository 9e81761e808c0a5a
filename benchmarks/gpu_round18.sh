#!/usr/bin/env bash
# H200 runs of round 18 (results/h200-v18-*, NOTES v18), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout> for the A/Bs:
#   bash benchmarks/gpu_round18.sh ab             # tile_order_ab.py (the tile orders in one process), twice;
#                                                 # the GPU tests of the kernels whose tile order changed
#   OLD=... bash benchmarks/gpu_round18.sh models [SAMPLES] # llama and qwen2 at 1b against SDPA, OLD and
#                                                 # this in turns, a sample each of SAMPLES (default "1 2")
#   bash benchmarks/gpu_round18.sh probe [LABELS] # tile_order_ab.py once per label (default 3)
#   OLD=... bash benchmarks/gpu_round18.sh final  # the GPU tests of the changed kernels, both tile orders;
#                                                 # models samples 2 and 3
#   bash benchmarks/gpu_round18.sh plans          # the GPU tests of the plans, routes and launches; both orders
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

probe() {  # tile_order_ab.py once per label given
  for run in "$@"; do
    OUT="$OUT/order" timeout 150 python3 benchmarks/tile_order_ab.py --label="-$run" > "$OUT/tile-order-$run.txt" 2>&1
    echo "tile order $run rc $?"; grep -E "prefill|Error" "$OUT/tile-order-$run.txt"
  done
}

models() {  # llama and qwen2 at 1b, OLD and this in turns, one sample per number given
  for i in "$@"; do
    for run in "old-$i" "this-$i"; do
      (cd "$(tree_of "$run")" && model_speed "$run")  # python -m puts the tree's flashrun first
    done
  done
}

CHANGED="flash_on_gpu or deterministic_on_gpu or gluon_kernels or windows or heads or varlen or repeatable"

case "${1:-}" in
  ab)
    probe 1 2
    gpu_tests gpu-tests-ab 200 "$CHANGED" ;;
  models)  # $2: the samples, e.g. "1 2"
    models ${2:-1 2} ;;
  probe)  # $2: the probe's labels
    probe ${2:-3} ;;
  final)  # the GPU tests of the kernels whose tile order changed, both orders; two more model samples
    gpu_tests gpu-tests-final 200 "either_order or $CHANGED"
    models 2 3 ;;
  plans)  # the GPU tests of the plans, routes and launches, and of both tile orders
    gpu_tests gpu-tests-plans 200 "plans or routes or c_launches or lays or kvcache or decode or probe or metrics or either_order" ;;
  *)
    echo "usage: bash benchmarks/gpu_round18.sh ab|models|probe|final|plans" >&2; exit 2 ;;
esac
