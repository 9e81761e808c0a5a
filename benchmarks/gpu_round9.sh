#!/usr/bin/env bash
# The H200 runs that round 8's CPU-side work waits for (NOTES v8), each step within one 10-minute
# device call; from the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round9.sh gluon    # the Gluon dK/dV backward (issue 21): the GPU suite, then
#                                          # gluon_bwd_probe.py (checked, then timed against the
#                                          # portable backward and cuDNN)
#   bash benchmarks/gpu_round9.sh models   # flashrun model, every family at 1b (model_h200.sh), with
#                                          # round 8's sync fix and GQA split (issue 20)
#   bash benchmarks/gpu_round9.sh profile  # Proton's child pass (issue 23: one .hatchet per ok cell?),
#                                          # model_profile.py with FLASHRUN_HOPPER_BWD=1 if set, and
#                                          # the shipped table's backward entries (tune_table.py)
#   bash benchmarks/gpu_round9.sh decode   # decode_probe.py over issue 22's grid, and its config sweep
#                                          # with the smallest split (MIN_CHUNK_BLOCKS) varied: MQA at
#                                          # B1 x 16k keys gets 64 splits for 132 SMs today
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 COLUMNS=160
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
    timeout 120 python3 -m flashrun bench -k flash -p sdpa-cudnn --seq-lens 1024 --dtype bf16 --mode fwd,bwd \
      --set bench.rep_ms=25 --metrics --profile "$OUT/prof" > "$OUT/proton-bench.txt" 2>&1
    echo "bench --profile rc $?"; grep -i "proton" "$OUT/proton-bench.txt"; ls "$OUT/prof" | grep -c hatchet
    (cd "$OUT" && tar -czf prof.tar.gz prof && rm -rf prof)
    timeout 150 python3 benchmarks/model_profile.py --out "$OUT" --label "${FLASHRUN_HOPPER_BWD:+gluon-}" 2>&1 \
      | grep -v -i warn | grep -E "^[a-z-]*(llama|qwen2) |configs|_attn"
    timeout 280 python3 benchmarks/tune_table.py --keep-forward > "$OUT/tune_table.log" 2>&1
    echo "tune_table rc $?"; tail -3 "$OUT/tune_table.log"
    cp flashrun/kernels/tuned/*.json "$OUT/" ;;
  decode)
    OUT="$OUT" timeout 560 python3 benchmarks/decode_probe.py > "$OUT/decode_probe.log" 2>&1
    echo "decode_probe rc $?"; grep -E "config|shape|ratio|median|min" "$OUT/decode_probe.log" | cut -c1-160 | tail -60 ;;
  *) echo "usage: $0 gluon|models|profile|decode" >&2; exit 2 ;;
esac
