#!/usr/bin/env bash
# H200 runs of round 17 (results/h200-v17-*, NOTES v17), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout> for the A/Bs:
#   bash benchmarks/gpu_round17.sh host          # one forward's and one forward + backward's host time piece
#                                                # by piece, with cProfiles and the backward's GPU time
#                                                # (fwd_host.py); the host per attention call inside qwen2-1b
#                                                # with a cProfile of flash's phases (model_host.py --cprofile 3)
#   OLD=... bash benchmarks/gpu_round17.sh ab    # the GPU tests of both directions' paths, plans and launches;
#                                                # fwd_host.py OLD and this in turns, twice
#   OLD=... bash benchmarks/gpu_round17.sh models # the C launches' GPU test; llama and qwen2 at 1b against SDPA,
#                                                # OLD and this in turns, two samples; model_host.py (qwen2)
#   OLD=... bash benchmarks/gpu_round17.sh final # qwen2's GPU time, kernel by kernel, and its idle split, OLD and
#                                                # this (model_profile.py --trace); decode_probe.py --quick, OLD and this
#   bash benchmarks/gpu_round17.sh traces        # qwen2's kernels, flash against SDPA (model_profile.py: where their
#                                                # GPU time differs), and its prefill traces, gzipped, to read offline
#   bash benchmarks/gpu_round17.sh order         # the turn order's bias in flashrun model's timing (turn_order.py)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  host)
    timeout 150 python3 benchmarks/fwd_host.py --out "$OUT/host" > "$OUT/fwd-host.txt" 2>&1
    echo "fwd host rc $?"; head -16 "$OUT/fwd-host.txt"; grep -A12 "^GPU time per call" "$OUT/fwd-host.txt"
    timeout 240 python3 benchmarks/model_host.py --arch qwen2 --cprofile 3 --out "$OUT/host" \
      > "$OUT/model-host.txt" 2>&1
    echo "model host rc $?"; grep -E "^(qwen2|llama) " "$OUT/model-host.txt" ;;
  ab)
    gpu_tests gpu-tests-ab 330 "routes or plans or c_launches or lays or flash_on_gpu or gluon or backward or deterministic or decode or kvcache or variants_on_gpu or windows or varlen or heads"
    fwd_host old-1 this-1 old-2 this-2 ;;
  models)
    gpu_tests gpu-tests-c-launches 90 "c_launches"
    for i in 1 2; do
      for run in "old-$i" "this-$i"; do
        (cd "$(tree_of "$run")" && model_speed "$run")  # python -m puts the tree's flashrun first
      done
    done
    timeout 100 python3 benchmarks/model_host.py --arch qwen2 --out "$OUT/host" --label=-this-1 \
      > "$OUT/model-host-this-1.txt" 2>&1  # (OLD's: the host call's)
    echo "model host rc $?"; grep -E "^(qwen2|llama) " "$OUT/model-host-this-1.txt" ;;
  final)
    cp benchmarks/model_profile.py "$OLD/benchmarks/"
    for run in old-1 this-1; do
      (cd "$(tree_of "$run")" && timeout 120 python3 benchmarks/model_profile.py --arch qwen2 --out "$OUT/profile" \
        --label="$run-" --trace "/tmp/traces-$run") > "$OUT/model-profile-$run.txt" 2>&1
      echo "profile $run rc $?"; grep -E "idle:|^$run" "$OUT/model-profile-$run.txt"
    done
    for run in old-1 this-1; do
      d="$OUT/decode-$run"; mkdir -p "$d"
      OUT="$d" timeout 100 python3 "$(tree_of "$run")/benchmarks/decode_probe.py" --quick --budget-s 80 > "$d/log" 2>&1
      echo "decode $run rc $?"; tail -12 "$d/log"
    done ;;
  traces)
    timeout 200 python3 benchmarks/model_profile.py --arch qwen2 --out "$OUT/profile" --label=diff- \
      --trace /tmp/traces > "$OUT/model-profile-diff.txt" 2>&1
    echo "profile rc $?"; grep -E "idle:|^diff|largest" "$OUT/model-profile-diff.txt"
    for f in /tmp/traces/*prefill.json; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
    ls -la "$OUT" ;;
  order)
    for run in qwen2-1 llama-1; do
      timeout 120 python3 benchmarks/turn_order.py --arch "${run%-*}" --out "$OUT/order" --label="-${run#*-}" \
        > "$OUT/turn-order-$run.txt" 2>&1
      echo "turn order $run rc $?"; grep -E "^(prefill|train) " "$OUT/turn-order-$run.txt"
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round17.sh host|ab|models|final|traces|order" >&2; exit 2 ;;
esac
