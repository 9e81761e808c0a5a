#!/usr/bin/env bash
# The H200 runs behind round 6's results (issues 20-24), each step within one 10-minute device call;
# from the repo root, results under $OUT (or ./gpu-session):
#   bash benchmarks/gpu_round6.sh probes   # the Gluon forward's new kernels (gluon_probe.py) and the
#                                          # backward designs (bwd_probe.py), checked then timed
#   bash benchmarks/gpu_round6.sh models   # flashrun model, every family at 1b (model_h200.sh)
#   bash benchmarks/gpu_round6.sh final    # gemma2's checks again (the float32 launch-config fix), the
#                                          # decode kernels' GPU tests and quick probe, bench --metrics
#                                          # (metrics_run.sh), then first_use.sh within what is left
# On an image without pydantic, carry its wheels in .whl/ (see the device tool's README).
set -u
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160
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
  final)
    W="$OUT/w"; mkdir -p "$W"
    python3 -m flashrun model --arch gemma2 --size 1b --batch 1 --no-speed --json \
      --set "logging.log_dir='$W'" > "$W/gemma2-checks.json" 2> "$W/gemma2-checks.log"
    echo "gemma2 checks rc $?"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['verdict'], r['model']['kernel_calls'])
for c in r['checks']: print(' ', 'pass' if c['passed'] else 'FAIL', c['name'], c['summary'][:140])" "$W/gemma2-checks.json"
    timeout 150 env TRITON_INTERPRET=0 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE \
      -k "kvcache or decod or cuda_graph" > "$W/decode-suite.log" 2>&1
    echo "decode GPU tests rc $?"; tail -4 "$W/decode-suite.log" | cut -c1-200
    OUT="$W" timeout 70 python3 benchmarks/decode_probe.py --quick > "$W/decode_probe.log" 2>&1
    echo "decode_probe rc $?"; tail -25 "$W/decode_probe.log" | cut -c1-160
    OUT="$W/metrics" timeout 200 bash benchmarks/metrics_run.sh > /dev/null 2>&1
    echo "metrics_run rc $?"; grep -E "largest change|agrees|passed|failed|total" "$W/metrics/summary.txt" | head -8
    OUT="$W/first" DEADLINE=$(( 575 - SECONDS )) bash benchmarks/first_use.sh 2>&1 | tail -25
    tar -czf "$OUT/final.tar.gz" -C "$OUT" w && rm -rf "$W" ;;
  *) echo "usage: $0 probes|models|final" >&2; exit 2 ;;
esac
