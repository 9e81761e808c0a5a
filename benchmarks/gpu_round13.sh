#!/usr/bin/env bash
# H200 runs of round 13 (results/h200-v13-*, NOTES v13), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout of c003d97> for the A/B:
#   OLD=... bash benchmarks/gpu_round13.sh check   # the GPU tests of windows, variants and the Gluon backward;
#                                                  # gluon_bwd_probe.py's correctness cases (windows among them)
#   OLD=... bash benchmarks/gpu_round13.sh var     # the backward variant set and packed sequences against
#                                                  # FlexAttention (this checkout), then softcap fwd/bwd and the
#                                                  # 16k window, OLD and this
#   bash benchmarks/gpu_round13.sh fwd             # issue 22's forward shapes (N 512/1024, head_dim 192/256)
#                                                  # against cuDNN; Nsight Compute on llama-1b's forward
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
    # packed sequences (8 documents, 16k tokens) beside the dense causal cell
    timeout 150 python3 -m flashrun bench -k flash -p flex --mode bwd --set bench.rep_ms=30 --dtype bf16 --seq-lens 4096 \
      --head-dims 128 --causal yes --set 'bench.varlen=[[4096,1024,3072,2048,2048,1024,2048,1024]]' \
      --out "$OUT/packed" > "$OUT/packed.txt" 2>&1
    echo "packed rc $?"
    # the A/B: flash alone, OLD then this checkout, softcap forward and backward, the 16k window backward
    for tree in ${OLD:-} "$PWD"; do
      (cd "$tree" && bwd --mode fwd,bwd --seq-lens 4096,16384 --set 'bench.softcap=[30.0]' --out "$OUT/ab-$(basename "$tree")" \
        && bwd --mode bwd --seq-lens 16384 --set 'bench.window=[[4096,0]]' --out "$OUT/ab-$(basename "$tree")") \
        > "$OUT/ab-$(basename "$tree").txt" 2>&1
      echo "A/B $(basename "$tree") rc $?"
    done ;;
  fwd)
    timeout 200 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 512,1024 --head-dims 64,128 --causal both --out "$OUT/short" > "$OUT/short.txt" 2>&1
    echo "short rc $?"
    timeout 150 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype bf16 \
      --seq-lens 4096 --head-dims 192,256 --causal both --out "$OUT/d192" > "$OUT/d192.txt" 2>&1
    echo "d192 rc $?"
    timeout 200 ncu --clock-control none -k 'regex:_attn_fwd|fprop' --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/ncu_llama_fwd.py > "$OUT/ncu-llama-fwd.txt" 2>&1
    echo "ncu rc $?" ;;
  *)
    echo "usage: bash benchmarks/gpu_round13.sh check|var|fwd" >&2; exit 2 ;;
esac
