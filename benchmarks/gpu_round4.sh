#!/usr/bin/env bash
# The H200 runs behind this round's results, as two calls on a machine with two H200s.
#   bash benchmarks/gpu_round4.sh one   # GPU 1: the GPU suite for the new backward and the variants
#                                       # GPU 0: backward vs cuDNN, then the variants vs FlexAttention/SDPA
#   bash benchmarks/gpu_round4.sh two   # both GPUs: bench and verify --workers 2 against --workers 1,
#                                       # and a kernel that kills its worker
set -u
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200
bench() { python3 -m flashrun bench "$@"; }
case "${1:-}" in
  one)
    (TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -n 10 -p no:cacheprovider -rfE \
       -k "fused or determin or varlen or tunable or repeat" > "$OUT/gpu_suite_bwd.log" 2>&1; echo "suite rc $?" >> "$OUT/gpu_suite_bwd.log") &
    export CUDA_VISIBLE_DEVICES=0
    bench -k flash -p flash-deterministic,sdpa-cudnn --baseline sdpa-cudnn --mode bwd --dtype float16,bfloat16 \
      --seq-lens 1024,4096,16384 --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/bwd" | tail -4
    bench -k flash -p flex,sdpa --baseline flex --mode fwd --mode bwd --dtype bfloat16 --head-dims 128 \
      --seq-lens 8192,16384,32768 --set 'bench.window=[[4096,0]]' --causal no --set bench.tokens=65536 \
      --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/window" | tail -4
    bench -k flash -p flex,sdpa --baseline flex --mode fwd --mode bwd --dtype bfloat16 --head-dims 128 \
      --seq-lens 4096 --set 'bench.softcap=[50.0]' --set 'bench.alibi=[false,true]' \
      --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/softcap-alibi" | tail -4
    bench -k flash -p flex,sdpa --baseline flex --mode fwd --mode bwd --dtype bfloat16 --head-dims 128 \
      --set 'bench.seq_len=[]' --set 'bench.varlen=[[512,3000,128,4096,1024,2048,7000,600]]' --causal both \
      --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/varlen" | tail -4
    wait
    tail -3 "$OUT/gpu_suite_bwd.log" ;;
  two)
    for w in 1 2; do
      s=$(date +%s%N)
      bench --workers $w -p flash,sdpa-cudnn --set bench.rep_ms=40 --set bench.warmup_ms=10 --out "$OUT/bench-w$w" --json \
        > "$OUT/bench-w$w.json"
      echo "bench --workers $w: $(( ($(date +%s%N) - s) / 1000000 )) ms, rc $?"
    done
    for w in 1 2; do
      s=$(date +%s%N)
      python3 -m flashrun verify --workers $w --config configs/sweep.toml --grad --json > "$OUT/verify-w$w.json"
      echo "verify --workers $w: $(( ($(date +%s%N) - s) / 1000000 )) ms, rc $?"
    done
    python3 -m flashrun verify --workers 2 -k benchmarks/kills_worker.py:attention --set 'verify.seq_len=[17,97,130]' \
      --set 'verify.causal=[false]' --set 'verify.head_dim=[64]' --json > "$OUT/verify-killed.json"
    echo "killed-worker verify rc $?" ;;
  *) echo "usage: bash benchmarks/gpu_round4.sh one|two" >&2; exit 2 ;;
esac
