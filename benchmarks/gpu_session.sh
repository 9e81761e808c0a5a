#!/usr/bin/env bash
# The GPU work behind benchmarks/results/, in steps that each fit a 10-minute call on an H200.
# From the repo root (results under $OUT, or ./gpu-session):
#   bash benchmarks/gpu_session.sh suite       # tests/test_gpu.py (~6 min with 14 workers)
#   bash benchmarks/gpu_session.sh providers   # every provider once, head_dim 256, decode (~3 min)
#   bash benchmarks/gpu_session.sh sweep       # the recorded default sweep, fwd+bwd, fp16+bf16 (~5 min)
#   bash benchmarks/gpu_session.sh bwd         # backward only: flash (atomic dQ) vs flash-deterministic vs cuDNN
# Run them back to back on one machine: the suite leaves Triton's kernel cache warm for the rest.
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README);
# the suite's -n needs pytest-xdist.
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=200
bench() { python3 -m flashrun bench "$@"; }
case "${1:-}" in
  suite)
    TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -v -n 14 -p no:cacheprovider -rfE 2>&1 \
      | grep --line-buffered -vE "Benchmark|^$" | tee "$OUT/gpu_tests.log" | tail -5 ;;
  providers)
    bench -k flash -p sdpa,sdpa-flash,sdpa-cudnn,sdpa-efficient,sdpa-math,torch-naive,flex,flash-attn \
      --mode fwd --mode bwd --seq-lens 1024 --head-dims 64 --out "$OUT/every-provider"
    bench -k flash -p flex,sdpa-math --mode fwd --mode bwd --seq-lens 1024,32768 --head-dims 64 --causal no \
      --set bench.tokens=65536 --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/flex-bwd-and-oom"
    bench -k flash -p sdpa-flash,sdpa-cudnn --baseline sdpa-flash --head-dims 256 --dtype float16,bfloat16 \
      --out "$OUT/d256"
    bench -k flash -p sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn --seq-lens 1 --seq-lens-k 4096,8192,16384 \
      --head-dims 128 --causal no --dtype float16,bfloat16 --out "$OUT/decode" ;;
  sweep)
    FLASHRUN_CACHE_DIR="$OUT/tune" bench -k flash -p sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn \
      --mode fwd --mode bwd --dtype float16,bfloat16 --set bench.rep_ms=60 --set bench.warmup_ms=15 \
      --out "$OUT/results" --plot "$OUT/results/h200-default-sweep.png" ;;
  bwd)
    FLASHRUN_CACHE_DIR="$OUT/tune" bench -k flash -p flash-deterministic,sdpa-cudnn --baseline sdpa-cudnn \
      --mode bwd --dtype float16,bfloat16 --set bench.rep_ms=60 --set bench.warmup_ms=15 \
      --out "$OUT/bwd" --plot "$OUT/bwd/h200-bwd.png" ;;
  *) echo "usage: bash benchmarks/gpu_session.sh suite|providers|sweep|bwd" >&2; exit 2 ;;
esac
