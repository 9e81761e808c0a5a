#!/usr/bin/env bash
# H200 runs of round 16 (results/h200-v16-*, NOTES v16), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout> for the A/Bs:
#   bash benchmarks/gpu_round16.sh host          # one flash forward's host time piece by piece (fwd_host.py);
#                                                # the host per attention call inside qwen2-1b with a cProfile
#                                                # of flash's phases (model_host.py --cprofile 3)
#   OLD=... bash benchmarks/gpu_round16.sh ab    # the GPU tests of the forward's paths; fwd_host.py and
#                                                # model_host.py (qwen2), OLD and this in turns
#   OLD=... bash benchmarks/gpu_round16.sh prefill # qwen2 at 1b against SDPA, OLD and this in turns, two samples;
#                                                # then where qwen2's GPU idles, host late or GPU side
#                                                # (model_profile.py --trace: the traces stay on the device)
#   OLD=... bash benchmarks/gpu_round16.sh ab2   # the GPU tests of both directions' paths and plans;
#                                                # fwd_host.py OLD and this; llama and qwen2 at 1b, OLD and this
#   OLD=... bash benchmarks/gpu_round16.sh final # fwd_host.py and qwen2's GPU idle split, OLD and this
#                                                # (model_profile.py --trace); qwen2 at 1b, one more sample of OLD and this;
#                                                # the variants' GPU tests (the portable forward's routes)
#   OLD=... bash benchmarks/gpu_round16.sh decode # decode_probe.py --quick, OLD and this in turns, twice
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  host)
    timeout 120 python3 benchmarks/fwd_host.py --out "$OUT/host" > "$OUT/fwd-host.txt" 2>&1
    echo "fwd host rc $?"; head -16 "$OUT/fwd-host.txt"
    timeout 240 python3 benchmarks/model_host.py --arch qwen2 --cprofile 3 --out "$OUT/host" \
      > "$OUT/model-host.txt" 2>&1
    echo "model host rc $?"; grep -E "^(qwen2|llama) " "$OUT/model-host.txt" ;;
  ab)
    gpu_tests gpu-tests-ab 200 "routes or plans or flash_on_gpu or gluon_kernels or decode or kvcache or variants_on_gpu"
    fwd_host old-1 this-1 old-2 this-2
    cp benchmarks/model_host.py "$OLD/benchmarks/"
    for run in old-1 this-1; do
      (cd "$(tree_of "$run")" && timeout 100 python3 benchmarks/model_host.py --arch qwen2 --out "$OUT/host" \
        --label="-$run") \
        > "$OUT/model-host-$run.txt" 2>&1
      echo "model host $run rc $?"; grep -E "^(qwen2|llama) " "$OUT/model-host-$run.txt"
    done ;;
  prefill)
    for i in 1 2; do
      for tree in "$OLD" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo this || echo old)
        (cd "$tree" && model_speed "$name-$i" qwen2)  # python -m puts the tree's flashrun first
      done
    done
    timeout 200 python3 benchmarks/model_profile.py --arch qwen2 --out "$OUT/profile" --trace /tmp/traces \
      > "$OUT/model-profile.txt" 2>&1
    echo "profile rc $?"; grep -v "^    \(prefi\|train \)" "$OUT/model-profile.txt" | tail -40 ;;
  ab2)
    gpu_tests gpu-tests-ab2 240 "routes or plans or flash_on_gpu or gluon_kernels or decode or kvcache or backward or deterministic"
    fwd_host old-3 this-3
    for tree in "$OLD" "$PWD"; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo old)
      (cd "$tree" && model_speed "$name-3")
    done ;;
  final)
    fwd_host old-4 this-4
    cp benchmarks/model_profile.py "$OLD/benchmarks/"
    for tree in "$OLD" "$PWD"; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo old)
      (cd "$tree" && timeout 120 python3 benchmarks/model_profile.py --arch qwen2 --out "$OUT/profile" \
        --label="$name-" --trace "/tmp/traces-$name") > "$OUT/model-profile-$name.txt" 2>&1
      echo "profile $name rc $?"; grep -E "idle|^$name" "$OUT/model-profile-$name.txt"
    done
    for tree in "$OLD" "$PWD"; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo old)
      (cd "$tree" && model_speed "$name-4" qwen2)
    done
    gpu_tests gpu-tests-variants 150 "variants_on_gpu or windows" ;;
  decode)
    for run in old-1 this-1 old-2 this-2; do
      d="$OUT/decode-$run"; mkdir -p "$d"
      OUT="$d" timeout 100 python3 "$(tree_of "$run")/benchmarks/decode_probe.py" --quick --budget-s 80 > "$d/log" 2>&1
      echo "decode $run rc $?"; tail -12 "$d/log"
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round16.sh host|ab|prefill|ab2|final|decode" >&2; exit 2 ;;
esac
