#!/usr/bin/env bash
# H200 runs of round 14 (results/h200-v14-*, NOTES v14), each within one 10-minute device call; from
# the repo root, results under $OUT (or ./gpu-session). OLD=<a checkout of 8592312> for the A/B:
#   OLD=... bash benchmarks/gpu_round14.sh probe   # the epilogue's reciprocal: the 1b models' prefill
#                                                  # attention, OLD and this in turns (two processes each);
#                                                  # every launch at issue 22's short shapes against cuDNN
#                                                  # (short_forward_probe.py); llama and qwen2 at 1b, speed
#                                                  # with the implementations interleaved
#   bash benchmarks/gpu_round14.sh short           # the gate and table changes where the sweep did not look
#                                                  # (short_forward_probe.py --cells gate); issue 22's short
#                                                  # forward shapes through flashrun bench; the GPU tests of
#                                                  # the forward, decode and the Gluon paths
#   bash benchmarks/gpu_round14.sh split           # the 1b models' attention backward with the GQA split
#                                                  # forced to each divisor, against cuDNN (gqa_bwd_split.py);
#                                                  # llama and qwen2 at 1b again (a second sample)
#   OLD=... bash benchmarks/gpu_round14.sh plan    # the Gluon backward's plans: the GPU tests of the backward;
#                                                  # back-to-back backward calls, OLD and this in turns
#                                                  # (bwd_host.py); gqa_bwd_split.py again
#   OLD=... bash benchmarks/gpu_round14.sh enqueue # the Gluon dK/dV launcher's host time, OLD and this
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=120
case "${1:-}" in
  probe)
    cp benchmarks/short_forward_probe.py "$OLD/benchmarks/"
    for i in 1 2; do
      for tree in "$OLD" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo this || echo old)
        (cd "$tree" && OUT="$OUT/prefill-$name-$i" timeout 90 python3 benchmarks/short_forward_probe.py --cells prefill) \
          > "$OUT/prefill-$name-$i.txt" 2>&1
        echo "prefill $name $i rc $?"; grep '^{' "$OUT/prefill-$name-$i.txt" | cut -c1-230
      done
    done
    OUT="$OUT" timeout 240 python3 benchmarks/short_forward_probe.py > "$OUT/short-probe.txt" 2>&1
    echo "short probe rc $?"; grep -E '^(compiled|\{)' "$OUT/short-probe.txt" | cut -c1-230
    model_speed 1 ;;
  short)
    OUT="$OUT" timeout 150 python3 benchmarks/short_forward_probe.py --cells gate > "$OUT/gate-probe.txt" 2>&1
    echo "gate probe rc $?"; grep -E '^(compiled|\{)' "$OUT/gate-probe.txt" | cut -c1-260
    timeout 200 python3 -m flashrun bench -k flash -p sdpa-cudnn --mode fwd --set bench.rep_ms=25 --dtype fp16,bf16 \
      --seq-lens 512,1024 --head-dims 64,128 --causal both --out "$OUT/short" > "$OUT/short.txt" 2>&1
    echo "short rc $?"
    # every test of a kernel whose epilogue changed (the portable forward, decode and its combine, the
    # Gluon forward) and of every config the tuner may pick
    timeout 330 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "flash_on_gpu or leak or every_tunable_config_is_correct or variants_on_gpu or decoding or varlen \
          or gluon_kernels or gluon_forward or kvcache or decode_replays" > "$OUT/gpu-tests.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests.log" ;;
  split)
    OUT="$OUT" timeout 300 python3 benchmarks/gqa_bwd_split.py > "$OUT/gqa-bwd-split.txt" 2>&1
    echo "split rc $?"; grep -E '^(llama|qwen2) ' "$OUT/gqa-bwd-split.txt" | cut -c1-900
    model_speed 2 ;;
  plan)
    timeout 200 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE \
      -k "backward_plans or deterministic or windows or variants_on_gpu or flash_on_gpu or leak" > "$OUT/gpu-tests-bwd.log" 2>&1
    echo "GPU tests rc $?"; tail -1 "$OUT/gpu-tests-bwd.log"
    cp benchmarks/bwd_host.py benchmarks/gqa_bwd_split.py "$OLD/benchmarks/"
    for run in old-1 this-1 old-2 this-2; do
      tree=$([ "${run%-*}" = this ] && echo "$PWD" || echo "$OLD")
      (cd "$tree" && OUT="$OUT/host-$run" timeout 80 python3 benchmarks/bwd_host.py) > "$OUT/host-$run.txt" 2>&1
      echo "bwd host $run rc $?"; grep '^{' "$OUT/host-$run.txt" | cut -c1-300
    done
    OUT="$OUT" timeout 150 python3 benchmarks/gqa_bwd_split.py > "$OUT/gqa-bwd-split.txt" 2>&1
    echo "split rc $?"; grep -E '^(llama|qwen2) ' "$OUT/gqa-bwd-split.txt" | cut -c1-900 ;;
  enqueue)
    # the Gluon dK/dV launcher's host time alone, OLD and this in turns (bwd_host.py --enqueue)
    cp benchmarks/bwd_host.py "$OLD/benchmarks/"
    for run in old-1 this-1 old-2 this-2 old-3 this-3; do
      tree=$([ "${run%-*}" = this ] && echo "$PWD" || echo "$OLD")
      (cd "$tree" && OUT="$OUT/enqueue-$run" timeout 60 python3 benchmarks/bwd_host.py --enqueue) > "$OUT/enqueue-$run.txt" 2>&1
      echo "enqueue $run rc $?"; grep '^{' "$OUT/enqueue-$run.txt" | tr '\n' ' ' | cut -c1-400; echo
    done ;;
  *)
    echo "usage: bash benchmarks/gpu_round14.sh probe|short|split|plan|enqueue" >&2; exit 2 ;;
esac
