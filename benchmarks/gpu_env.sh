# Sourced by the device scripts, from the repo root: $OUT (default ./gpu-session) made, pydantic's
# wheels from .whl/ installed where the image lacks them (see the device tool's README), the repo
# on PYTHONPATH, Python's output unbuffered, and model_speed, gpu_tests, tree_of and fwd_host (below) defined. Each script
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

gpu_tests() {  # $1: the log's name under $OUT, $2: seconds allowed, $3: pytest's -k expression over tests/test_gpu.py
  timeout "$2" env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 4 -rfE -k "$3" \
    > "$OUT/$1.log" 2>&1
  echo "GPU tests rc $?"; tail -1 "$OUT/$1.log"
}
