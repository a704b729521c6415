"""Command-line flags for the engine (vLLM's names), and the config they build.

`add_engine_args` adds the flags to any parser (`tidal serve`, `tidal core`, benchmarks);
`config_from_args` builds the `EngineConfig`; `config_to_argv` is its inverse (the benchmarks
turn a config back into `LLM` keyword arguments with it). A frontend starting its own daemon
sends the config itself instead, as msgspec JSON (`config.encode_engine_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from tidal.engine_core.config import (
    ATTENTION_BACKENDS, DEVICES, EXECUTOR_BACKENDS, SCHEDULING_POLICIES, CacheConfig,
    EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, decode_engine_config,
)

_DTYPE_ALIASES = {
    "auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
    "float": "float32", "float32": "float32", "float64": "float64", "double": "float64",
}

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'4294967296', '4G', '4GiB', '512Mi' -> bytes (k/M/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512M)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(text: str) -> int:
    """'32768', '32k' (32000), '32K' (32768), '1.5m' -> an integer, as vLLM's
    human_readable_int: lower-case units are decimal, upper-case binary (whole numbers only)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgKMG]?)\s*", text)
    if not m or (m.group(2).isupper() and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 8192, 32k, 32K)")
    return int(float(m.group(1)) * _COUNT_UNITS[m.group(2)])


def _dtype(text: str) -> str:
    try:
        return _DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"dtype must be one of {sorted(_DTYPE_ALIASES)}, got {text!r}") from None


def _default(cls, name: str):
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the model, cache, scheduler and parallel flags (vLLM names and defaults)."""
    _add_model_args(parser.add_argument_group("model"))
    _add_cache_args(parser.add_argument_group("KV cache"))
    _add_scheduler_args(parser.add_argument_group("scheduler"))
    _add_parallel_args(parser.add_argument_group("parallel"))


def _add_model_args(g) -> None:
    g.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="local Hugging Face model folder or .gguf file (same as --model; "
                        "default in tidal serve/core/generate: the bundled demo model)")
    g.add_argument("--model", default=None,
                   help="local Hugging Face model folder or .gguf file (converted once into "
                        "$TIDAL_CACHE_DIR, default ~/.cache/tidal)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", type=_dtype, default="auto",
                   help="auto, half/float16, bfloat16, float/float32, float64 (default: auto: "
                        "the checkpoint's; on the CPU float16 computes in float32, and "
                        "bfloat16 too unless the CPU has AVX512_BF16 or AMX)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length, prompt + output (default: the model's config.json)")
    g.add_argument("--seed", type=int, default=_default(ModelConfig, "seed"),
                   help="sampling seed for requests without their own (default: 0)")
    g.add_argument("--served-model-name", default=None,
                   help="model name in the OpenAI API (default: the model path; "
                        "'tidal-demo' for the bundled demo model)")


def _add_cache_args(g) -> None:
    g.add_argument("--block-size", type=int, default=_default(CacheConfig, "block_size"),
                   help="tokens per KV block, a power of two (default: 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default(CacheConfig, "enable_prefix_caching"),
                   help="reuse KV blocks of shared prefixes (default: on)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=_default(CacheConfig, "gpu_memory_utilization"),
                   help="fraction of GPU memory the engine may use (default: 0.92)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache bytes per rank, e.g. 4GiB (CPU, or to bypass "
                        "--gpu-memory-utilization)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force this many KV blocks (testing)")


def _add_scheduler_args(g) -> None:
    g.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"),
                   help="most requests running at once (default: 256)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=_default(SchedulerConfig, "max_num_batched_tokens"),
                   help="token budget per step (default: 2048)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=_default(SchedulerConfig, "enable_chunked_prefill"),
                   help="split long prompts over several steps (default: on)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   default=_default(SchedulerConfig, "scheduling_policy"),
                   help="fcfs or priority (lower value first) (default: fcfs)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=_default(SchedulerConfig, "async_scheduling"),
                   help="plan the next step while the current one runs (default: on)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 beyond this many unfinished requests (default: unlimited)")
    g.add_argument("--max-num-queued-tokens", type=parse_count, default=None,
                   help="answer 503 when the prompt tokens of requests waiting for their "
                        "first token would pass this, e.g. 32k (default: unlimited)")
    g.add_argument("--stream-interval", type=int,
                   default=_default(SchedulerConfig, "stream_interval"),
                   help="stream tokens in groups of this many (default: 1)")
    g.add_argument("--long-prefill-token-threshold", type=int,
                   default=_default(SchedulerConfig, "long_prefill_token_threshold"),
                   help="most prompt tokens per request per step, 0 = no cap (default: 0)")
    g.add_argument("--max-queue-delay", type=float, default=None, metavar="SECONDS",
                   help="answer 503 with Retry-After at once when a new request's estimated "
                        "time to first token exceeds this (needs a step cost model: run "
                        "`tidal tune profile` first; default: off)")
    g.add_argument("--step-cost-model", default=None, metavar="PATH",
                   help="step cost model JSON for --max-queue-delay (default: the profile "
                        "`tidal tune profile` cached for this model and machine settings)")


def _add_parallel_args(g) -> None:
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=_default(ParallelConfig, "tensor_parallel_size"),
                   help="number of tensor-parallel ranks per pipeline stage (default: 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int,
                   default=_default(ParallelConfig, "pipeline_parallel_size"),
                   help="pipeline stages: the layers split into this many contiguous runs, "
                        "one group of -tp worker processes each (default: 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int,
                   default=_default(ParallelConfig, "data_parallel_size"),
                   help="engine cores, each with its own workers and KV cache, behind one "
                        "request router (default: 1)")
    g.add_argument("--device", choices=DEVICES, default=_default(ParallelConfig, "device"),
                   help="auto, cpu or cuda (default: auto)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default=_default(ParallelConfig, "attention_backend"),
                   help="auto (Triton on CUDA; on CPU the numba decode kernel for "
                        "float32/float64, the gathered torch path otherwise), numba, torch, "
                        "triton or reference (the slow per-request specification)")
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="OpenMP threads per worker rank on the CPU (default: "
                        "OMP_NUM_THREADS if set, else the rank's --cpu-affinity cores, else "
                        "all cores shared among the ranks)")
    g.add_argument("--worker-timeout", type=float,
                   default=_default(ParallelConfig, "worker_timeout"),
                   help="seconds a step may take before the workers count as hung and are "
                        "replaced (default: 300)")
    g.add_argument("--max-worker-restarts", type=int,
                   default=_default(ParallelConfig, "max_worker_restarts"),
                   help="replace dead or hung workers this many times within 10 minutes, "
                        "recomputing every running request (default: 3; 0 = fail every "
                        "request instead)")
    g.add_argument("--cpu-affinity", default=None,
                   help="cores per worker rank, like VLLM_CPU_OMP_THREADS_BIND: 0-3, or "
                        "0-3|4-7 for two ranks (default: not pinned)")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                   default=_default(ParallelConfig, "distributed_executor_backend"),
                   help="mp: one worker process per rank on this machine; ray: one Ray actor "
                        "per rank on the Ray cluster (RAY_ADDRESS, or `ray start` on this "
                        "machine), across machines (default: mp)")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Build the config from parsed flags (ValueError naming the field on bad values); a
    whole config sent by a frontend (the hidden `--engine-config`, msgspec JSON) wins."""
    whole = getattr(ns, "engine_config", None)
    if whole:
        return decode_engine_config(whole)
    model_tag, model_flag = getattr(ns, "model_tag", None), getattr(ns, "model", None)
    if model_tag and model_flag and model_tag != model_flag:
        raise ValueError(f"model given twice: {model_tag!r} and --model {model_flag!r}")
    model = model_tag or model_flag
    if not model:
        raise ValueError("model is required (MODEL or --model)")
    return EngineConfig(
        model=ModelConfig(model=model, tokenizer=ns.tokenizer, dtype=ns.dtype,
                          max_model_len=ns.max_model_len, seed=ns.seed,
                          served_model_name=ns.served_model_name),
        cache=CacheConfig(block_size=ns.block_size,
                          enable_prefix_caching=ns.enable_prefix_caching,
                          gpu_memory_utilization=ns.gpu_memory_utilization,
                          kv_cache_memory=ns.kv_cache_memory,
                          num_kv_blocks_override=ns.num_gpu_blocks_override),
        scheduler=SchedulerConfig(max_num_seqs=ns.max_num_seqs,
                                  max_num_batched_tokens=ns.max_num_batched_tokens,
                                  enable_chunked_prefill=ns.enable_chunked_prefill,
                                  scheduling_policy=ns.scheduling_policy,
                                  async_scheduling=ns.async_scheduling,
                                  max_num_queued_reqs=ns.max_num_queued_reqs,
                                  max_num_queued_tokens=ns.max_num_queued_tokens,
                                  stream_interval=ns.stream_interval,
                                  long_prefill_token_threshold=ns.long_prefill_token_threshold,
                                  max_queue_delay=ns.max_queue_delay,
                                  step_cost_model=ns.step_cost_model),
        parallel=ParallelConfig(tensor_parallel_size=ns.tensor_parallel_size,
                                data_parallel_size=ns.data_parallel_size,
                                pipeline_parallel_size=ns.pipeline_parallel_size,
                                device=ns.device, attention_backend=ns.attention_backend,
                                enforce_eager=ns.enforce_eager,
                                cpu_threads=ns.cpu_threads, cpu_affinity=ns.cpu_affinity,
                                worker_timeout=ns.worker_timeout,
                                max_worker_restarts=ns.max_worker_restarts,
                                distributed_executor_backend=ns.distributed_executor_backend),
    )


def config_to_argv(config: EngineConfig) -> list[str]:
    """Flags that rebuild `config` through add_engine_args + config_from_args."""
    m, c, s, p = config.model, config.cache, config.scheduler, config.parallel
    argv = ["--model", m.model, "--dtype", m.dtype, "--seed", str(m.seed)]
    _opt(argv, "--tokenizer", m.tokenizer)
    _opt(argv, "--max-model-len", m.max_model_len)
    _opt(argv, "--served-model-name", m.served_model_name)
    argv += ["--block-size", str(c.block_size),
             _flag("enable-prefix-caching", c.enable_prefix_caching),
             "--gpu-memory-utilization", repr(c.gpu_memory_utilization)]
    _opt(argv, "--kv-cache-memory", c.kv_cache_memory)
    _opt(argv, "--num-gpu-blocks-override", c.num_kv_blocks_override)
    argv += ["--max-num-seqs", str(s.max_num_seqs),
             "--max-num-batched-tokens", str(s.max_num_batched_tokens),
             _flag("enable-chunked-prefill", s.enable_chunked_prefill),
             "--scheduling-policy", s.scheduling_policy,
             _flag("async-scheduling", s.async_scheduling),
             "--stream-interval", str(s.stream_interval),
             "--long-prefill-token-threshold", str(s.long_prefill_token_threshold)]
    _opt(argv, "--max-num-queued-reqs", s.max_num_queued_reqs)
    _opt(argv, "--max-num-queued-tokens", s.max_num_queued_tokens)
    _opt(argv, "--max-queue-delay", None if s.max_queue_delay is None else repr(s.max_queue_delay))
    _opt(argv, "--step-cost-model", s.step_cost_model)
    argv += ["--tensor-parallel-size", str(p.tensor_parallel_size),
             "--data-parallel-size", str(p.data_parallel_size),
             "--pipeline-parallel-size", str(p.pipeline_parallel_size), "--device", p.device,
             "--attention-backend", p.attention_backend,
             "--worker-timeout", repr(p.worker_timeout),
             "--max-worker-restarts", str(p.max_worker_restarts),
             "--distributed-executor-backend", p.distributed_executor_backend]
    if p.enforce_eager:
        argv.append("--enforce-eager")
    _opt(argv, "--cpu-threads", p.cpu_threads)
    _opt(argv, "--cpu-affinity", p.cpu_affinity)
    return argv


def _opt(argv: list[str], flag: str, value) -> None:
    if value is not None:
        argv += [flag, str(value)]


def _flag(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"
