#!/usr/bin/env bash
# H200 runs of round 19 (results/h200-v19-*, NOTES v19), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round19.sh checks   # the GPU tests of the Gluon forward (its tile order a constexpr
#                                           # since 26c6cca), both tile orders, plans and routes; every
#                                           # family's checks at 1b (batch 1)
#   bash benchmarks/gpu_round19.sh split    # the Gluon backward at head_dim 96 and 80 (two column blocks):
#                                           # gluon_bwd_probe.py (checked against float64, then timed against
#                                           # the portable backward and cuDNN); the GPU tests of the backward
#   bash benchmarks/gpu_round19.sh bench    # flashrun bench, the backward at head_dim 96 and 192 against Flex
#                                           # and cuDNN (round 10's command)
#   bash benchmarks/gpu_round19.sh sweep    # flashrun bench, the backward over the default sweep (fp16 + bf16,
#                                           # D 64/128, N 1024-16384, full + causal) against Flex and cuDNN
#   bash benchmarks/gpu_round19.sh shapes   # the backward at GQA 32/8, the variant set and packed sequences
#                                           # against Flex (and cuDNN where it runs them)
#   OLD=<a checkout of 5175b4a, round 10> bash benchmarks/gpu_round19.sh full   # the D128 full backward,
#                                           # round 10's code and this in turns, against cuDNN (the sweep put it
#                                           # 3-6 % further behind cuDNN than round 10's)
# Round 19's decode experiment (the splits merged in-kernel) ran as `bash benchmarks/gpu_round19.sh decode`
# at e239598, which holds that mode; it was reverted (5cc4575, NOTES v19).
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

bwd() { python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 "$@"; }

case "${1:-}" in
  split)
    OUT="$OUT/probe" timeout 330 python3 benchmarks/gluon_bwd_probe.py --kernels d96,d96-dqs+dq,d80,d80-dqs+dq \
      --only D96,D80 --budget-s 280 --breakdown 1 > /dev/null 2>&1
    echo "gluon_bwd_probe rc $?"; grep -E "^FAIL|correctness:|TFLOP/s|^  D|^D" "$OUT/probe/gluon_bwd_probe.log" | cut -c1-220
    gpu_tests gpu-tests-backward 200 "flash_on_gpu or deterministic_on_gpu or windows_on_the_gluon or backward_plans" ;;
  bench)
    bwd --dtype bf16 --seq-lens 4096 --head-dims 96,192 --causal both --out "$OUT/odd" > "$OUT/bwd-odd.txt" 2>&1
    echo "bench rc $?"; grep -E "^(B|flash|flex|sdpa-cudnn) " "$OUT/bwd-odd.txt" ;;
  sweep)
    timeout 420 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 1024,2048,4096,8192,16384 \
      --head-dims 64,128 --causal both --out '$OUT/sweep'" > "$OUT/bwd-sweep.txt" 2>&1
    echo "bench rc $?"; tail -12 "$OUT/bwd-sweep.txt" ;;
  shapes)
    bwd --dtype bf16 --seq-lens 2048,8192 --head-dims 128 --causal yes --set bench.hidden=4096 \
      --set bench.num_kv_heads=8 --out "$OUT/gqa" > "$OUT/bwd-gqa.txt" 2>&1
    echo "gqa rc $?"
    timeout 330 python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 --dtype bf16 \
      --seq-lens 4096,16384 --head-dims 128 --causal yes --set 'bench.window=[[-1,-1],[4096,0]]' \
      --set 'bench.softcap=[0.0,30.0]' --set 'bench.alibi=[false,true]' --out "$OUT/var" > "$OUT/bwd-var.txt" 2>&1
    echo "variant set rc $?"
    timeout 150 python3 -m flashrun bench -k flash -p flex --mode bwd --set bench.rep_ms=30 --dtype bf16 --seq-lens 4096 \
      --head-dims 128 --causal yes --set 'bench.varlen=[[4096,1024,3072,2048,2048,1024,2048,1024]]' \
      --out "$OUT/packed" > "$OUT/bwd-packed.txt" 2>&1
    echo "packed rc $?" ;;
  full)
    for run in old-1 this-1 old-2 this-2; do
      (cd "$(tree_of "$run")" && python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
        --dtype bf16 --seq-lens 4096,8192 --head-dims 128 --causal no \
        --out "$OUT/full-$run") > "$OUT/bwd-full-$run.txt" 2>&1
      echo "full $run rc $?"; grep -E "^(B|flash|sdpa-cudnn) " "$OUT/bwd-full-$run.txt"
    done ;;
  checks)
    gpu_tests gpu-tests-forward 200 "gluon or either_order or plans or routes or c_launches or flash_on_gpu"
    checks ;;
  *)
    echo "usage: bash benchmarks/gpu_round19.sh checks|split|bench|sweep|shapes|full" >&2; exit 2 ;;
esac
