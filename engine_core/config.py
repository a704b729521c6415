"""The engine configuration: one frozen `EngineConfig` made of four sub-configs.

Every field is documented where it is declared; every user error is a `ValueError` that names
the field. Facts discovered at start-up (how many KV blocks fit, the resolved context length)
are never written back into the config: they are passed to the objects that need them (see
`Scheduler(config, num_kv_blocks, max_model_len)` and `EngineConfig.worker_config`).

Defaults follow vLLM 0.33 where vLLM has one: block size 16, prefix caching on, chunked
prefill on, policy fcfs, async scheduling on, stream interval 1, gpu_memory_utilization 0.92,
max_num_batched_tokens 2048 and max_num_seqs 256 (vLLM's API-server defaults on GPUs under
70 GiB; the SchedulerConfig fallback in vLLM is 2048 / 128).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import msgspec

from .cpu_threads import parse_cpu_affinity, worker_threads
from .spec_decode import parse_speculative_config
from ..ipc.worker_messages import WorkerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "numba", "torch", "triton", "reference")  # = tidal.kernels.BACKENDS
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # = tidal.kernels.attention.kv_quant.KV_CACHE_DTYPES
CPU_KERNELS = ("auto", "torch")  # = tidal.kernels.cpu.ops.CPU_KERNELS
CPU_KERNEL_OPTIONS = ("no-amx", "no-panels", "no-fused", "march=")  # = ops.CPU_KERNEL_OPTIONS
EXECUTOR_BACKENDS = ("mp", "ray")
CPU_WAIT_POLICIES = ("auto", "spin", "passive")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


def is_gguf(model: str) -> bool:
    """Whether `model` names a GGUF file (by its suffix) rather than a model folder."""
    return model.lower().endswith(".gguf")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


def cpu_kernels_ok(value: str) -> bool:
    """Whether `value` is a `cpu_kernels` setting: auto or torch, auto optionally followed by
    comma-separated options (`kernels/cpu/ops.parse_cpu_kernels` reads it at the worker)."""
    base, *options = value.split(",")
    return base in CPU_KERNELS and (base == "auto" or not options) and all(
        o in CPU_KERNEL_OPTIONS[:-1] or (o.startswith("march=") and o != "march=")
        for o in options) and sum(o.startswith("march=") for o in options) <= 1


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how to load it."""

    model: str
    """A local Hugging Face model folder (config.json, tokenizer files, safetensors), a GGUF
    file (`*.gguf`, converted once by the engine core into a cached folder), or a Hugging Face
    Hub id: ORG/NAME, ORG/NAME:FILE.gguf or ORG/NAME:QUANT (Q4_K_M, ...), fetched once into
    the Hub's cache before anything starts (`engine_core/hub.py`; HF_HOME, HF_TOKEN and
    HF_HUB_OFFLINE apply as in vLLM)."""
    tokenizer: str | None = None
    """Tokenizer folder; None means the model folder (for a GGUF file: the converted one)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (the worker picks from the checkpoint's dtype and the
    device; a GGUF file's is float32), float32, bfloat16, float16 or float64 (the flag also
    takes half, float and double). On the CPU float16 computes in float32, and bfloat16 too
    unless the CPU has AVX512_BF16 or AMX."""
    max_model_len: int | None = None
    """Context length (prompt + generated tokens); None means the model's own, read from
    config.json (`max_position_embeddings` and friends). May not exceed the model's."""
    seed: int = 0
    """Seed for sampling of requests that do not carry their own seed."""
    served_model_name: str | list[str] | None = None
    """The model name(s) the OpenAI API accepts (several: any of them; the first is the one
    reported); None means `model` as given (a Hub id, not the folder it was fetched into)."""
    revision: str | None = None
    """The Hub revision (branch, tag or commit) of a model given by its Hub id; None: main."""
    download_dir: str | None = None
    """Where a model given by its Hub id is fetched to (a Hub cache folder); None:
    huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    structured_outputs_max_bytes: int = 128 * 2**10
    """Bytes: the largest structured-output constraint a request may carry (a JSON schema's
    text, a regex, a grammar, or its choices together); a larger one is refused (HTTP 400)
    before anything compiles it."""
    structured_outputs_compile_timeout: float = 10.0
    """Seconds of CPU time a structured-output constraint may take to compile (CPU time, so a
    busy machine does not refuse what a quiet one takes); one that takes longer is refused
    (HTTP 400, or the request fails with an error naming this flag). Compiles run off the step
    path, on threads at nice 10: the batch goes on while a request waits for its grammar."""
    structured_outputs_cache_bytes: int = 512 * 2**20
    """Bytes of compiled grammars each process keeps for reuse (the HTTP process and every
    worker; least recently used first out). vLLM's xgrammar cache default."""
    runner: str = "auto"
    """generate: text generation (completions, chat). pooling: embeddings (/v1/embeddings,
    `LLM.embed`): each prompt is one prefill whose final hidden states are pooled into one
    vector, with no LM head (docs/embeddings.md). auto, as vLLM: pooling for a folder with a
    sentence-transformers pooling config (modules.json) or an architecture named *Model
    (Qwen3Model), else generate. An engine does one or the other."""
    convert: str = "auto"
    """embed: run a *ForCausalLM checkpoint as an embedding model (implies --runner pooling);
    none: as it is; auto: embed under --runner pooling, none otherwise (vLLM's --convert)."""
    pooler_config: str | None = None
    """JSON, as vLLM's --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS",
    "normalize": true | false}; what is not given comes from the folder's
    sentence-transformers config (1_Pooling/config.json, a Normalize module in modules.json),
    else LAST and normalize (vLLM's defaults for a converted decoder)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and self.model != "", "model",
                 "must be a non-empty path to a model folder or a GGUF file")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 f"must be at least 1, got {self.max_model_len}")
        _require(-(2**63) <= self.seed < 2**63, "seed", "must fit in a signed 64-bit integer")
        names = self.served_model_name
        _require(names is None or (names != "" and names != [] and (
            isinstance(names, str) or all(isinstance(n, str) and n for n in names))),
                 "served_model_name", "must be a non-empty name or list of non-empty names")
        _require(self.structured_outputs_max_bytes >= 1, "structured_outputs_max_bytes",
                 f"must be at least 1, got {self.structured_outputs_max_bytes}")
        _require(0 < self.structured_outputs_compile_timeout < float("inf"),
                 "structured_outputs_compile_timeout", "must be a positive number of seconds, "
                 f"got {self.structured_outputs_compile_timeout}")
        _require(self.structured_outputs_cache_bytes >= 0, "structured_outputs_cache_bytes",
                 f"must be non-negative, got {self.structured_outputs_cache_bytes}")
        _require(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got "
                 f"{self.runner!r}")
        _require(self.convert in CONVERTS, "convert", f"must be one of {CONVERTS}, got "
                 f"{self.convert!r}")
        _require(not (self.runner == "generate" and self.convert == "embed"), "convert",
                 "embed needs --runner pooling (or auto), not generate")
        parse_pooler_config(self.pooler_config)  # ValueError naming the field

    @property
    def tokenizer_path(self) -> str | None:
        """Where the tokenizer lives; None when only the engine core can say (a GGUF file:
        its converted folder, sent in `EngineInfo.tokenizer`)."""
        if self.tokenizer is None and is_gguf(self.model):
            return None
        return self.tokenizer or self.model

    @property
    def names(self) -> list[str]:
        """Every name API users may give (`served_model_name`, else `model`)."""
        names = self.served_model_name or self.model
        return [names] if isinstance(names, str) else list(names)

    @property
    def name(self) -> str:
        """The model name shown to API users (the first of `names`)."""
        return self.names[0]


def parse_pooler_config(text: str | None) -> dict:
    """`--pooler-config` JSON as a dict of the keys given (pooling_type upper-cased);
    ValueError naming pooler_config for anything else."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"pooler_config is not valid JSON: {e}") from None
    _require(isinstance(value, dict), "pooler_config", f"must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - {"pooling_type", "normalize"})
    _require(not unknown, "pooler_config", f"takes pooling_type and normalize; "
             f"{', '.join(unknown)} is not supported")
    kind = value.get("pooling_type")
    if kind is not None:
        _require(isinstance(kind, str) and kind.upper() in ("LAST", "MEAN", "CLS"),
                 "pooler_config", f"pooling_type must be LAST, MEAN or CLS, got {kind!r}")
        value["pooling_type"] = kind.upper()
    _require(value.get("normalize") in (None, True, False), "pooler_config",
             f"normalize must be true or false, got {value.get('normalize')!r}")
    return {k: v for k, v in value.items() if v is not None}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = 16
    """Tokens per KV block (a power of two). Prefix caching works at this granularity."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks across requests that share a prefix (chained block hashes)."""
    gpu_memory_utilization: float = 0.92
    """Fraction of the GPU's memory this engine may use (weights + activations + KV cache)."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache per rank (4GiB, 512MiB, 2GB, ...); set on CPU, or to bypass
    gpu_memory_utilization on GPU. None means the worker's default: on the CPU room for
    max_num_seqs requests of max_model_len tokens, at most 4 GiB; on GPU
    gpu_memory_utilization."""
    num_kv_blocks_override: int | None = None
    """Force this many KV blocks (tests, preemption experiments); None means measured."""
    kv_cache_dtype: str = "auto"
    """What the KV cache stores: auto (the model's compute dtype), int8 (each token's K/V row
    of each KV head as int8 with one float32 scale: about 3.8x the tokens of a float32 cache
    per byte at head_dim 64, 1.9x bf16's; not token-exact, see docs/kv-cache-dtype.md) or
    fp8 (e4m3 with the same scales; read by the torch and reference attention backends
    only)."""

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(isinstance(bs, int) and bs >= 1 and bs & (bs - 1) == 0, "block_size",
                 f"must be a power of two, got {bs}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
                 f"must be a positive number of bytes, got {self.kv_cache_memory}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.num_kv_blocks_override is None or self.num_kv_blocks_override >= 2,
                 "num_kv_blocks_override",
                 f"must be at least 2 (block 0 is reserved), got {self.num_kv_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many requests and tokens go into one step."""

    max_num_seqs: int = 256
    """Most requests running at once (vLLM's API-server default on GPUs under 70 GiB)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: prefill chunks plus one token per decode."""
    enable_chunked_prefill: bool = True
    """Split a prompt that does not fit the step's remaining budget over several steps.
    Off: a prompt runs whole, and max_num_batched_tokens must cover max_model_len."""
    scheduling_policy: str = "fcfs"
    """fcfs: arrival order, the newest running request is preempted first. priority: lower
    `priority` value first (ties by arrival); the largest (priority, arrival) is preempted."""
    async_scheduling: bool | None = None
    """Plan step N+1 while step N runs on the workers (same results as synchronous). Unset:
    on for CUDA workers, off for CPU workers (as vLLM's CPU backend). A request that arrives
    while step N runs joins step N+2 with it on, N+1 with it off; a CPU step is long (25-500
    ms) beside the engine core's planning (about 1 ms), so on the CPU that step of waiting
    costs more than the overlap gains."""
    max_num_queued_reqs: int | None = None
    """Most unfinished requests a frontend accepts before answering 503; None = unlimited."""
    max_num_queued_tokens: int | None = None
    """Most prompt tokens of unfinished requests still waiting for their first token (in the
    queue or in prefill) before a frontend answers 503 (32k = 32000, 32K = 32768); None =
    unlimited. A TTFT guard: set it near target TTFT x prefill throughput."""
    stream_interval: int = 1
    """Frontends send streamed tokens in groups of this many (first and last at once)."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request may compute in one step (0 = no cap); ignored while
    only one request exists."""
    max_queue_delay: float | None = None
    """Seconds: a frontend answers a new request 503 at once when its estimated time to
    first token (the work queued ahead of it, through the step cost model) exceeds this;
    None = off. Needs a step cost model (`tidal tune profile`)."""
    step_cost_model: str | None = None
    """The step cost model file for `max_queue_delay` and for the simulator's prediction after
    preemptions; None means the profile `tidal tune profile` cached for this model, dtype,
    device, TP size, threads and attention backend (without one, neither)."""
    preemption_advice_quiet_s: float = 5.0
    """Seconds without a preemption (and no preempted request unfinished) that end a spell of
    preemptions, after which the simulator's prediction is made
    (engine_core/advice/preemption_advice.py). Measured on the demo model: ending a spell at
    the first moment no preempted request was left cut a steady spell after its first
    seconds, and the simulator, given 33 requests of a run of 100, predicted none of its
    preemptions. Tests that want the advice of one short burst set it lower."""
    speculative_config: str | None = None
    """Speculative decoding, vLLM's JSON: {"method": "ngram" | "suffix",
    "num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": N}, plus
    tidal's "adaptive" (default true: each step picks every request's draft count, 0..K,
    from the step cost model and its acceptance; false: always K, as other engines) and
    "suffix_max_match" / "suffix_cache_requests"; or {"method": "draft_model", "model":
    FOLDER, "num_speculative_tokens": K} (a "model" key alone means draft_model): a smaller
    model with the target's vocabulary drafts in the workers. None = off. See
    docs/speculative.md."""

    @property
    def draft_model(self) -> str | None:
        """The draft model's folder when speculative_config's method is draft_model."""
        spec = parse_speculative_config(self.speculative_config)
        return spec.model if spec is not None else None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
        parse_speculative_config(self.speculative_config)  # ValueError naming the key
        _require(self.max_num_seqs >= 1, "max_num_seqs",
                 f"must be at least 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"({self.max_num_batched_tokens}) must be at least max_num_seqs "
                 f"({self.max_num_seqs}): every running request needs a token per step")
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                 f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _require(self.max_num_queued_reqs is None or self.max_num_queued_reqs >= 1,
                 "max_num_queued_reqs", f"must be at least 1, got {self.max_num_queued_reqs}")
        _require(self.max_num_queued_tokens is None or self.max_num_queued_tokens >= 1,
                 "max_num_queued_tokens",
                 f"must be at least 1, got {self.max_num_queued_tokens}")
        _require(self.stream_interval >= 1, "stream_interval",
                 f"must be at least 1, got {self.stream_interval}")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 f"must be non-negative, got {self.long_prefill_token_threshold}")
        _require(self.max_queue_delay is None or 0 < self.max_queue_delay < float("inf"),
                 "max_queue_delay", f"must be a positive number of seconds, got "
                 f"{self.max_queue_delay}")
        _require(0 < self.preemption_advice_quiet_s < float("inf"),
                 "preemption_advice_quiet_s",
                 f"must be a positive number of seconds, got {self.preemption_advice_quiet_s}")

    def async_on(self, device: str) -> bool:
        """Whether the engine core plans ahead with workers on `device` ("cpu", "cuda"):
        `async_scheduling`, or where it is unset, on CUDA only."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.split(":")[0] == "cuda"


@dataclass(frozen=True)
class ParallelConfig:
    """Where the workers run."""

    tensor_parallel_size: int = 1
    """Worker processes (ranks) per pipeline stage; each holds 1/N of its stage's layers'
    heads and KV cache."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: the decoder layers split into this many contiguous runs, one
    group of `tensor_parallel_size` worker processes per stage (pp × tp processes in all).
    Each stage holds only its layers' weights and KV cache; hidden states pass from stage to
    stage, the last one samples. The engine core keeps this many plans in flight (one more
    with async scheduling) so every stage has work."""
    data_parallel_size: int = 1
    """Engine cores, each with its own scheduler, KV block pool and pp x tp workers, behind
    one request router that every frontend attaches to (`engine_core/dp_router.py`); 1: a
    single engine core, no router."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    attention_backend: str = "auto"
    """auto (Triton on CUDA; on the CPU the C decode kernel for float32 where it builds, the
    numba one for float32/float64, the gathered torch path otherwise), cpu, numba, torch,
    triton, or reference (the plain per-request specification: slow, for tests)."""
    cpu_kernels: str = "auto"
    """The CPU ops beside attention of a worker on the CPU (small-batch GEMMs, RMSNorm,
    rotary, the decoder layers in one C call), chosen once at load by `kernels/cpu/ops.py`,
    which logs the choice in one line: auto takes each C kernel that builds here (a C
    compiler, $CC or cc, and the CPU's instructions), oneDNN and numba for the rest; torch
    takes torch's own ops only (for comparisons). After auto, comma-separated: no-amx,
    no-panels (no C GEMM), no-fused (the layers call their kernels one by one), march=CPU
    (every C kernel, attention's too, built for gcc's -march=CPU: haswell runs the AVX2 paths
    on an AVX-512 machine)."""
    enforce_eager: bool = False
    """Never capture CUDA graphs."""
    cpu_threads: int | None = None
    """OpenMP threads per worker rank on the CPU; None: OMP_NUM_THREADS from the environment
    if set, else the rank's `cpu_affinity` cores, else every core this process may use shared
    among the ranks (`engine_core/cpu_threads.py` says why, and how idle threads wait)."""
    cpu_wait_policy: str = "auto"
    """How a CPU worker's idle OpenMP threads wait. auto: they spin a while before sleeping
    (libgomp's default: twice PASSIVE's throughput on a quiet machine) until the worker's
    threads wait for a CPU more than a quarter of their step time (other processes took the
    cores: spinning then costs 10-100x); then the steps run on half the threads (at least
    one) and idle threads sleep at once, and every thread spins again once the cores have
    looked free for 2 s (4, 8 ... 60 s after tries that found them taken;
    `workers/cpu_contention.py`). spin: always spin (the rank only warns). passive:
    OMP_WAIT_POLICY=PASSIVE, sleep at once from the start (for a machine that is always
    shared). OMP_WAIT_POLICY in the environment wins over spin and passive."""
    cpu_affinity: str | None = None
    """Cores each rank runs on, vLLM's VLLM_CPU_OMP_THREADS_BIND syntax: `0-3` for one rank,
    `0-3|4-7` for two; None or `all`: not pinned."""
    worker_timeout: float = 300.0
    """Seconds rank 0 may take to answer a step before the engine core counts its workers
    as hung (and replaces them, see `max_worker_restarts`)."""
    max_worker_restarts: int = 3
    """How many times within 10 minutes the engine core replaces its workers after one
    dies, fails or hangs past --worker-timeout (every running request is then recomputed from
    its tokens, so clients see a pause, not an error; older restarts no longer count,
    `engine_core/restart_budget.py`). Past it, or at 0, a worker failure fails every
    unfinished request and the core exits."""
    distributed_executor_backend: str = "mp"
    """mp: one worker process per rank on this machine (`engine_core/executor.py`). ray: one
    Ray actor per rank, placed on the Ray cluster this process joins (RAY_ADDRESS, else the
    one `ray start` began on this machine, else a new local one), across machines; each
    rank reserves one GPU on GPU hosts, `cpu_threads` CPUs (default 1) on CPU hosts
    (`engine_core/ray_executor.py`). The model folder must exist at the same path on every
    node."""

    def __post_init__(self) -> None:
        _require(self.worker_timeout > 0, "worker_timeout",
                 f"must be positive, got {self.worker_timeout}")
        _require(self.max_worker_restarts >= 0, "max_worker_restarts",
                 f"must be non-negative, got {self.max_worker_restarts}")
        _require(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads",
                 f"must be at least 1, got {self.cpu_threads}")
        _require(self.cpu_wait_policy in CPU_WAIT_POLICIES, "cpu_wait_policy",
                 f"must be one of {CPU_WAIT_POLICIES}, got {self.cpu_wait_policy!r}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be at least 1, got {self.tensor_parallel_size}")
        _require(self.data_parallel_size >= 1, "data_parallel_size",
                 f"must be at least 1, got {self.data_parallel_size}")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
                 f"must be at least 1, got {self.pipeline_parallel_size}")
        parse_cpu_affinity(self.cpu_affinity, self.world_size)  # ValueError if bad
        _require(self.device in DEVICES, "device",
                 f"must be one of {DEVICES}, got {self.device!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
                 f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(cpu_kernels_ok(self.cpu_kernels), "cpu_kernels",
                 f"must be one of {CPU_KERNELS}, auto optionally followed by comma-separated "
                 f"{', '.join(CPU_KERNEL_OPTIONS)}CPU; got {self.cpu_kernels!r}")
        _require(self.distributed_executor_backend in EXECUTOR_BACKENDS,
                 "distributed_executor_backend",
                 f"must be one of {EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}")
        _require(self.distributed_executor_backend != "ray"
                 or parse_cpu_affinity(self.cpu_affinity, self.tensor_parallel_size) is None,
                 "cpu_affinity", "cannot be used with distributed_executor_backend=ray (core "
                 "numbers differ between machines; Ray places each rank)")

    @property
    def world_size(self) -> int:
        """Worker processes in all: tensor_parallel_size per stage, one group per stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags and meanings; docs/lora.md)."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) beside the base model: a request names one
    (`model` over HTTP, `lora_request` in Python) and one batch mixes requests of different
    adapters and of the base model."""
    max_loras: int = 1
    """Adapters one step may use (the workers' slots of stacked adapter weights); the
    scheduler admits a request of another adapter only when a slot is free of running
    requests."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted (the slots are this wide; a smaller rank is padded
    with zeros)."""
    max_cpu_loras: int | None = None
    """Adapters each worker keeps read in host memory (least recently used first out), so
    one that comes back to a slot is not read from disk again; None: max_loras. At least
    max_loras."""

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", f"must be at least 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, "max_lora_rank",
                 f"must be at least 1, got {self.max_lora_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras", f"must be at least max_loras={self.max_loras}, got "
                 f"{self.max_cpu_loras}")

    @property
    def cpu_loras(self) -> int:
        """max_cpu_loras, resolved."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs; built once, never changed."""

    model: ModelConfig
    """What to serve."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The KV cache."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Continuous batching."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Workers."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters."""

    def __post_init__(self) -> None:
        if self.model.max_model_len is not None:
            check_lengths(self, self.model.max_model_len)
        _require(self.scheduler.draft_model is None or self.parallel.pipeline_parallel_size == 1,
                 "speculative_config.model", "(method 'draft_model') needs "
                 f"pipeline_parallel_size 1, got {self.parallel.pipeline_parallel_size}: the "
                 "draft model runs whole in every worker (not built for pipeline stages)")

    def pipeline_depth(self, device: str) -> int:
        """Plans the engine core keeps in flight with workers on `device` ("cpu", "cuda"):
        one per pipeline stage, plus one with async scheduling (the next plan is ready while
        the workers run the current ones)."""
        return self.parallel.pipeline_parallel_size + self.scheduler.async_on(device)

    def worker_config(self, rank: int, max_model_len: int, dist_init_method: str,
                      model_dir: str | None = None) -> WorkerConfig:
        """What worker `rank` (0 .. world_size - 1: stage `rank // tp`, tensor-parallel rank
        `rank % tp` in it) needs to build itself, sent once at start-up; `model_dir` is the
        folder to load (`model_files.model_folder`; None: `model.model`)."""
        p = self.parallel
        affinity = parse_cpu_affinity(p.cpu_affinity, p.world_size)
        cores = affinity[rank] if affinity is not None else None
        return WorkerConfig(
            model=model_dir or self.model.model,
            tokenizer=self.model.tokenizer,
            dtype=self.model.dtype,
            block_size=self.cache.block_size,
            max_model_len=max_model_len,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            tensor_parallel_size=p.tensor_parallel_size,
            rank=rank % p.tensor_parallel_size,
            pipeline_parallel_size=p.pipeline_parallel_size,
            stage=rank // p.tensor_parallel_size,
            dist_init_method=dist_init_method,
            device=self.parallel.device,
            gpu_memory_utilization=self.cache.gpu_memory_utilization,
            kv_cache_memory=self.cache.kv_cache_memory,
            num_kv_blocks_override=self.cache.num_kv_blocks_override,
            kv_cache_dtype=self.cache.kv_cache_dtype,
            attention_backend=self.parallel.attention_backend,
            cpu_kernels=self.parallel.cpu_kernels,
            enforce_eager=self.parallel.enforce_eager,
            seed=self.model.seed,
            cpu_threads=worker_threads(p.cpu_threads, cores, p.world_size,
                                       dict(os.environ)),
            cpu_cores=cores,
            cpu_wait_policy=p.cpu_wait_policy,
            grammar_compile_timeout=self.model.structured_outputs_compile_timeout,
            grammar_cache_bytes=self.model.structured_outputs_cache_bytes,
            runner=_runner(self, model_dir),
            max_loras=self.lora.max_loras if self.lora.enable_lora else 0,
            max_lora_rank=self.lora.max_lora_rank,
            max_cpu_loras=self.lora.cpu_loras,
            draft_model=self.scheduler.draft_model,
        )


def _runner(config: EngineConfig, model_dir: str | None) -> str:
    from .pooling import resolve_runner  # it imports this module

    return resolve_runner(config, model_dir)


def encode_engine_config(config: EngineConfig) -> str:
    """`config` as msgspec JSON: how a frontend hands its config to the daemon it starts."""
    return msgspec.json.encode(config).decode()


def decode_engine_config(text: str) -> EngineConfig:
    """The EngineConfig `encode_engine_config` wrote, every field checked again as when it
    was built; ValueError naming the field otherwise."""
    try:
        return msgspec.json.decode(text, type=EngineConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"engine config: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"engine config is not valid JSON: {e}") from None


def check_lengths(config: EngineConfig, max_model_len: int) -> None:
    """Checks that depend on the context length (ValueError naming the field)."""
    sched = config.scheduler
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than "
            f"max_model_len ({max_model_len}) with chunked prefill disabled, so a long prompt "
            "could never be scheduled; raise --max-num-batched-tokens, lower --max-model-len "
            "or enable chunked prefill")
    if sched.long_prefill_token_threshold > max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold ({sched.long_prefill_token_threshold}) must not "
            f"exceed max_model_len ({max_model_len})")


# Keys that hold a model's context length in a Hugging Face config.json, in vLLM's order;
# the smallest one present wins.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def read_model_max_len(model_dir: str) -> int:
    """The model's context length from `model_dir/config.json` (JSON only, no torch).

    Takes the smallest of the usual keys (also inside `text_config`), scaled by a `linear`
    or `yarn` rope-scaling factor as vLLM does. ValueError (naming `model`) if there is none.
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model {model_dir!r}: cannot read config.json ({e})") from e
    sources = [hf_config]
    if isinstance(hf_config.get("text_config"), dict):
        sources.append(hf_config["text_config"])
    found = [src[k] for src in sources for k in _MAX_LEN_KEYS if isinstance(src.get(k), int)]
    if not found:
        raise ValueError(f"model {model_dir!r}: config.json names no context length "
                         f"(looked for {', '.join(_MAX_LEN_KEYS)}); pass --max-model-len")
    max_len = min(found)
    rope = hf_config.get("rope_scaling")
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if rope_type in ("linear", "yarn") and isinstance(factor, (int, float)) and factor > 1:
            max_len = int(max_len * factor)
    return max_len


def resolve_max_model_len(config: EngineConfig, model_dir: str | None = None) -> int:
    """`--max-model-len` if given (ValueError if above the model's), else the model's own,
    from `model_dir` (the folder to load; None: `config.model.model`)."""
    model_dir = model_dir or config.model.model
    model_len = read_model_max_len(model_dir)
    override = config.model.max_model_len
    if override is None:
        max_model_len = model_len
    elif override > model_len:
        raise ValueError(f"max_model_len ({override}) exceeds the model's context length "
                         f"({model_len}) from {model_dir}/config.json")
    else:
        max_model_len = override
    check_lengths(config, max_model_len)
    return max_model_len
