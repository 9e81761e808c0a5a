#!/usr/bin/env bash
# H200 runs of round 24 (results/h200-v24-*, NOTES v24), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   OLD=<a checkout of 6d96c73> bash benchmarks/gpu_round24.sh cast   # the GPU tests of the default backward
#                                           # (dQ cast by its last contributor among them); the backward at
#                                           # bf16 D64/128, 1k/4k/16k, full + causal against cuDNN, round 23's
#                                           # code and this in turns (ran before CAST_SYNC existed: as SYNC 0
#                                           # without the acquire fence in the cast)
#   bash benchmarks/gpu_round24.sh sync     # benchmarks/cast_probe.py: the fill-and-cast path against the
#                                           # in-kernel cast under each CAST_SYNC
# Both ran at the experiment's commit; it was reverted (NOTES v24).
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  cast)
    gpu_tests gpu-tests-backward 230 \
      "last_contributor or flash_on_gpu or windows_on_the_gluon or backward_plans or default_backward_lays"
    grep -E "FAILED|Error" "$OUT/gpu-tests-backward.log" | head -20
    for run in old-1 this-1; do
      (cd "$(tree_of "$run")" && timeout 150 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd \
        --set bench.rep_ms=30 --dtype bf16 --seq-lens 1024,4096,16384 --head-dims 64,128 --causal both \
        --out "$OUT/ab-$run") > "$OUT/bwd-ab-$run.txt" 2>&1
      echo "bwd $run rc $?"; grep -E "^(B[0-9]|flash |sdpa-cudnn )" "$OUT/bwd-ab-$run.txt" | head -30
    done ;;
  sync)
    timeout 400 python3 benchmarks/cast_probe.py --out "$OUT" > "$OUT/cast-probe.txt" 2>&1
    echo "cast probe rc $?"; cat "$OUT/cast-probe.txt" | grep -v "^INFO" | cut -c1-240 ;;
  *)
    echo "usage: bash benchmarks/gpu_round24.sh cast|sync" >&2; exit 2 ;;
esac
