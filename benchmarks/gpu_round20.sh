#!/usr/bin/env bash
# H200 runs of round 20 (results/h200-v20-*, NOTES v20), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round20.sh persist  # the persistent Gluon backward (one program per SM looping over
#                                           # key blocks) against the one-tile kernels: gluon_bwd_probe.py
#                                           # (each checked against float64 on 3 programs, then timed with
#                                           # the portable backward and cuDNN at N 1024-8192)
#   bash benchmarks/gpu_round20.sh persist2 # the one-tile and persistent kernels at shapes whose Q and dO
#                                           # fit in L2 or not (gluon_bwd_probe.py --shape), and qwen2's and
#                                           # llama's speed at 1b with the twin on and off in turns
#   bash benchmarks/gpu_round20.sh sweep    # flashrun bench, the backward over the default sweep (fp16 + bf16,
#                                           # D 64/128, N 1024-16384, full + causal) against Flex and cuDNN;
#                                           # the GPU tests of the backward
#   OLD=<a checkout of 5175b4a, round 10> bash benchmarks/gpu_round20.sh full   # the D128 full backward,
#                                           # round 10's code and this in turns, against cuDNN
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

bwd() { python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 "$@"; }

case "${1:-}" in
  persist)
    OUT="$OUT/probe" timeout 520 python3 benchmarks/gluon_bwd_probe.py \
      --kernels d64+dq,d64-p+dq,d128-dqs+dq,d128-dqs-p+dq,d128,d128-p,d96-dqs+dq,d96-dqs-p+dq \
      --only N1024,N2048,N8192,D96 --budget-s 470 --breakdown 2 > /dev/null 2>&1
    echo "gluon_bwd_probe rc $?"; grep -E "^FAIL|correctness:|TFLOP/s|^  D|^D" "$OUT/probe/gluon_bwd_probe.log" | cut -c1-220 ;;
  persist2)
    OUT="$OUT/probe2" timeout 200 python3 benchmarks/gluon_bwd_probe.py --no-checks --breakdown 0 \
      --kernels d64+dq,d64-p+dq,d128-dqs+dq,d128-dqs-p+dq --budget-s 170 \
      --shape 128,causal,2048,4,12,2 --shape 128,causal,2048,8,12,2 --shape 64,causal,2048,4,32,8 \
      --shape 64,causal,2048,2,32,8 --shape 128,causal,1024,4,16,16 --shape 128,causal,2048,2,16,16 \
      --shape 128,causal,4096,1,16,16 --shape 128,full,2048,2,16,16 --shape 64,causal,2048,4,16,16 \
      --shape 128,causal,1024,8,16,16 --shape 128,causal,2048,4,16,16 --shape 64,full,2048,4,16,16 \
      > /dev/null 2>&1
    echo "gluon_bwd_probe rc $?"; grep -E "TFLOP/s" "$OUT/probe2/gluon_bwd_probe.log" | cut -c1-200
    for run in 1; do  # the models' speed, the persistent twin on and off in turns
      FLASHRUN_HOPPER_BWD_PERSISTENT=1 model_speed "persistent-$run" "qwen2 llama"
      FLASHRUN_HOPPER_BWD_PERSISTENT=0 model_speed "one-tile-$run" "qwen2 llama"
    done ;;
  sweep)
    timeout 420 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 1024,2048,4096,8192,16384 \
      --head-dims 64,128 --causal both --out '$OUT/sweep'" > "$OUT/bwd-sweep.txt" 2>&1
    echo "bench rc $?"; tail -12 "$OUT/bwd-sweep.txt"
    gpu_tests gpu-tests-backward 150 "flash_on_gpu or deterministic_on_gpu or windows_on_the_gluon or backward_plans" ;;
  full)
    for run in old-1 this-1 old-2 this-2; do
      (cd "$(tree_of "$run")" && python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
        --dtype bf16 --seq-lens 4096,8192 --head-dims 128 --causal no \
        --out "$OUT/full-$run") > "$OUT/bwd-full-$run.txt" 2>&1
      echo "full $run rc $?"; grep -E "^(B|flash|sdpa-cudnn) " "$OUT/bwd-full-$run.txt"
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round20.sh persist|persist2|sweep|full" >&2; exit 2 ;;
esac
