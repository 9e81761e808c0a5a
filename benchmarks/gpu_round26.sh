#!/usr/bin/env bash
# H200 runs of round 26 (results/h200-v26-*, NOTES v26), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   OLD=<a checkout of 25be553> bash benchmarks/gpu_round26.sh adds
#       # a split GQA group's float32 dK/dV adds by TMA through the consumers' dQ tiles: the GPU backward
#       # tests, then gqa_bwd_split.py --fused-only (llama-1b's and qwen2-1b's backward, every split, against
#       # cuDNN) in this checkout and $OLD in turns, twice
#   bash benchmarks/gpu_round26.sh models
#       # after SPLIT_WAVES' change: gqa_bwd_split.py once more (the rule's split, and the deterministic backward), then qwen2,
#       # llama and mistral at 1b against SDPA, speed only (model_speed)
#   bash benchmarks/gpu_round26.sh checks   # the six checks at 1b of the families whose backward changed
#   bash benchmarks/gpu_round26.sh tma-o    # the Gluon forward's O stored by TMA (hopper_jit._store_through_k): its GPU
#                                           # tests, then the short causal forward against cuDNN (N 512/1024, D 64/128,
#                                           # fp16 + bf16). (The probe before it: at b0d1590, probe-o, since reverted)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  adds)
    gpu_tests gpu-tests-adds 230 \
      "flash_on_gpu or deterministic_on_gpu or windows_on_the_gluon or backward_plans or lays_gradients or heads_do_not_leak or bitwise"
    grep -E "FAILED|Error" "$OUT/gpu-tests-adds.log" | head -20
    cp benchmarks/gqa_bwd_split.py "$OLD/benchmarks/"
    for run in this-1 old-1 this-2 old-2; do
      (cd "$(tree_of "$run")" && OUT="$OUT/split-$run" timeout 90 python3 benchmarks/gqa_bwd_split.py --fused-only) \
        > "$OUT/split-$run.txt" 2>&1
      echo "split $run rc $?"; grep -E '^(llama|qwen2) ' "$OUT/split-$run.txt" | cut -c1-700
    done ;;
  models)
    OUT="$OUT/split-this-3" timeout 120 python3 benchmarks/gqa_bwd_split.py > "$OUT/split-this-3.txt" 2>&1
    echo "split this-3 rc $?"; grep -E '^(llama|qwen2) ' "$OUT/split-this-3.txt" | cut -c1-300
    model_speed v26 "qwen2 llama mistral" ;;
  checks)
    checks "qwen2 llama mistral" ;;
  tma-o)
    gpu_tests gpu-tests-tma-o 120 "gluon_kernels or gluon_forward or forward_routes"
    grep -E "FAILED|Error" "$OUT/gpu-tests-tma-o.log" | head -20
    timeout 110 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 512,1024 --head-dims 64,128 --causal yes --out "$OUT/fwd-short" > "$OUT/fwd-short.txt" 2>&1
    echo "fwd short rc $?"; grep -E "^(B[0-9]|flash |sdpa-cudnn )" "$OUT/fwd-short.txt" | head -30 ;;
  *)
    echo "usage: OLD=<checkout> bash benchmarks/gpu_round26.sh adds | bash benchmarks/gpu_round26.sh models|checks|tma-o" >&2
    exit 2 ;;
esac
