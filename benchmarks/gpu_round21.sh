#!/usr/bin/env bash
# H200 runs of round 21 (results/h200-v21-*, NOTES v21), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round21.sh decode   # decode_probe.py's grid with and without programmatic
#                                           # dependent launches, the KV cache paged at 16/64/256 keys,
#                                           # its config sweep (contiguous and paged); the GPU tests of
#                                           # decode and the KV cache
#   bash benchmarks/gpu_round21.sh grid     # decode_probe.py's grid (no sweep), then the decode grid through
#                                           # flashrun bench: GQA 32/8 and MQA, B 1-16 x 4k-128k keys, fp16/bf16,
#                                           # causal and not, flash_attention and the KV cache (contiguous, page 16)
#   bash benchmarks/gpu_round21.sh mqa      # two MQA decode cells of `grid` with --metrics (GPU against wall
#                                           # time per call, the kernels launched)
#   bash benchmarks/gpu_round21.sh fwd      # issue 22's forward shapes against cuDNN: N 512 and 1024
#                                           # (D 64/128, fp16/bf16, full/causal), D 192 and 256 at 4k keys
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  decode)
    gpu_tests gpu-tests-decode 200 "kvcache or decode or decoding"
    OUT="$OUT/decode" timeout 330 python3 benchmarks/decode_probe.py --budget-s 150 > "$OUT/decode.txt" 2>&1
    echo "decode probe rc $?"; grep -E '^(ok|FAIL)|config' "$OUT/decode.txt" | cut -c1-200
    sed -n '/^shape /,$p' "$OUT/decode.txt" ;;
  grid)
    OUT="$OUT/decode" timeout 150 python3 benchmarks/decode_probe.py --no-sweep --budget-s 100 > "$OUT/decode.txt" 2>&1
    echo "decode probe rc $?"; sed -n '/^shape /,$p' "$OUT/decode.txt"
    for kv in 8 1; do
      timeout 190 python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --mode fwd --seq-lens 1 \
        --seq-lens-k 4096,16384,65536,131072 --head-dims 128 --causal both --dtype bf16,fp16 --set bench.hidden=4096 \
        --set bench.num_kv_heads=$kv --set bench.tokens=65536 --set "bench.page_size=[0,16]" --set bench.rep_ms=25 \
        --out "$OUT/bench-decode-kv$kv" > "$OUT/bench-decode-kv$kv.txt" 2>&1
      echo "bench decode kv heads $kv rc $?"
    done ;;
  mqa)
    timeout 150 python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --mode fwd --seq-lens 1 \
      --seq-lens-k 4096,65536 --head-dims 128 --causal no --dtype bf16 --set bench.hidden=4096 \
      --set bench.num_kv_heads=1 --set bench.tokens=65536 --set bench.rep_ms=25 --metrics -v \
      --out "$OUT/bench-mqa-metrics" > "$OUT/bench-mqa-metrics.txt" 2>&1
    echo "bench mqa metrics rc $?"; grep -v "^INFO" "$OUT/bench-mqa-metrics.txt" | head -80 ;;
  fwd)
    timeout 240 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 512,1024 --head-dims 64,128 --causal both --out "$OUT/short" > "$OUT/short.txt" 2>&1
    echo "short rc $?"
    timeout 200 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype bf16,fp16 \
      --seq-lens 4096 --head-dims 192,256 --causal both --out "$OUT/d192" > "$OUT/d192.txt" 2>&1
    echo "d192 rc $?" ;;
  *)
    echo "usage: $0 decode|grid|mqa|fwd" >&2
    exit 2 ;;
esac
