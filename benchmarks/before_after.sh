#!/usr/bin/env bash
# Two tidal builds side by side on one model, in one run: offline throughput (`tidal bench
# throughput`, each build in turn, ROUNDS times) and serving latency (both servers up at once,
# `tidal bench serve` driving each in turn, one seed after another). For a change that must
# not make tidal slower (issue 33's house in order).
#   BEFORE=/path/to/venv-with-the-old-build/bin bash benchmarks/before_after.sh MODEL
#   env: ROUNDS (3), SEEDS ("1 2 3 4"), RATE (2 req/s), N (60 prompts), OFFLINE_PROMPTS (64)
set -u
MODEL=$1; ROUNDS=${ROUNDS:-3}; SEEDS=${SEEDS:-1 2 3 4}; RATE=${RATE:-2}; N=${N:-60}
AFTER=$(dirname "$(command -v tidal)"); R=$(mktemp -d); cd "$R"  # not a checkout's root
echo "logs in $R; after = commit $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null), before = $BEFORE"
for round in $(seq "$ROUNDS"); do for b in before after; do
  bin=$BEFORE; [ $b = after ] && bin=$AFTER
  "$bin/tidal" bench throughput "$MODEL" --dataset-name sharegpt-like --num-prompts "${OFFLINE_PROMPTS:-64}" \
    --hf-backends none --kv-cache-memory 1GiB > "$R/offline.$b.$round.log" 2>&1
  echo "== offline $b round $round $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $(grep -E "Throughput:|ready in" "$R/offline.$b.$round.log" | tail -2 | sed 's/  */ /g' | tr '\n' ';')"
done; done
wait_up() { for i in $(seq 300); do curl -sf "localhost:$1/health" >/dev/null && { echo "$i"; return; }; sleep 1; done; echo never; }
setsid "$BEFORE/tidal" serve "$MODEL" --port 8501 --served-model-name m --kv-cache-memory 1GiB > "$R/before.server.log" 2>&1 & p1=$!
setsid "$AFTER/tidal" serve "$MODEL" --port 8502 --served-model-name m --kv-cache-memory 1GiB > "$R/after.server.log" 2>&1 & p2=$!
trap 'for p in $p1 $p2; do kill -TERM -$p 2>/dev/null; done; sleep 5; for p in $p1 $p2; do kill -KILL -$p 2>/dev/null; done' EXIT
echo "ready: before $(wait_up 8501) s, after $(wait_up 8502) s"; sleep 10
n=0; for s in $SEEDS; do
  # The order alternates by seed: the second server of a pair runs on a machine warmed (or
  # loaded) by the first, and a fixed order would put that bias on one build.
  order="before:8501 after:8502"; [ $((n % 2)) = 1 ] && order="after:8502 before:8501"; n=$((n + 1))
  for e in $order; do set -- ${e%:*} ${e#*:}
  "$AFTER/tidal" bench serve --base-url "http://127.0.0.1:$2" --model m --tokenizer "$MODEL" --dataset-name random \
    --random-input-len 128 --random-output-len 64 --random-range-ratio 0 --num-prompts "$N" --request-rate "$RATE" \
    --seed "$s" --ignore-eos > "$R/serve.$1.$s.log" 2>&1
  echo "== serve $1 seed $s $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $(grep -E "Output token thr|Median (TTFT|ITL)|P99 (TTFT|ITL)" "$R/serve.$1.$s.log" | sed 's/  */ /g; s/(tok\/s)//; s/(ms)//' | tr '\n' ';')"
done; done
