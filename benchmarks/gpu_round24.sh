#!/usr/bin/env bash
# H200 runs of round 24 (results/h200-v24-*, NOTES v24), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round24.sh why      # where the time goes where the targets are missed: the backward
#                                           # at N = 1024 (fp16 + bf16, D 64/128, full + causal) against Flex
#                                           # and cuDNN with --metrics (each provider's kernels, GPU time per
#                                           # call); the forward at N = 512 and 1024 causal against cuDNN;
#                                           # model_profile.py for llama and qwen2 at 1b (flash vs SDPA, kernel
#                                           # by kernel)
# The round's experiment, the dQ cast by its last contributor, ran as `OLD=<6d96c73> bash
# benchmarks/gpu_round24.sh cast` and `bash benchmarks/gpu_round24.sh sync` at 298c39c, which holds
# those modes and benchmarks/cast_probe.py; it was reverted (882d4d2, NOTES v24).
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  why)
    timeout 260 python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
      --dtype fp16,bf16 --seq-lens 1024 --head-dims 64,128 --causal both --metrics --out "$OUT/bwd-n1024" \
      > "$OUT/bwd-n1024.txt" 2>&1
    echo "bwd N1024 --metrics rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-n1024.txt" | head -40
    timeout 100 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=30 \
      --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal yes --out "$OUT/fwd-short" \
      > "$OUT/fwd-short.txt" 2>&1
    echo "fwd short rc $?"; grep -E "^(B[0-9]|flash |sdpa-cudnn )" "$OUT/fwd-short.txt" | head -30
    timeout 170 python3 benchmarks/model_profile.py --arch llama,qwen2 --reps 6 --out "$OUT/model-profile" \
      > "$OUT/model-profile.txt" 2>&1
    echo "model profile rc $?"; tail -60 "$OUT/model-profile.txt" | cut -c1-160 ;;
  *)
    echo "usage: bash benchmarks/gpu_round24.sh why" >&2; exit 2 ;;
esac
