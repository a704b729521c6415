#!/bin/bash
# Issue 15: the tuner's recommendation checked for real. Searches with a step cost model,
# then runs the default and the recommended setting side by side (fresh servers each run:
# the same seed's prompts would hit an earlier run's prefix cache), the same trace each.
#   bash benchmarks/tune_check.sh COST_MODEL.json [ITL_P99, default 50ms] [RUNS, default 2]
set -u
cd "$(dirname "$0")/.."
MODEL=$1; ITL=${2:-50ms}; RUNS=${3:-2}
DEMO=$(python -c "from tidal.frontend.demo import demo_model_path; print(demo_model_path())")
OUT=$(mktemp -d)
TRACE="--random-input-len 512 --random-output-len 64 --random-range-ratio 0.5 --num-prompts 200 --request-rate 4 --seed 3"
tidal tune --step-cost-model "$MODEL" --dataset random $TRACE --slo-ttft-p99 1s --slo-itl-p99 "$ITL" \
  --kv-cache-memory-grid 512MiB --max-num-seqs-grid 32,256 --max-num-batched-tokens-grid 64,128,256,512,2048 \
  --top 10 --plot "$OUT/tune.png" 2>&1 | grep -v "^  \.\.\.\|settings simulated" | tee "$OUT/tune.txt"
BEST=$(grep "^Best:" "$OUT/tune.txt" | sed 's/.*MODEL //')
[ -n "$BEST" ] || { echo "no setting meets the SLO: nothing to check"; exit 0; }
echo "commit $(git rev-parse --short HEAD) $(date -u +%H:%M:%S); tuned: $BEST"
for run in $(seq "$RUNS"); do
  tidal serve --kv-cache-memory 512MiB --port 8124 > "$OUT/default.log" 2>&1 & P1=$!
  tidal serve $BEST --port 8125 > "$OUT/tuned.log" 2>&1 & P2=$!
  for i in $(seq 120); do curl -sf localhost:8124/health >/dev/null && curl -sf localhost:8125/health >/dev/null && break; sleep 1; done
  for s in default:8124 tuned:8125; do
    echo -n "== ${s%%:*} run $run $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): "
    tidal bench serve --base-url "http://localhost:${s##*:}" --tokenizer "$DEMO" --ignore-eos --dataset-name random $TRACE 2>&1 \
      | grep -E "Successful|Output token throughput|preempt|Median TTFT|P99 TTFT|Median ITL|P99 ITL" | sed 's/(ms)//;s/(tok\/s)//;s/  */ /g' | tr '\n' ';'
    echo
  done
  kill -INT $P1 $P2; wait
done
