#!/usr/bin/env bash
# The H200 runs behind issue 13's v5 results (one H200; results under $OUT):
#   bash benchmarks/gpu_round5.sh probe1   # the TMA reduce-add backward and the short-sequence tiles
set -u
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200
bench() { python3 -m flashrun bench --set bench.rep_ms=30 --set bench.warmup_ms=10 "$@"; }
case "${1:-}" in
  probe1)
    bench -k flash-atomic -p flash-deterministic,sdpa-cudnn --baseline sdpa-cudnn --mode bwd --dtype bfloat16 \
      --seq-lens 1024,4096,16384 --out "$OUT/bwd" 2>&1 | tail -40
    bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --mode fwd --dtype float16,bfloat16 --seq-lens 512,1024 \
      --out "$OUT/short" 2>&1 | tail -40
    timeout 200 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -n 15 -p no:cacheprovider -rfE \
      -k "leak or flash_on_gpu or (tunable and bwd_fused)" > "$OUT/suite.log" 2>&1
    tail -15 "$OUT/suite.log" ;;
  *) echo "usage: bash benchmarks/gpu_round5.sh probe1" >&2; exit 2 ;;
esac
