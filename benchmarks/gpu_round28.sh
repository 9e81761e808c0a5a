#!/usr/bin/env bash
# H200 runs of round 28 (results/h200-v28-*, NOTES v28), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round28.sh qregs
#       # Q as QKᵀ's register operand at head_dim 192 ("d192-qregs", "d192-qregs-persistent"): the GPU tests of
#       # every 192 kernel, then short_forward_probe.py --cells d192 (all four 192 kernels, shipped and cuDNN in turns;
#       # the -qregs kernels were then folded into "d192" and "d192-persistent": today two kernels are timed)
#   bash benchmarks/gpu_round28.sh confirm
#       # after both 192 kernels took Q in registers: the Gluon forward's GPU tests (every kernel, the -qregs ones at
#       # 64 and 128 too), short_forward_probe.py --cells lengths (64 and 128, 1k-16k keys: every Gluon kernel, the
#       # -qregs ones among them: since folded into d64-persistent or dropped), then the 192 forward against cuDNN twice
#       # (with both of Q's column blocks in registers also where causal: h200-v28-fwd-d192-confirm-*)
#   OLD=<a checkout of 3fb0cc0> bash benchmarks/gpu_round28.sh final
#       # the shipped kernels (192 with Q's second block in registers where causal, the softmax's masked step): the
#       # Gluon forward's GPU tests, the 192 forward against cuDNN twice (the committed head_dim 192 results), the
#       # short forwards (N 512/1024, head_dim 64/128) in this checkout and $OLD in turns
#   OLD=<a checkout of 3fb0cc0> bash benchmarks/gpu_round28.sh long
#       # "nothing else slower": the forward at 2k and 16k keys, head_dim 64 and 128, bf16 and fp16, causal and not, in
#       # this checkout and $OLD in turns
#   bash benchmarks/gpu_round28.sh model
#       # qwen2-1b (its prefill on d128-persistent, whose masked softmax step changed) and llama-1b against SDPA:
#       # speed, then qwen2's six checks
#   bash benchmarks/gpu_round28.sh causal
#       # short_forward_probe.py --cells causal: causal 512-4096 keys at head_dim 64 and 128 (every Gluon kernel,
#       # d64-persistent now with Q in registers, against the shipped path and cuDNN), where the gate might move
#   OLD=<a checkout of 3fb0cc0> bash benchmarks/gpu_round28.sh gate64
#       # after head_dim 64 causal moved to d64-persistent from 1024 keys with 8192 tiles and from 2048 with 2048:
#       # the Gluon forward's route tests, the short forwards in this checkout and $OLD in turns, then llama-1b
#       # (its prefill now on d64-persistent) against SDPA and its six checks
#   bash benchmarks/gpu_round28.sh short
#       # the short forwards (N 512/1024, head_dim 64/128) twice more in this checkout (the committed short results)
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120

case "${1:-}" in
  qregs)
    gpu_tests gpu-tests-qregs 150 "gluon_kernels and d192"
    grep -E "FAILED|Error" "$OUT/gpu-tests-qregs.log" | head -20
    OUT="$OUT/probe-d192" timeout 400 python3 benchmarks/short_forward_probe.py --cells d192 > "$OUT/probe-d192.txt" 2>&1
    echo "probe d192 rc $?"; tail -17 "$OUT/probe-d192.txt" | cut -c1-250 ;;
  confirm)
    gpu_tests gpu-tests-confirm 170 "gluon_kernels or gluon_forward or forward_routes"
    grep -E "FAILED|Error" "$OUT/gpu-tests-confirm.log" | head -20
    OUT="$OUT/probe-lengths" timeout 200 python3 benchmarks/short_forward_probe.py --cells lengths \
      > "$OUT/probe-lengths.txt" 2>&1
    echo "probe lengths rc $?"
    for run in this-1 this-2; do
      fwd_bench "$run" fwd-d192 95 --dtype bf16,fp16 --seq-lens 1024,2048,4096,8192 --head-dims 192 --causal both
    done ;;
  final)
    gpu_tests gpu-tests-final 170 "gluon_kernels or gluon_forward or forward_routes"
    grep -E "FAILED|Error" "$OUT/gpu-tests-final.log" | head -20
    for run in this-3 this-4; do
      fwd_bench "$run" fwd-d192 95 --dtype bf16,fp16 --seq-lens 1024,2048,4096,8192 --head-dims 192 --causal both
    done
    for run in this-1 old-1; do
      fwd_bench "$run" fwd-short 95 --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal both
    done ;;
  long)
    for run in this-1 old-1 this-2 old-2; do
      fwd_bench "$run" fwd-long 120 --dtype bf16,fp16 --seq-lens 2048,16384 --head-dims 64,128 --causal both
    done ;;
  model)
    model_speed v28 "qwen2 llama"
    checks qwen2 ;;
  causal)
    OUT="$OUT/probe-causal" timeout 400 python3 benchmarks/short_forward_probe.py --cells causal \
      > "$OUT/probe-causal.txt" 2>&1
    echo "probe causal rc $?"; tail -18 "$OUT/probe-causal.txt" | cut -c1-200 ;;
  gate64)
    gpu_tests gpu-tests-gate64 120 "gluon_forward or forward_routes"
    for run in this-2 old-2; do
      fwd_bench "$run" fwd-short 95 --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal both
    done
    model_speed v28-gate64 llama
    checks llama ;;
  short)
    for run in this-3 this-4; do
      fwd_bench "$run" fwd-short 95 --dtype fp16,bf16 --seq-lens 512,1024 --head-dims 64,128 --causal both
    done ;;
  *)
    echo "usage: [OLD=<checkout>] bash benchmarks/gpu_round28.sh qregs|confirm|final|long|model|causal|gate64|short" >&2
    exit 2 ;;
esac
