#!/usr/bin/env bash
# H200 runs of round 24 (results/h200-v24-*, NOTES v24), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   EXP=<a checkout of 120bb23> bash benchmarks/gpu_round24.sh last   # the in-kernel dQ cast's second
#                                           # build (120bb23, reverted in 4d6bab0): cast_probe.py from $EXP;
#                                           # then, on this code, the backward at N = 1024 (fp16 + bf16, D 64/128,
#                                           # full + causal) against Flex and cuDNN with --metrics (every
#                                           # provider's kernels, GPU time per call) and model_profile.py for
#                                           # qwen2 at 1b (flash vs SDPA, kernel by kernel)
#   bash benchmarks/gpu_round24.sh rest     # the forward at N = 512 and 1024 causal against cuDNN; model_profile.py
#                                           # for llama at 1b
# The first build ran as `OLD=<6d96c73> bash benchmarks/gpu_round24.sh cast` and `bash
# benchmarks/gpu_round24.sh sync` at 298c39c, which holds those modes and cast_probe.py; it was
# reverted in 882d4d2.
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  last)  # EXP=<checkout of the second build>
    (cd "$EXP" && export PYTHONPATH="$PWD:/tmp/site" && timeout 150 python3 benchmarks/cast_probe.py --out "$OUT" \
      > "$OUT/cast-probe-v3.txt" 2>&1; echo "cast probe rc $?")
    grep -v "^INFO" "$OUT/cast-probe-v3.txt" | cut -c1-240
    timeout 230 python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
      --dtype fp16,bf16 --seq-lens 1024 --head-dims 64,128 --causal both --metrics --out "$OUT/bwd-n1024" \
      > "$OUT/bwd-n1024.txt" 2>&1
    echo "bwd N1024 --metrics rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-n1024.txt" | head -40
    timeout 150 python3 benchmarks/model_profile.py --arch qwen2 --reps 6 --out "$OUT/model-profile" \
      > "$OUT/model-profile.txt" 2>&1
    echo "model profile rc $?"; tail -40 "$OUT/model-profile.txt" | cut -c1-160 ;;
  rest)
    timeout 110 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=30 \
      --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal yes --out "$OUT/fwd-short" \
      > "$OUT/fwd-short.txt" 2>&1
    echo "fwd short rc $?"; grep -E "^(B[0-9]|flash |sdpa-cudnn )" "$OUT/fwd-short.txt" | head -30
    timeout 150 python3 benchmarks/model_profile.py --arch llama --reps 6 --out "$OUT/model-profile" \
      > "$OUT/model-profile-llama.txt" 2>&1
    echo "model profile rc $?"; grep -E "^llama|train kernels|^ +[-+][0-9]" "$OUT/model-profile-llama.txt" | head -30 ;;
  *)
    echo "usage: EXP=<checkout of 120bb23> bash benchmarks/gpu_round24.sh last | bash benchmarks/gpu_round24.sh rest" >&2; exit 2 ;;
esac
