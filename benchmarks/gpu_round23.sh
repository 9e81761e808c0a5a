#!/usr/bin/env bash
# H200 runs of round 23 (results/h200-v23-*, NOTES v23), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round23.sh pdl      # the decode grid through flashrun bench with programmatic dependent
#                                           # launches on and off (FLASHRUN_PDL=0) in turns: MQA twice each, GQA
#                                           # once each; decode_probe.py --quick (PDL on and off in one process)
#   bash benchmarks/gpu_round23.sh half     # the Gluon forward's GPU tests; short_forward_probe.py --cells causal
#                                           # twice (every Gluon kernel). Ran at c9448dd, whose half-width diagonal
#                                           # kernels were reverted (8725f98)
#   bash benchmarks/gpu_round23.sh checks   # every family's six checks at 1b on this code
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  pdl)
    for run in 1 2; do
      decode_grid 1 bench-decode-mqa-pdl-$run 120
      FLASHRUN_PDL=0 decode_grid 1 bench-decode-mqa-nopdl-$run 120
    done
    decode_grid 8 bench-decode-gqa-pdl 120
    FLASHRUN_PDL=0 decode_grid 8 bench-decode-gqa-nopdl 120
    OUT="$OUT/decode" timeout 90 python3 benchmarks/decode_probe.py --quick --budget-s 60 > "$OUT/decode.txt" 2>&1
    echo "decode probe rc $?"; sed -n '/^shape /,$p' "$OUT/decode.txt" | head -12 ;;
  half)
    gpu_tests gpu-tests-gluon 240 "gluon"
    for run in 1 2; do
      OUT="$OUT/causal-$run" timeout 150 python3 benchmarks/short_forward_probe.py --cells causal \
        > "$OUT/causal-$run.txt" 2>&1
      echo "causal probe $run rc $?"; grep -v "^{" "$OUT/causal-$run.txt" | tail -3
    done ;;
  checks)
    checks ;;
  *)
    echo "usage: $0 pdl | half | checks" >&2
    exit 2 ;;
esac
