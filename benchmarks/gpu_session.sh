#!/usr/bin/env bash
# What is still to run on a GPU, in one go (about 8-9 minutes on an H200). From the repo root:
#   bash benchmarks/gpu_session.sh            # results under $OUT (or ./gpu-session)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 COLUMNS=200
# 1. the GPU correctness suite on the current kernels (also fills Triton's cache for step 2)
TRITON_INTERPRET=0 timeout 300 python3 -m pytest tests/test_gpu.py -q -n 12 -p no:cacheprovider 2>&1 \
  | grep -v Benchmark | tee "$OUT/gpu_tests.log" | tail -5
# 2. every provider once, forward and backward (flex, sdpa-efficient, sdpa-math, torch-naive, flash-attn)
timeout 120 python3 -m flashrun bench -k flash -p sdpa,sdpa-flash,sdpa-cudnn,sdpa-efficient,sdpa-math,torch-naive,flex,flash-attn \
  --mode fwd --mode bwd --seq-lens 1024 --head-dims 64 --out "$OUT/smoke" 2>&1 | tail -25
# 3. issue 7's remaining shapes: head_dim 256 forward, and decode-like (Nq = 1) against long keys
timeout 150 python3 -m flashrun bench -k flash -p sdpa-flash,sdpa-cudnn --baseline sdpa-flash --head-dims 256 \
  --dtype float16,bfloat16 --out "$OUT/d256" 2>&1 | tail -30
timeout 60 python3 -m flashrun bench -k flash -p sdpa-flash,sdpa-cudnn --baseline sdpa-cudnn --seq-lens 1 \
  --seq-lens-k 4096,8192,16384 --head-dims 128 --causal no --dtype float16,bfloat16 --out "$OUT/decode" 2>&1 | tail -20
