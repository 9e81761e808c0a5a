#!/usr/bin/env bash
# H200 runs of round 25 (results/h200-v25-*, NOTES v25), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round25.sh d192     # the transposed Gluon dK/dV at head_dim 192: the GPU tests that
#                                           # reach it, then the backward against Flex and cuDNN (fp16 + bf16,
#                                           # 4096 keys, full + causal, with --metrics; bf16 at 1024 and 16384),
#                                           # and the portable backward it replaces (FLASHRUN_HOPPER_BWD=0)
#   bash benchmarks/gpu_round25.sh out      # dK and dV stored by the producer's TMA stores: the GPU backward
#                                           # tests, then the backward against Flex and cuDNN at 1024 keys (fp16 +
#                                           # bf16) and 4096 (bf16), D 64/128, full + causal
#   bash benchmarks/gpu_round25.sh rest     # the rest of the default sweep after `out` (it ran as two device calls:
#                                           # 2048/16384 and 8192 keys, then 4096 fp16)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

bwd() { python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 "$@"; }

case "${1:-}" in
  d192)
    gpu_tests gpu-tests-d192 220 "192 or backward_plans"
    grep -E "FAILED|Error" "$OUT/gpu-tests-d192.log" | head -20
    timeout 170 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 4096 --head-dims 192 --causal both \
      --metrics --out '$OUT/bwd-d192'" > "$OUT/bwd-d192.txt" 2>&1
    echo "bench rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-d192.txt" | head -24
    timeout 100 bash -c "$(declare -f bwd); bwd --dtype bf16 --seq-lens 1024,16384 --head-dims 192 --causal both \
      --out '$OUT/bwd-d192-ends'" > "$OUT/bwd-d192-ends.txt" 2>&1
    echo "bench rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-d192-ends.txt" | head -24
    FLASHRUN_HOPPER_BWD=0 timeout 60 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
      --dtype bf16 --seq-lens 4096 --head-dims 192 --causal both --out "$OUT/bwd-d192-portable" \
      > "$OUT/bwd-d192-portable.txt" 2>&1
    echo "portable bench rc $?"; grep -E "^(B[0-9]|flash |sdpa-cudnn )" "$OUT/bwd-d192-portable.txt" ;;
  out)
    gpu_tests gpu-tests-out 210 \
      "flash_on_gpu or deterministic_on_gpu or windows_on_the_gluon or backward_plans or lays_gradients or heads_do_not_leak or bitwise"
    grep -E "FAILED|Error" "$OUT/gpu-tests-out.log" | head -20
    timeout 170 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 1024 --head-dims 64,128 --causal both \
      --out '$OUT/bwd-out-n1024'" > "$OUT/bwd-out-n1024.txt" 2>&1
    echo "bench rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-out-n1024.txt" | head -40
    timeout 110 bash -c "$(declare -f bwd); bwd --dtype bf16 --seq-lens 4096 --head-dims 64,128 --causal both \
      --out '$OUT/bwd-out-n4096'" > "$OUT/bwd-out-n4096.txt" 2>&1
    echo "bench rc $?"; grep -E "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT/bwd-out-n4096.txt" | head -24 ;;
  rest)
    timeout 170 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 2048,16384 --head-dims 64,128 --causal both \
      --out '$OUT/bwd-out-rest1'" > "$OUT/bwd-out-rest1.txt" 2>&1
    echo "bench rc $?"
    timeout 130 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 8192 --head-dims 64,128 --causal both \
      --out '$OUT/bwd-out-rest2'" > "$OUT/bwd-out-rest2.txt" 2>&1
    echo "bench rc $?"
    timeout 100 bash -c "$(declare -f bwd); bwd --dtype fp16 --seq-lens 4096 --head-dims 64,128 --causal both \
      --out '$OUT/bwd-out-rest3'" > "$OUT/bwd-out-rest3.txt" 2>&1
    echo "bench rc $?"; grep -hE "^(B[0-9]|flash |flex |sdpa-cudnn )" "$OUT"/bwd-out-rest*.txt ;;
  *)
    echo "usage: bash benchmarks/gpu_round25.sh d192|out|rest" >&2; exit 2 ;;
esac
