# Sourced by the device scripts, from the repo root: $OUT (default ./gpu-session) made, pydantic's
# wheels from .whl/ installed where the image lacks them (see the device tool's README), the repo
# on PYTHONPATH, Python's output unbuffered, and model_speed, checks, gpu_tests, tree_of, fwd_host, fwd_bench and decode_grid (below) defined. Each script
# sets its own COLUMNS.
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

# llama and qwen2 (or the families in $2) at 1b against SDPA, speed only (the implementations timed in
# turns); $1: a label (the sample), the runs' files under $OUT/model/$1
model_speed() {
  mkdir -p "$OUT/model"
  for arch in ${2:-llama qwen2}; do
    timeout 120 python3 -m flashrun model --size 1b --arch "$arch" --batch 4 --set "model.checks=[]" \
      --set "model.baselines=['sdpa']" --set model.reps=10 --set "logging.log_dir='$OUT/model'" \
      --set "model.out='$OUT/model/$1'" > "$OUT/model/$arch-speed-$1.txt" 2>&1
    echo "$arch speed $1 rc $?"; grep -A5 "speed, batch" "$OUT/model/$arch-speed-$1.txt"
  done
}

checks() {  # every family's (or those in $1) six checks at 1b, batch 1 (64 greedy tokens in float32 among them)
  mkdir -p "$OUT/model"
  for arch in ${1:-llama mistral qwen2 gemma2}; do
    start=$(date +%s)
    timeout 110 python3 -m flashrun model --size 1b --arch "$arch" --batch 1 --no-speed --json \
      --set "logging.log_dir='$OUT/model'" --set "model.out='$OUT/model'" \
      > "$OUT/model/$arch-checks.json" 2> "$OUT/model/$arch-checks.log"
    echo "$arch checks: exit $? in $(( $(date +%s) - start )) s"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(' ', r['verdict']); [print('  ', 'pass' if c['passed'] else 'FAIL', c['name'], c['summary'][:140]) for c in r['checks']]" "$OUT/model/$arch-checks.json"
  done
}

tree_of() {  # the checkout a run label names: old-N is $OLD, this-N this one
  [ "${1%-*}" = this ] && echo "$PWD" || echo "$OLD"
}

fwd_host() {  # fwd_host.py in the checkout of each run label given (OLD gets this script's copy)
  cp benchmarks/fwd_host.py "$OLD/benchmarks/"
  for run in "$@"; do
    (cd "$(tree_of "$run")" && timeout 90 python3 benchmarks/fwd_host.py --out "$OUT/host" --label="-$run") \
      > "$OUT/fwd-host-$run.txt" 2>&1
    echo "fwd host $run rc $?"; head -15 "$OUT/fwd-host-$run.txt"
  done
}

fwd_bench() {  # $1: run label (this-N / old-N), $2: name, $3: seconds, then flashrun bench's shape options
  local run=$1 name=$2 limit=$3
  shift 3
  (cd "$(tree_of "$run")" && timeout "$limit" python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn \
    --mode fwd --set bench.rep_ms=25 "$@" --out "$OUT/$name-$run") > "$OUT/$name-$run.txt" 2>&1
  echo "$name $run rc $?"; grep -E "^(B[0-9]|flash )" "$OUT/$name-$run.txt" | paste - - | tr -s " " | cut -c1-110
}

gpu_tests() {  # $1: the log's name under $OUT, $2: seconds allowed, $3: pytest's -k expression over tests/test_gpu.py
  timeout "$2" env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE -k "$3" \
    > "$OUT/$1.log" 2>&1
  echo "GPU tests rc $?"; tail -1 "$OUT/$1.log"
}

decode_grid() {  # $1: kv heads (8: GQA 32/8, 1: MQA), $2: the run's name under $OUT, $3: seconds allowed; the
  # decode grid through flashrun bench against cuDNN: B 1-16 x 4k-128k keys (65536 tokens), D 128, fp16/bf16,
  # causal and not, flash_attention and the KV cache contiguous and at pages of 16
  timeout "$3" python3 -m flashrun bench -k flash -p sdpa-cudnn --baseline sdpa-cudnn --mode fwd --seq-lens 1 \
    --seq-lens-k 4096,16384,65536,131072 --head-dims 128 --causal both --dtype bf16,fp16 --set bench.hidden=4096 \
    --set bench.num_kv_heads="$1" --set bench.tokens=65536 --set "bench.page_size=[0,16]" --set bench.rep_ms=25 \
    --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
  echo "bench decode kv heads $1 rc $?"
}
