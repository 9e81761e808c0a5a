#!/usr/bin/env bash
# H200 runs of round 22 (results/h200-v22-*, NOTES v22), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round22.sh decode   # the GPU tests of decode and the KV cache; decode_probe.py's grid
#                                           # (no sweep); the decode grid through flashrun bench (GQA 32/8 and
#                                           # MQA, B 1-16 x 4k-128k keys, fp16/bf16, causal and not, flash_attention
#                                           # and the KV cache contiguous and at page 16); two MQA cells with --metrics
#   OLD=<a checkout of the last commit> bash benchmarks/gpu_round22.sh causal   # the Gluon forward's GPU tests;
#                                           # short_forward_probe.py --cells causal in $OLD and this checkout, twice
#                                           # in turns (the persistent kernels' causal tile order)
#   bash benchmarks/gpu_round22.sh final    # flashrun bench at issue 22's short forward shapes (N 512 and 1024,
#                                           # D 64/128, full/causal, fp16/bf16) and causal at 2048/4096 keys against
#                                           # cuDNN; qwen2-1b's speed against SDPA (flashrun model); the MQA decode
#                                           # grid through flashrun bench again (run-to-run noise)
#   bash benchmarks/gpu_round22.sh host     # after the host-path change: the decode GPU tests, decode_probe.py
#                                           # --quick (its wall column: calls back to back) and the MQA grid again
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  decode)
    gpu_tests gpu-tests-decode 200 "kvcache or decode or decoding"
    OUT="$OUT/decode" timeout 150 python3 benchmarks/decode_probe.py --no-sweep --budget-s 100 > "$OUT/decode.txt" 2>&1
    echo "decode probe rc $?"; sed -n '/^shape /,$p' "$OUT/decode.txt"
    decode_grid 8 bench-decode-kv8 190
    decode_grid 1 bench-decode-kv1 190
    timeout 150 python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --mode fwd --seq-lens 1 \
      --seq-lens-k 4096,65536 --head-dims 128 --causal no --dtype bf16 --set bench.hidden=4096 \
      --set bench.num_kv_heads=1 --set bench.tokens=65536 --set bench.rep_ms=25 --metrics \
      --out "$OUT/bench-mqa-metrics" > "$OUT/bench-mqa-metrics.txt" 2>&1
    echo "bench mqa metrics rc $?"; sed -n '/roof/,$p' "$OUT/bench-mqa-metrics.txt" | head -30 ;;
  causal)
    gpu_tests gpu-tests-gluon 240 "gluon"
    cp benchmarks/short_forward_probe.py "$OLD/benchmarks/"
    for run in old-1 this-1 old-2 this-2; do
      (cd "$(tree_of "$run")" && OUT="$OUT/causal-$run" timeout 150 python3 benchmarks/short_forward_probe.py \
        --cells causal) > "$OUT/causal-$run.txt" 2>&1
      echo "causal probe $run rc $?"; grep -v "^{" "$OUT/causal-$run.txt" | tail -3
    done ;;
  final)
    timeout 200 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 512,1024 --head-dims 64,128 --causal both --out "$OUT/short" > "$OUT/short.txt" 2>&1
    echo "short rc $?"
    timeout 150 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 2048,4096 --head-dims 64,128 --causal yes --out "$OUT/causal" > "$OUT/causal.txt" 2>&1
    echo "causal rc $?"
    model_speed final qwen2
    decode_grid 1 bench-decode-kv1 120 ;;
  host)
    gpu_tests gpu-tests-decode-host 120 "kvcache or decode or decoding"
    OUT="$OUT/decode" timeout 90 python3 benchmarks/decode_probe.py --quick --budget-s 60 > "$OUT/decode.txt" 2>&1
    echo "decode probe rc $?"; sed -n '/^shape /,$p' "$OUT/decode.txt" | head -8
    decode_grid 1 bench-decode-kv1 120 ;;
  *)
    echo "usage: $0 decode | final | host | OLD=<checkout> $0 causal" >&2
    exit 2 ;;
esac
