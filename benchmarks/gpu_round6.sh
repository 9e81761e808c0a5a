#!/usr/bin/env bash
# The H200 runs behind round 6's results (issues 20-24), each step within one 10-minute device call;
# from the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round6.sh probes   # the Gluon forward's new kernels (gluon_probe.py) and the
#                                          # backward designs (bwd_probe.py), checked then timed
#   bash benchmarks/gpu_round6.sh models   # flashrun model, every family at 1b (model_h200.sh)
#   bash benchmarks/gpu_round6.sh decode   # decode_probe.py, then first_use.sh within what is left
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
  probes)
    timeout 250 python3 benchmarks/gluon_probe.py --budget-s 185 > "$OUT/gluon_probe.log" 2>&1
    echo "gluon_probe rc $?"
    grep -E "^env|FAIL|^correctness|compiled|skip" "$OUT/gluon_probe.log" | cut -c1-160 | head -30
    sed -n '/TFLOP\/s over/,$p' "$OUT/gluon_probe.log" | cut -c1-160 | head -60
    timeout 280 python3 benchmarks/bwd_probe.py --budget-s 200 > "$OUT/bwd_probe.log" 2>&1
    echo "bwd_probe rc $?"
    grep -E "FAIL|skip" "$OUT/bwd_probe.log" | cut -c1-160 | head -20
    tail -45 "$OUT/bwd_probe.log" | cut -c1-160 ;;
  models)
    bash benchmarks/model_h200.sh ;;
  decode)
    timeout 200 python3 benchmarks/decode_probe.py > "$OUT/decode_probe.log" 2>&1
    echo "decode_probe rc $?"; tail -40 "$OUT/decode_probe.log" | cut -c1-160
    DEADLINE=$(( 560 - SECONDS )) bash benchmarks/first_use.sh ;;
  *) echo "usage: $0 probes|models|decode" >&2; exit 2 ;;
esac
