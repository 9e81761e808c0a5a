#!/usr/bin/env bash
# H200 runs of round 27 (results/h200-v27-*, NOTES v27), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   OLD=<a checkout of 987d792> bash benchmarks/gpu_round27.sh d192
#       # the Gluon forward's O by TMA at head_dim 192 (hopper_jit._store_through): its GPU tests, then the
#       # forward at head_dim 192 and 256 against cuDNN (N 1024/4096/8192, fp16 + bf16, causal and not) in this
#       # checkout and $OLD in turns, twice
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

fwd_bench() {  # $1: run label (this-N / old-N), $2: name, $3: seconds, then flashrun bench's shape options
  local run=$1 name=$2 limit=$3
  shift 3
  (cd "$(tree_of "$run")" && timeout "$limit" python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn \
    --mode fwd --set bench.rep_ms=25 "$@" --out "$OUT/$name-$run") > "$OUT/$name-$run.txt" 2>&1
  echo "$name $run rc $?"; grep -E "^(B[0-9]|flash )" "$OUT/$name-$run.txt" | paste - - | tr -s " " | cut -c1-110
}

case "${1:-}" in
  d192)
    gpu_tests gpu-tests-d192 170 "gluon_kernels or gluon_forward or forward_routes"
    grep -E "FAILED|Error" "$OUT/gpu-tests-d192.log" | head -20
    for run in this-1 old-1 this-2 old-2; do
      fwd_bench "$run" fwd-d192 95 --dtype bf16,fp16 --seq-lens 1024,4096,8192 --head-dims 192,256 --causal both
    done ;;
  *)
    echo "usage: OLD=<checkout> bash benchmarks/gpu_round27.sh d192" >&2
    exit 2 ;;
esac
