#!/usr/bin/env bash
# H200 runs of round 15 (results/h200-v15-*, NOTES v15), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout of 2897f74> for the A/B:
#   bash benchmarks/gpu_round15.sh split        # the GPU tests of the backward (the split's parts adding
#                                               # into one float32 head); the 1b models' attention backward
#                                               # with every GQA split, adds and partials, GPU time per kernel
#                                               # (gqa_bwd_split.py); 64x32 causal tiles at issue 22's short
#                                               # shapes (short_forward_probe.py --cells tiles)
#   OLD=... bash benchmarks/gpu_round15.sh model # llama and qwen2 at 1b, OLD and this in turns, speed only
#   bash benchmarks/gpu_round15.sh checks       # every family's checks at 1b (batch 1, as model_h200.sh);
#                                               # mistral's and gemma2's speed (their backward's split changed too)
#   bash benchmarks/gpu_round15.sh more         # llama and qwen2 at 1b, two more samples of this; where the
#                                               # train step's GPU time goes (model_profile.py)
#   OLD=... bash benchmarks/gpu_round15.sh host # (OLD: a checkout of 280bc35) the backward's GPU tests; the
#                                               # host's time per attention call inside the 1b models, OLD
#                                               # and this in turns (model_host.py)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120
case "${1:-}" in
  split)
    timeout 240 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "backward or deterministic or gluon or variants_on_gpu or flash_on_gpu or leak or windows" \
      > "$OUT/gpu-tests-bwd.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests-bwd.log"
    OUT="$OUT" timeout 200 python3 benchmarks/gqa_bwd_split.py > "$OUT/gqa-bwd-split.txt" 2>&1
    echo "split rc $?"; grep -E '^(llama|qwen2) ' "$OUT/gqa-bwd-split.txt" | cut -c1-1500
    OUT="$OUT/tiles" timeout 120 python3 benchmarks/short_forward_probe.py --cells tiles > "$OUT/tiles-probe.txt" 2>&1
    echo "tiles probe rc $?"; grep -E '^(compiled|\{)' "$OUT/tiles-probe.txt" | cut -c1-400 ;;
  model)
    for i in 1 2; do
      for tree in "$OLD" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo this || echo old)
        (cd "$tree" && model_speed "$name-$i")  # python -m puts the tree's flashrun first
      done
    done ;;
  checks)
    mkdir -p "$OUT/model"
    for arch in llama mistral qwen2 gemma2; do
      start=$(date +%s)
      timeout 150 python3 -m flashrun model --size 1b --arch "$arch" --batch 1 --no-speed --json \
        --set "logging.log_dir='$OUT/model'" --set "model.out='$OUT/model'" \
        > "$OUT/model/$arch-checks.json" 2> "$OUT/model/$arch-checks.log"
      echo "$arch checks: exit $? in $(( $(date +%s) - start )) s"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(' ', r['verdict']); [print('  ', 'pass' if c['passed'] else 'FAIL', c['name'], c['summary'][:140]) for c in r['checks']]" "$OUT/model/$arch-checks.json"
    done
    for arch in mistral gemma2; do
      baselines="['sdpa']"; [ "$arch" = gemma2 ] && baselines="['eager']"
      timeout 120 python3 -m flashrun model --size 1b --arch "$arch" --batch 4 --set "model.checks=[]" \
        --set "model.baselines=$baselines" --set model.reps=6 --set "logging.log_dir='$OUT/model'" \
        --set "model.out='$OUT/model'" > "$OUT/model/$arch-speed.txt" 2>&1
      echo "$arch speed rc $?"; grep -A5 "speed, batch" "$OUT/model/$arch-speed.txt"
    done ;;
  more)
    model_speed this-3
    model_speed this-4
    timeout 240 python3 benchmarks/model_profile.py --arch qwen2,llama --out "$OUT/profile" > "$OUT/model-profile.txt" 2>&1
    echo "profile rc $?"; grep -v "^    \(prefi\|train \)" "$OUT/model-profile.txt" | tail -30; grep "^    " "$OUT/model-profile.txt" | head -60 ;;
  host)
    timeout 120 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "deterministic or backward_plans or flash_on_gpu" > "$OUT/gpu-tests-host.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests-host.log"
    cp benchmarks/model_host.py "$OLD/benchmarks/"
    for run in old-1 this-1; do
      tree=$([ "${run%-*}" = this ] && echo "$PWD" || echo "$OLD")
      (cd "$tree" && timeout 90 python3 benchmarks/model_host.py --out "$OUT/host" --label "-$run") \
        > "$OUT/host-$run.txt" 2>&1
      echo "model host $run rc $?"; grep -E "^(qwen2|llama) " "$OUT/host-$run.txt"
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round15.sh split|model|checks|more|host" >&2; exit 2 ;;
esac
