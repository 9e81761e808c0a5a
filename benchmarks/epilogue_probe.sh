# Round 25 probe (benchmarks/NOTES.md v25; at this commit only): OUT=dir bash benchmarks/epilogue_probe.sh; each variant in its own process and Triton cache, in two rounds
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
for round in 1 2; do
  for flag in 0 1 2 4 3; do
    FLASHRUN_BWD_PROBE=$flag TRITON_CACHE_DIR=/tmp/tc-$flag timeout 100 python3 benchmarks/epilogue_probe.py > "$OUT/epilogue-probe-$flag-$round.log" 2>&1; grep "^\[\|^{" "$OUT/epilogue-probe-$flag-$round.log" | tee -a "$OUT/epilogue-probe.jsonl"
  done
done
