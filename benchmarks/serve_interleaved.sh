#!/usr/bin/env bash
# Serving latency of tidal, llama-server and vLLM-CPU, interleaved: all three servers up at
# once (same model, ../shared/peers/setup.sh's builds), then `tidal bench serve` drives each
# in turn, one seed after another (a different random workload per seed, the same for all
# three). One serving run varies by 2x at a rate that builds a queue
# (benchmarks/archive/BENCHMARKS.md, "Night"), so compare engines over several seeds run side
# by side, not one run each.
# Usage: serve_interleaved.sh [RATE req/s] [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
#   env: PEERS (setup.sh's dir), SEEDS (default "1 2 3 4"), TIDAL_ARGS (extra tidal serve flags),
#        VLLM_ARGS (extra vllm serve flags: on a VM whose NUMA node holds less memory than vLLM's
#        default share, --gpu-memory-utilization 0.3, which on the CPU is that share),
#        MODEL and GGUF (default SmolLM2 and setup.sh's F32 GGUF of it; for the ~7M Llama:
#        make_peer_models.py's folder and peer_gguf.py's GGUF of it)
set -u
RATE=${1:-2}; N=${2:-60}; IN=${3:-128}; OUT=${4:-64}; SEEDS=${SEEDS:-1 2 3 4}
P=${PEERS:-$HOME/.cache/tidal-peers}; V=$P/venv; PEER_SCRIPTS=${PEER_SCRIPTS:-$(dirname "$0")/../../shared/peers}
M=${MODEL:-$P/models/smollm2-135m-instruct}; G=${GGUF:-$P/models/smollm2-135m-instruct-f32.gguf}
R=$(mktemp -d); echo "logs in $R; rate $RATE req/s, $N prompts, random $IN in / $OUT out; commit $(git -C "$(dirname "$0")" rev-parse --short HEAD)"
TC=$(python3 -c "import ctypes.util;print(ctypes.util.find_library('tcmalloc_minimal'))")
wait_up() { for i in $(seq 400); do curl -sf "localhost:$1/health" >/dev/null && { echo "$i"; return; }; sleep 1; done; echo never; }
setsid tidal serve "$M" --port 8401 --served-model-name "$M" ${TIDAL_ARGS:-} > "$R/tidal.server.log" 2>&1 & p1=$!
setsid "$P/llama.cpp/build/bin/llama-server" -m "$G" --port 8402 -t 2 -np 64 -c 65536 --no-webui -a "$M" \
  > "$R/llama.cpp.server.log" 2>&1 & p2=$!
setsid env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  LD_PRELOAD="$TC:$V/lib/libiomp5.so" "$V/bin/python" "$PEER_SCRIPTS/vllm_cli.py" serve "$M" --port 8403 \
  --dtype float32 ${VLLM_ARGS:-} > "$R/vllm.server.log" 2>&1 & p3=$!
trap 'for p in $p1 $p2 $p3; do kill -TERM -$p 2>/dev/null; done; sleep 5; for p in $p1 $p2 $p3; do kill -KILL -$p 2>/dev/null; done' EXIT
echo "ready: tidal $(wait_up 8401) s, llama.cpp $(wait_up 8402) s, vllm $(wait_up 8403) s (waited in turn)"; sleep 20
for s in $SEEDS; do for e in "tidal 8401" "llama.cpp 8402" "vllm 8403"; do set -- $e
  tidal bench serve --base-url "http://127.0.0.1:$2" --model "$M" --dataset-name random --random-input-len "$IN" \
    --random-output-len "$OUT" --random-range-ratio 0 --num-prompts "$N" --request-rate "$RATE" --seed "$s" \
    --ignore-eos > "$R/$1.$s.log" 2>&1
  echo "== $1 seed $s $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $(grep -E "Output token thr|Median (TTFT|ITL)|P99 (TTFT|ITL)" "$R/$1.$s.log" | sed 's/  */ /g; s/(tok\/s)//; s/(ms)//' | tr '\n' ';')"
done; done
