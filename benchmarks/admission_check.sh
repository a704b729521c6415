#!/bin/bash
# Issue 15: admission that predicts, checked. The same burst against `tidal serve` (the demo
# model) with --max-queue-delay LIMIT and without it, one after the other: which requests
# were answered 503 at once, and what those same requests' time to first token was on the
# server that queued them all; the accepted ones' p90 TTFT against the limit.
#   bash benchmarks/admission_check.sh COST_MODEL.json [LIMIT seconds, default 2]
set -u
cd "$(dirname "$0")/.."
MODEL=$1; LIMIT=${2:-2}
DEMO=$(python -c "from tidal.frontend.demo import demo_model_path; print(demo_model_path())")
OUT=$(mktemp -d)
WORK=${WORK:-"--dataset-name sharegpt-like --sharegpt-max-total-len 1024 --num-prompts 300 --request-rate inf --seed 5 --ignore-eos"}
echo "commit $(git rev-parse --short HEAD) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg); limit $LIMIT s; $WORK"
for mode in limit none; do
  extra=""; [ "$mode" = limit ] && extra="--max-queue-delay $LIMIT --step-cost-model $MODEL"
  python -m tidal.frontend.cli serve ${SERVE_FLAGS:-} --kv-cache-memory 512MiB $extra --port 8131 > "$OUT/$mode.server.log" 2>&1 & P=$!
  for i in $(seq 120); do curl -sf localhost:8131/health >/dev/null && break; sleep 1; done
  tidal bench serve --base-url http://localhost:8131 --tokenizer "$DEMO" $WORK --save-detailed \
    --result-file "$OUT/$mode.json" > "$OUT/$mode.bench.log" 2>&1
  echo "== $mode $(date -u +%H:%M:%S): $(grep -E "Successful|Failed|failed with|Median TTFT|P99 TTFT" "$OUT/$mode.bench.log" | sed 's/  */ /g; s/(ms)//' | tr '\n' ';')"
  kill -INT $P; wait $P
done
python - "$OUT" "$LIMIT" <<'PY'
import json, sys
out, limit = sys.argv[1], float(sys.argv[2])
def rows(mode):
    d = json.load(open(f"{out}/{mode}.json"))
    return d.get("requests") or d.get("detailed") or next(v for v in d.values() if isinstance(v, list))
lim, none = rows("limit"), rows("none")
assert len(lim) == len(none)
answered = sum(r["status_code"] is not None for r in lim)
rejected = [i for i, r in enumerate(lim) if r["status_code"] == 503]
accepted = [i for i, r in enumerate(lim) if r["success"]]
ttft_acc = sorted(lim[i]["ttft"] for i in accepted)
p90 = ttft_acc[int(0.9 * (len(ttft_acc) - 1))] if ttft_acc else float("nan")
would_miss = [i for i in rejected if not none[i]["success"] or none[i]["ttft"] > limit]
print(f"with --max-queue-delay {limit:g}: {len(lim)} requests, {answered} answered, "
      f"{len(accepted)} accepted (p90 TTFT {p90:.2f} s, max {max(ttft_acc):.2f} s), "
      f"{len(rejected)} answered 503 (at most {max([lim[i]['latency'] for i in rejected] or [0]):.3f} s after sending)")
print(f"the same {len(rejected)} requests without the limit: {len(would_miss)} had TTFT > {limit:g} s "
      f"(min {min([none[i]['ttft'] for i in rejected] or [0]):.2f} s); "
      f"all requests without it: p90 TTFT {sorted(r['ttft'] for r in none)[int(0.9 * (len(none) - 1))]:.2f} s")
PY
echo "logs and results in $OUT"
