#!/bin/bash
# Issue 15: the simulator against real runs. Profiles the demo model (`tidal tune profile`,
# serving terms included), then for each setting simulates it with the worker-only terms and
# with the served ones, and runs it for real (`tidal serve` + `tidal bench serve`, the same
# workload flags). Run on a quiet machine; about 8 minutes on 2 cores.
#   bash benchmarks/tune_accuracy.sh [OUTDIR]
set -u
cd "$(dirname "$0")/.."
DEMO=$(python -c "from tidal.frontend.demo import demo_model_path; print(demo_model_path())")
OUT=${1:-$(mktemp -d)}; mkdir -p "$OUT"
stamp() { echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git rev-parse --short HEAD)"; }
stamp; tidal tune profile --kv-cache-memory 512MiB --max-prefill-tokens 8192 --output "$OUT/served.json" 2>&1 | grep -v "^INFO\|WARNING"
python - "$OUT" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/served.json"))
for k in ("request_latency_s", "per_prompt_token_latency_s", "per_step_overhead_s",
          "per_streamed_token_s", "per_arrival_s", "per_arrival_prompt_token_s"):
    d[k] = 0.0
json.dump(d, open(f"{sys.argv[1]}/worker.json", "w"))
PY
run() {  # name, engine flags, workload flags
  local name="$1" flags="$2" work="$3"
  echo; echo "######## $name: $flags | $work"
  for m in worker served; do
    stamp; echo "--- simulated ($m)"
    tidal tune simulate --step-cost-model "$OUT/$m.json" $flags $work 2>&1 | grep -E "throughput|Median|P99|preempt|Successful"
  done
  stamp; echo "--- real"
  tidal serve $flags --port 8123 > "$OUT/server.$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
  tidal bench serve --base-url http://localhost:8123 --tokenizer "$DEMO" --ignore-eos $work 2>&1 | grep -E "throughput|Median|P99|preempt|Successful"
  kill -INT $pid; wait $pid
  stamp
}
R512="--dataset-name random --random-input-len 512 --random-output-len 64 --random-range-ratio 0.5 --num-prompts 200 --request-rate 4 --seed 3"
run A "--kv-cache-memory 512MiB" "--dataset-name random --num-prompts 200 --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --request-rate 2"
run B "--kv-cache-memory 512MiB" "--dataset-name sharegpt-like --sharegpt-max-total-len 1024 --num-prompts 300 --request-rate 8"
run C "--kv-cache-memory 8MiB --max-num-seqs 64" "--dataset-name sharegpt-like --sharegpt-max-total-len 1024 --num-prompts 200 --request-rate 4"
run D "--kv-cache-memory 512MiB" "$R512"
run E "--kv-cache-memory 512MiB --max-num-seqs 32 --max-num-batched-tokens 128" "$R512"
echo "cost models and server logs in $OUT"
