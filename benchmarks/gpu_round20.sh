#!/usr/bin/env bash
# H200 runs of round 20 (results/h200-v20-*, NOTES v20), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   OLD=<a checkout of 5175b4a, round 10> bash benchmarks/gpu_round20.sh full   # the D128 full backward,
#                                           # round 10's code and this in turns, against cuDNN
#   TREES=<a folder of checkouts> bash benchmarks/gpu_round20.sh bisect   # the same at each checkout, in turns
#   OLD=<a checkout of the last commit> bash benchmarks/gpu_round20.sh host   # decode_probe.py's grid and
#                                           # fwd_host.py, that checkout and this in turns; GPU tests of flash
#   OLD=<a checkout of the last commit> bash benchmarks/gpu_round20.sh host2  # fwd_host.py, three more pairs
#   TREES=<a folder of checkouts> bash benchmarks/gpu_round20.sh bisect2  # benchmarks/ab_old_new.py's backward
#                                           # calls with each checkout's flashrun (one harness), in turns
# Round 20's persistent backward ran as `bash benchmarks/gpu_round20.sh persist` (gluon_bwd_probe.py:
# the persistent kernels checked against float64 on 3 programs, then timed with the one-tile ones,
# the portable backward and cuDNN at N 1024-8192) and `persist2` (shapes whose Q and dO fit in L2 or
# not, and qwen2/llama 1b with the twin on and off) at 136bedb, which holds those modes; it was
# reverted (NOTES v20).
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  full)
    for run in old-1 this-1 old-2 this-2 old-3 this-3; do
      (cd "$(tree_of "$run")" && python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
        --dtype bf16 --seq-lens 4096,8192 --head-dims 128 --causal no \
        --out "$OUT/full-$run") > "$OUT/bwd-full-$run.txt" 2>&1
      echo "full $run rc $?"; grep -E "^(B|flash|sdpa-cudnn) " "$OUT/bwd-full-$run.txt"
    done ;;
  bisect)  # the D128 full backward at the checkouts under $TREES (one per commit), two rounds in turns
    for run in 1 2; do
      for tree in $TREES/*; do
        label="$(basename "$tree")-$run"
        (cd "$tree" && timeout 100 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode bwd --set bench.rep_ms=30 \
          --dtype bf16 --seq-lens 4096,8192 --head-dims 128 --causal no \
          --out "$OUT/bisect-$label") > "$OUT/bwd-bisect-$label.txt" 2>&1
        echo "$label rc $? $(grep -E '^(flash|sdpa-cudnn) ' "$OUT/bwd-bisect-$label.txt" | awk '{print $1, $4}' | tr '\n' ' ')"
      done
    done ;;
  bisect2)  # the same flash backward calls (benchmarks/ab_old_new.py) with each checkout's flashrun, in turns
    for run in 1 2 3; do
      for tree in $TREES/*; do
        label="$(basename "$tree")-$run"
        PYTHONPATH="$tree:$PYTHONPATH" timeout 60 python3 benchmarks/ab_old_new.py "$label" --only bwd --profile \
          > "$OUT/ab-$label.json" 2> "$OUT/ab-$label.txt"
        echo "$label rc $?"; grep -E "do_bench|^     " "$OUT/ab-$label.txt" | cut -c1-240
      done
    done ;;
  host)  # decode_probe.py's grid (host-bound rows: B1) and fwd_host.py, the last commit ($OLD) and this in turns
    cp benchmarks/decode_probe.py "$OLD/benchmarks/"
    for run in old-1 this-1 old-2 this-2; do
      (cd "$(tree_of "$run")" && OUT="$OUT/decode-$run" timeout 100 python3 benchmarks/decode_probe.py --no-sweep \
        --budget-s 80) > "$OUT/decode-$run.txt" 2>&1
      echo "decode probe $run rc $?"; grep -E '"(min|median|max)"|failed|B1 H32' "$OUT/decode-$run.txt" | head -12
    done
    fwd_host old-1 this-1
    gpu_tests gpu-tests-flash 120 "flash_on_gpu or kvcache" ;;
  host2)  # fwd_host.py, the last commit ($OLD) and this in turns, three pairs
    fwd_host old-2 this-2 old-3 this-3 old-4 this-4 ;;
  *)
    echo "usage: OLD=<checkout> bash benchmarks/gpu_round20.sh full|host|host2 | TREES=<folder> bash benchmarks/gpu_round20.sh bisect|bisect2" >&2; exit 2 ;;
esac
