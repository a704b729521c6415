#!/usr/bin/env bash
# What the live page costs a serving run (issue 37): one `tidal serve`, `tidal bench serve`
# driving it with the page's event stream open (a `curl -N /ui/events` reader, as a browser
# tab is) and closed, alternating, ROUNDS times each, in one run.
#   bash benchmarks/ui_cost.sh MODEL      env: ROUNDS (2), N (64 prompts), PORT (8601)
set -u
MODEL=$1; ROUNDS=${ROUNDS:-2}; N=${N:-64}; PORT=${PORT:-8601}
R=$(mktemp -d); cd "$R"
setsid tidal serve "$MODEL" --port "$PORT" --served-model-name m --kv-cache-memory 1GiB > server.log 2>&1 & srv=$!
trap 'kill -TERM -$srv 2>/dev/null; sleep 3; kill -KILL -$srv 2>/dev/null' EXIT
for i in $(seq 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
bench() {
  tidal bench serve --base-url "http://127.0.0.1:$PORT" --model m --tokenizer "$MODEL" \
    --dataset-name random --random-input-len 128 --random-output-len 64 --random-range-ratio 0 \
    --num-prompts "$N" --request-rate inf --seed 1 --ignore-eos > "bench.$1.log" 2>&1
  echo "== page $2 $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $(grep -E "Output token thr|Median ITL" "bench.$1.log" | sed 's/  */ /g; s/(tok\/s)//; s/(ms)//' | tr '\n' ';')"
}
bench warmup closed >/dev/null
for r in $(seq "$ROUNDS"); do
  bench "closed.$r" closed
  curl -sN "localhost:$PORT/ui/events" > "events.$r.txt" & reader=$!
  sleep 1; bench "open.$r" open
  kill $reader; echo "   (the open page received $(grep -c '^data: ' "events.$r.txt") snapshots)"
done
