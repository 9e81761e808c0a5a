#!/usr/bin/env bash
# H200 runs of round 13 (results/h200-v13-*, NOTES v13), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout of c003d97> for the A/B:
#   OLD=... bash benchmarks/gpu_round13.sh check   # the GPU tests of windows, variants and the Gluon backward;
#                                                  # gluon_bwd_probe.py's correctness cases (windows among them)
#   OLD=... bash benchmarks/gpu_round13.sh var     # the backward variant set against FlexAttention (this
#                                                  # checkout), then softcap fwd/bwd and the 16k window, OLD and this
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120
bwd() { python3 -m flashrun bench -k flash --set bench.rep_ms=30 --dtype bf16 --head-dims 128 --causal yes "$@"; }
case "${1:-}" in
  check)
    timeout 330 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "window or variants or deterministic or flash_on_gpu" > "$OUT/gpu-tests.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests.log"
    OUT="$OUT" timeout 240 python3 benchmarks/gluon_bwd_probe.py --no-timing --kernels d64,d128,d64+dq,d128-dqs+dq \
      > /dev/null 2>&1
    echo "probe rc $?"; grep -c "^PASS" "$OUT/gluon_bwd_probe.log"; grep "^FAIL\|correctness:" "$OUT/gluon_bwd_probe.log" ;;
  var)
    # the variant set as in round 10 (window 4096 x softcap 30 x ALiBi at 4k and 16k keys), with Flex
    timeout 330 python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 --dtype bf16 \
      --seq-lens 4096,16384 --head-dims 128 --causal yes --set 'bench.window=[[-1,-1],[4096,0]]' \
      --set 'bench.softcap=[0.0,30.0]' --set 'bench.alibi=[false,true]' --out "$OUT/var" > "$OUT/var.txt" 2>&1
    echo "variant set rc $?"
    # the A/B: flash alone, OLD then this checkout, softcap forward and backward, the 16k window backward
    for tree in ${OLD:-} "$PWD"; do
      (cd "$tree" && bwd --mode fwd,bwd --seq-lens 4096,16384 --set 'bench.softcap=[30.0]' --out "$OUT/ab-$(basename "$tree")" \
        && bwd --mode bwd --seq-lens 16384 --set 'bench.window=[[4096,0]]' --out "$OUT/ab-$(basename "$tree")") \
        > "$OUT/ab-$(basename "$tree").txt" 2>&1
      echo "A/B $(basename "$tree") rc $?"
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round13.sh check|var" >&2; exit 2 ;;
esac
