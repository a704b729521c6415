#!/usr/bin/env bash
# The preemption advice, checked for real: serve the demo model with a KV cache that preempts
# under a workload, wait for the engine core's "Preemption advice" (the simulator replaying
# the traffic around the preemptions), then serve the same workload again with the change it
# recommends, and print both runs' preemptions and latencies as `tidal bench serve` reported
# them.
#
#   bash benchmarks/preemption_advice_check.sh COST_MODEL.json [KV_CACHE_MEMORY]
#
# COST_MODEL: `tidal tune profile --kv-cache-memory 512MiB --output FILE` on this machine.
# WORK overrides the workload (tidal bench serve flags); SERVE_FLAGS adds engine flags.
set -u
cd "$(dirname "$0")/.."
MODEL=$1; KV=${2:-16MiB}
DEMO=$(python -c "from tidal.frontend.demo import demo_model_path; print(demo_model_path())")
OUT=$(mktemp -d)
WORK=${WORK:-"--dataset-name sharegpt-like --sharegpt-max-total-len 1024 --num-prompts 100 --request-rate 4 --seed 3 --ignore-eos"}
echo "commit $(git rev-parse --short HEAD) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg); --kv-cache-memory $KV; $WORK"
run() {  # name, extra engine flags
  python -m tidal.frontend.cli serve ${SERVE_FLAGS:-} --kv-cache-memory "$KV" --step-cost-model "$MODEL" $2 \
    --port 8132 > "$OUT/$1.server.log" 2>&1 & P=$!
  for i in $(seq 120); do curl -sf localhost:8132/health >/dev/null && break; sleep 1; done
  tidal bench serve --base-url http://localhost:8132 --tokenizer "$DEMO" $WORK \
    --result-file "$OUT/$1.json" > "$OUT/$1.bench.log" 2>&1
  if [ "$1" = as-configured ] && ! grep -q "Server preemptions: *0$" "$OUT/$1.bench.log"; then
    for i in $(seq 120); do grep -q "Preemption advice" "$OUT/$1.server.log" && break; sleep 1; done
  fi
  echo "== $1 ($2) $(date -u +%H:%M:%S): $(grep -E "Server preemptions|Output token throughput|Median TTFT|P99 TTFT|Median ITL" "$OUT/$1.bench.log" | sed 's/  */ /g; s/(ms)//' | tr '\n' ';')"
  kill -INT $P; wait $P
}
run as-configured ""
awk '/Preemption advice/ {on=1; sub(/^.*Preemption advice/, "Preemption advice"); print; next}
     on && /^(simulated|  )/ {print; next} on {exit}' "$OUT/as-configured.server.log"
FLAG=$(grep -o "predicts with [^:]*:" "$OUT/as-configured.server.log" | head -1 | sed 's/predicts with //; s/:$//')
[ -n "$FLAG" ] && run recommended "$FLAG"
echo "logs and results in $OUT"
