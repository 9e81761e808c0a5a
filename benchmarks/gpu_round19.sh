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
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

checks() {  # every family's six checks at 1b, batch 1 (64 greedy tokens in float32 among them)
  mkdir -p "$OUT/model"
  for arch in llama mistral qwen2 gemma2; do
    start=$(date +%s)
    timeout 110 python3 -m flashrun model --size 1b --arch "$arch" --batch 1 --no-speed --json \
      --set "logging.log_dir='$OUT/model'" --set "model.out='$OUT/model'" \
      > "$OUT/model/$arch-checks.json" 2> "$OUT/model/$arch-checks.log"
    echo "$arch checks: exit $? in $(( $(date +%s) - start )) s"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(' ', r['verdict']); [print('  ', 'pass' if c['passed'] else 'FAIL', c['name'], c['summary'][:140]) for c in r['checks']]" "$OUT/model/$arch-checks.json"
  done
}

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
  checks)
    gpu_tests gpu-tests-forward 200 "gluon or either_order or plans or routes or c_launches or flash_on_gpu"
    checks ;;
  *)
    echo "usage: bash benchmarks/gpu_round19.sh checks|split|bench" >&2; exit 2 ;;
esac
