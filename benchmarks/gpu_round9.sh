#!/usr/bin/env bash
# H200 runs, each step within one 10-minute device call; from the repo root, results under $OUT
# (or ./gpu-session). Round 9 ran `gluon`, `models` and the Proton check (results/h200-v9-*,
# NOTES v9); `decode` ran in round 12 (results/h200-v12-decode-probe.*) (`profile`'s idle measure ran in round 10, gpu_round10.sh fused):
#   bash benchmarks/gpu_round9.sh gluon    # the GPU suite, then gluon_bwd_probe.py (the Gluon dK/dV
#                                          # checked, then timed against the portable one and cuDNN)
#   bash benchmarks/gpu_round9.sh models   # flashrun model, every family at 1b (model_h200.sh)
#   bash benchmarks/gpu_round9.sh profile  # model_profile.py on llama and qwen2 with the GPU's idle
#                                          # time between kernels and Chrome traces (issue 20: is the
#                                          # train step's last 0.2-1.5 % the host's?), then the
#                                          # backward against Flex and cuDNN on the default sweep
#   BUDGET_S=400 bash benchmarks/gpu_round9.sh decode   # decode_probe.py over issue 22's grid, and its config sweep
#                                          # with the smallest split (MIN_CHUNK_BLOCKS) varied: MQA at
#                                          # B1 x 16k keys gets 64 splits for 132 SMs today
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160
case "${1:-}" in
  gluon)
    timeout 160 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 8 -rfE \
      > "$OUT/gpu-suite.log" 2>&1
    echo "GPU suite rc $?"; tail -4 "$OUT/gpu-suite.log" | cut -c1-200
    OUT="$OUT" timeout 400 python3 benchmarks/gluon_bwd_probe.py --budget-s 320 > /dev/null 2>&1
    echo "gluon_bwd_probe rc $?"; grep -E "FAIL|PASS|TFLOP|ratio" "$OUT/gluon_bwd_probe.log" | cut -c1-160 | tail -60 ;;
  models)
    bash benchmarks/model_h200.sh ;;
  profile)
    timeout 150 python3 benchmarks/model_profile.py --arch llama,qwen2 --out "$OUT" --trace "$OUT/trace" 2>&1 \
      | grep -v -i warn | grep -E "^[a-z-]*(llama|qwen2) |_attn|_fa3|idle"
    (cd "$OUT" && tar -czf trace.tar.gz trace && rm -rf trace)
    timeout 400 python3 -m flashrun bench -k flash -p flex,sdpa-cudnn --mode bwd --dtype fp16,bf16 \
      --set bench.rep_ms=25 --out "$OUT/bwd" > "$OUT/bwd-sweep.txt" 2>&1
    echo "bwd sweep rc $?"; (cd "$OUT" && tar -czf bwd.tar.gz bwd && rm -rf bwd) ;;
  decode)
    OUT="$OUT" timeout 560 python3 benchmarks/decode_probe.py --budget-s "${BUDGET_S:-170}" > "$OUT/decode_probe.log" 2>&1
    echo "decode_probe rc $?"; grep -E "config|shape|ratio|median|min" "$OUT/decode_probe.log" | cut -c1-160 | tail -60 ;;
  *) echo "usage: $0 gluon|models|profile|decode" >&2; exit 2 ;;
esac
