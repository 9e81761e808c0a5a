#!/usr/bin/env bash
# H200 runs of round 27 (results/h200-v27-*, NOTES v27), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   OLD=<a checkout of 987d792> bash benchmarks/gpu_round27.sh d192
#       # the Gluon forward's O by TMA at head_dim 192 (hopper_jit._store_through): its GPU tests, then the
#       # forward at head_dim 192 and 256 against cuDNN (N 1024/4096/8192, fp16 + bf16, causal and not) in this
#       # checkout and $OLD in turns, twice
#   OLD=<a checkout of 987d792> bash benchmarks/gpu_round27.sh decode
#       # decode's host path (the plan kept with the checked call): the GPU tests of decode and the KV cache, then
#       # the decode grid through flashrun bench against cuDNN, MQA in this checkout and $OLD in turns, twice, and
#       # GQA 32/8 once each
#   OLD=<a checkout of 987d792> bash benchmarks/gpu_round27.sh long
#       # "nothing else slower": the forward at 4k-16k keys, head_dim 64 and 128, bf16, causal and not, in this
#       # checkout and $OLD in turns; then qwen2-1b against SDPA, speed (model_speed), then its six checks
#   OLD=<a checkout of 987d792> bash benchmarks/gpu_round27.sh final
#       # decode_probe.py --quick in this checkout and $OLD (back-to-back host time per call, graph replay), then the
#       # decode grid once more in this checkout (MQA twice, GQA 32/8 once): the committed decode results
#   bash benchmarks/gpu_round27.sh gate192
#       # short_forward_probe.py --cells d192: both Gluon 192 kernels at every mask, 1024-8192 keys, against cuDNN
#   bash benchmarks/gpu_round27.sh confirm
#       # after head_dim 192 causal moved to the persistent kernel (whose GPU tests ran in d192): the 192 forward
#       # against cuDNN twice (the committed head_dim 192 results; bench checks every cell), then the short forwards (N 512/1024,
#       # head_dim 64/128) once: the one-block kernels' normalization moved into their TMA store
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

summary() {  # flash / cuDNN over a bench JSON's cells: median, min, cells below 0.85
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))["rows"]
ms = {}
for r in rows:
    if r.get("ms"):
        cell = tuple(str(r.get(k)) for k in ("dtype", "causal", "batch", "seq_len_k", "page_size", "cache_seqlens"))
        ms.setdefault(cell, {})[r["provider"]] = r["ms"]
ratios = sorted(c["sdpa-cudnn"] / c["flash"] for c in ms.values() if "flash" in c and "sdpa-cudnn" in c)
if ratios:
    print(f"  flash/cuDNN over {len(ratios)} cells: median {statistics.median(ratios):.3f}, min {ratios[0]:.3f}, "
          f"below 0.85: {sum(r < 0.85 for r in ratios)}")
PY
}

case "${1:-}" in
  d192)
    gpu_tests gpu-tests-d192 170 "gluon_kernels or gluon_forward or forward_routes"
    grep -E "FAILED|Error" "$OUT/gpu-tests-d192.log" | head -20
    for run in this-1 old-1 this-2 old-2; do
      fwd_bench "$run" fwd-d192 95 --dtype bf16,fp16 --seq-lens 1024,4096,8192 --head-dims 192,256 --causal both
    done ;;
  decode)
    gpu_tests gpu-tests-decode 120 "decode or kvcache or forward_routes or c_launches"
    grep -E "FAILED|Error" "$OUT/gpu-tests-decode.log" | head -20
    for run in this-1 old-1 this-2 old-2; do
      (cd "$(tree_of "$run")" && OUT=$OUT decode_grid 1 bench-decode-mqa-$run 100)
      summary "$(ls "$OUT/bench-decode-mqa-$run"/*.json)"
    done
    for run in this-1 old-1; do
      (cd "$(tree_of "$run")" && OUT=$OUT decode_grid 8 bench-decode-gqa-$run 100)
      summary "$(ls "$OUT/bench-decode-gqa-$run"/*.json)"
    done ;;
  long)
    for run in this-1 old-1; do
      fwd_bench "$run" fwd-long 110 --dtype bf16 --seq-lens 4096,8192,16384 --head-dims 64,128 --causal both
    done
    model_speed v27 qwen2
    checks qwen2 ;;
  final)
    cp benchmarks/decode_probe.py "$OLD/benchmarks/"
    for run in this-1 old-1; do
      (cd "$(tree_of "$run")" && OUT="$OUT/decode-probe-$run" timeout 100 python3 benchmarks/decode_probe.py --quick \
        --budget-s 60) > "$OUT/decode-probe-$run.txt" 2>&1
      echo "decode probe $run rc $?"; sed -n '/^shape /,$p' "$OUT/decode-probe-$run.txt" | head -12
    done
    for grid in mqa-final-1:1 gqa-final-1:8 mqa-final-2:1; do
      decode_grid "${grid#*:}" "bench-decode-${grid%:*}" 100
      summary "$(ls "$OUT/bench-decode-${grid%:*}"/*.json)"
    done ;;
  gate192)
    OUT="$OUT/probe-d192" timeout 300 python3 benchmarks/short_forward_probe.py --cells d192 > "$OUT/probe-d192.txt" 2>&1
    echo "probe d192 rc $?"; tail -17 "$OUT/probe-d192.txt" | cut -c1-250 ;;
  confirm)
    for run in this-3 this-4; do
      fwd_bench "$run" fwd-d192 95 --dtype bf16,fp16 --seq-lens 1024,2048,4096,8192 --head-dims 192 --causal both
    done
    fwd_bench this-1 fwd-short 95 --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal both ;;
  *)
    echo "usage: OLD=<checkout> bash benchmarks/gpu_round27.sh d192|decode|long|final|gate192|confirm" >&2
    exit 2 ;;
esac
