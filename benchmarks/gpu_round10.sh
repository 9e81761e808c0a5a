#!/usr/bin/env bash
# H200 runs of round 10 (results/h200-v10-*, NOTES v10), each step within one 10-minute device
# call; from the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round10.sh fused     # gluon_bwd_probe.py: the Gluon backward with dQ inside
#                                            # (both ways of sharing dQ) and without, checked against
#                                            # float64, then timed against the portable one and cuDNN;
#                                            # then model_profile.py with flash-atomic and flash
#   bash benchmarks/gpu_round10.sh sweep     # the GPU suite, then the backward against Flex and cuDNN
#                                            # on the default sweep (the README's command)
#   bash benchmarks/gpu_round10.sh shapes    # the backward on GQA 32/8, head_dim 96/192 and the
#                                            # variant set, against Flex and cuDNN
#   bash benchmarks/gpu_round10.sh models    # flashrun model: llama and qwen2 at 1b (checks, speed)
#   bash benchmarks/gpu_round10.sh prefill   # prefill_forward_ab.py: the models' forward shapes
# Round 11: benchmarks/gpu_round11.sh. Still waiting for a session (issue 22): `bash benchmarks/gpu_round9.sh decode`.
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160
bwd() { python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --set bench.rep_ms=30 "$@"; }
case "${1:-}" in
  fused)
    OUT="$OUT" timeout 300 python3 benchmarks/gluon_bwd_probe.py --kernels d128-dqs+dq,d64-dqs+dq,d64+dq,d128,d64 \
      --budget-s 260 --breakdown 4 > /dev/null 2>&1
    echo "gluon_bwd_probe rc $?"; grep -E "^FAIL|correctness:|TFLOP/s" "$OUT/gluon_bwd_probe.log" | cut -c1-200
    for kernel in flash-atomic flash; do
      timeout 140 python3 benchmarks/model_profile.py --arch llama,qwen2 --kernel $kernel --out "$OUT" \
        --label=-$kernel 2>&1 | grep -E "^-[a-z-]*(llama|qwen2) " | cut -c1-200
    done ;;
  sweep)
    timeout 230 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 \
      > "$OUT/gpu-suite.log" 2>&1
    echo "GPU suite rc $?"; tail -2 "$OUT/gpu-suite.log" | cut -c1-200
    timeout 360 bash -c "$(declare -f bwd); bwd --dtype fp16,bf16 --seq-lens 1024,2048,4096,8192,16384 \
      --head-dims 64,128 --causal both --out '$OUT/bwd'" > "$OUT/bwd-bench.txt" 2>&1
    echo "bench rc $?" ;;
  shapes)
    bwd --dtype bf16 --seq-lens 2048,8192 --head-dims 128 --causal yes --set bench.hidden=4096 \
      --set bench.num_kv_heads=8 --out "$OUT/gqa" > "$OUT/gqa.txt" 2>&1
    bwd --dtype bf16 --seq-lens 4096 --head-dims 96,192 --causal both --out "$OUT/odd" > "$OUT/odd.txt" 2>&1
    bwd --dtype bf16 --seq-lens 4096,16384 --head-dims 128 --causal yes --set 'bench.window=[[-1,-1],[4096,0]]' \
      --set 'bench.softcap=[0.0,30.0]' --set 'bench.alibi=[false,true]' --out "$OUT/var" > "$OUT/var.txt" 2>&1
    echo "shapes done" ;;
  models)
    for arch in llama qwen2; do
      python3 -m flashrun model --size 1b --arch $arch --batch 1 --no-speed --json > "$OUT/$arch-checks.json"
      python3 -m flashrun model --size 1b --arch $arch --batch 4 --set "model.checks=[]" \
        --set "model.baselines=['sdpa']" --set model.reps=6 --plot "$OUT/$arch-speed.png" > "$OUT/$arch-speed.txt"
    done ;;
  prefill)
    OUT="$OUT" timeout 100 python3 benchmarks/prefill_forward_ab.py ;;
  *)
    echo "usage: bash benchmarks/gpu_round10.sh fused|sweep|shapes|models|prefill" >&2; exit 2 ;;
esac
