"""The engine core ⇄ workers conversation (`ipc/messages.py` has the overview and the
conventions): what the engine core sends every rank (`CoreToWorker`) and what ranks answer
(`WorkerToCore`); a `WorkerConfig` travels once, on the worker's command line."""

from __future__ import annotations

from typing import Union

import msgspec

from .messages import (
    LoRARequest,
    PromptLogprobs,
    SamplingParams,
    StructuredOutputsParams,
    TokenLogprobs,
)
from .pooling import PooledOutput, PoolingParams

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


class WorkerConfig(msgspec.Struct, **_STRUCT):
    """Everything a worker needs to build its rank; sent once at start-up. Built only by
    `EngineConfig.worker_config` (engine_core/config.py), so every default lives there: no
    field has one here."""

    model: str  # a local Hugging Face folder
    dtype: str  # auto | float32 | bfloat16 | float16 | float64
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    rank: int  # tensor-parallel rank within the stage
    pipeline_parallel_size: int
    stage: int  # pipeline stage: this worker runs that stage's contiguous run of layers
    dist_init_method: str  # torch.distributed init, e.g. tcp://127.0.0.1:PORT ("": none)
    device: str  # auto | cpu | cuda
    gpu_memory_utilization: float
    kv_cache_memory: int | None  # bytes of KV cache per rank (CPU), None = default
    num_kv_blocks_override: int | None  # tests: force this many blocks
    kv_cache_dtype: str  # auto | int8 | fp8 (CacheConfig.kv_cache_dtype)
    attention_backend: str  # auto | numba | torch | triton | reference
    cpu_kernels: str  # the CPU op seam's choice (ParallelConfig.cpu_kernels)
    enforce_eager: bool
    seed: int
    cpu_threads: int | None  # OpenMP threads of this rank (None: the environment's)
    cpu_cores: list[int] | None  # cores this rank is pinned to (None: not pinned)
    cpu_wait_policy: str  # ParallelConfig.cpu_wait_policy: auto | spin | passive
    tokenizer: str | None  # structured output's tokenizer folder (None: `model`)
    grammar_compile_timeout: float  # ModelConfig.structured_outputs_compile_timeout
    grammar_cache_bytes: int  # ModelConfig.structured_outputs_cache_bytes
    runner: str  # generate | pooling (no LM head, vectors instead of tokens: workers/pooling.py)
    max_loras: int  # LoRAConfig: adapter slots per step (0: LoRA off)
    max_lora_rank: int  # the largest adapter rank the slots hold
    max_cpu_loras: int  # adapters each worker keeps read in host memory (LRU)
    draft_model: str | None  # speculative draft_model: the draft's folder (workers/drafter.py)

    @property
    def worker_index(self) -> int:
        """This worker among all of them, stage-major: stage * tensor_parallel_size + rank
        (its torch.distributed rank, and the rank it reports in WorkerReady/WorkerFailed)."""
        return self.stage * self.tensor_parallel_size + self.rank

    @property
    def reports_tokens(self) -> bool:
        """Whether this worker answers each plan with SampledTokens: tensor-parallel rank 0
        of the last pipeline stage (the one that samples)."""
        return self.rank == 0 and self.stage == self.pipeline_parallel_size - 1


class NewRequestData(msgspec.Struct, **_STRUCT):
    """A request this worker has not seen (first scheduling, or resumed after preemption).

    `token_ids` is every known token (prompt, then any generated before a preemption).
    `num_computed_tokens` are already in the KV cache (prefix-cache hit).
    """

    req_id: str
    token_ids: bytes
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    eos_token_id: int | None = None
    """The model's EOS token: masked while fewer than `sampling.min_tokens` are generated."""
    num_resumed_tokens: int = 0
    """The last N of the `prompt_len` tokens count as output for penalties (see AddRequest)."""
    lora_int_id: int = 0
    """The LoRA adapter it runs with (0: the base model); resident in a slot the engine core
    gave it (`BatchPlan.lora_slots` of this plan or an earlier one)."""
    pooling: PoolingParams | None = None
    """A pooling request, resolved (every field set): pooled when its prompt is computed."""


class CachedRequestData(msgspec.Struct, **_STRUCT):
    """A delta for a request the worker already holds in its persistent batch.

    With one pipeline stage the worker appends the token it sampled last step itself (sync
    and async alike), so no token ids travel here; only blocks added this step and the token
    count. With several stages only the last one samples, so the engine core sends the
    tokens the workers lack in `new_token_ids` (packed int32; it schedules a request again
    only once its sampled token is back, so these are always known).
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_token_ids: bytes = b""
    spec_token_ids: bytes = b""
    """Speculative decoding: draft tokens (packed int32) after the request's known tokens,
    the last of `num_scheduled_tokens` (which counts them). The reporting worker verifies
    them and answers with 1 + accepted tokens; no rank keeps them past this step."""
    num_model_drafts: int = 0
    """Speculative decoding with a draft model: every rank makes this many drafts itself
    with the draft model (`workers/drafter.py`) and puts them where `spec_token_ids` would
    have put them; they too are the last of `num_scheduled_tokens`."""


class GrammarToCompile(msgspec.Struct, **_STRUCT):
    """A constrained request's grammar, for every rank to compile in the background before
    the request is first scheduled (see `BatchPlan.grammars`)."""

    req_id: str
    spec: StructuredOutputsParams


class LoRASlot(msgspec.Struct, **_STRUCT):
    """Engine core -> every rank: put this adapter in slot `slot` (0 .. max_loras - 1) before
    the step runs, replacing whatever the slot held. The worker reads the PEFT folder itself
    (or takes it from its host-memory LRU of max_cpu_loras adapters)."""

    slot: int
    lora: LoRARequest


class BatchPlan(msgspec.Struct, tag="plan", **_STRUCT):
    """One step, broadcast to every rank.

    Layout of the batch: `new_requests` then `cached_requests`, in that order. For each,
    tokens [num_computed_tokens, num_computed_tokens + num_scheduled_tokens) are computed;
    a token is sampled for a request when that range reaches the end of its known tokens.
    `finished_req_ids` and `preempted_req_ids` are dropped from the persistent batch before
    this step runs (a finished id may also name a request whose grammar was only compiled).

    Grammars compile off the step path, as in vLLM: a constrained request is sent once in
    `grammars`, every rank compiles it on a thread of its own while the batch goes on, and
    the engine core schedules the request only once the reporting rank lists it in
    `SampledTokens.grammars_ready` (or fails it, listed in `failed`).
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    total_num_scheduled_tokens: int = 0
    grammars: list[GrammarToCompile] = []
    """Grammars to start compiling (each request's once, and again for new workers)."""
    awaits_grammars: bool = False
    """Requests wait for a grammar compile: a plan with nothing else to run is sent anyway,
    and a worker with nothing to compute waits a moment (at most 50 ms) for a compile to end
    before it answers, so the engine core polls without spinning."""
    lora_slots: list[LoRASlot] = []
    """Adapters to load into slots before this step (the engine core decides residency: every
    adapter of a request in this plan is resident once these are applied)."""


class InitKVCache(msgspec.Struct, tag="init_kv", **_STRUCT):
    """Engine core → every rank, after the handshake: allocate this many KV blocks."""

    num_blocks: int


class Shutdown(msgspec.Struct, tag="shutdown", **_STRUCT):
    """Engine core → every rank: exit now."""


CoreToWorker = Union[BatchPlan, InitKVCache, Shutdown]


class WorkerReady(msgspec.Struct, tag="ready", **_STRUCT):
    """Each rank → engine core after loading: how many KV blocks fit on this rank."""

    rank: int
    num_kv_blocks: int
    max_model_len: int
    device: str = "cpu"
    load_seconds: float = 0.0
    vocab_size: int = 0  # rows of the model's embedding: valid token ids are [0, vocab_size)
    sliding_window: int = 0
    """The attention window every layer on this rank shares (0: some layer attends globally,
    or none has a window): the engine core frees a request's blocks that fall out of it."""


class RequestFailure(msgspec.Struct, **_STRUCT):
    """A request the workers refused to run because its own data was bad (defence in depth:
    the engine core checks first). It fails alone; the worker and the rest of the batch go on."""

    req_id: str
    error: str  # starts with the field's name


class SampledTokens(msgspec.Struct, tag="sampled", **_STRUCT):
    """Rank 0 → engine core: the tokens sampled in one step.

    Only requests that sampled this step are listed (a prefill chunk that does not reach the
    end of the prompt samples nothing). `token_ids` is packed int32, one per listed request
    (several for a request that verified drafts: see `num_tokens`).
    `logprobs[i]` is set only for requests that asked for them. `failed`: requests of this
    step's plan that the workers refused (every rank refuses the same ones) and dropped.
    `prompt_logprobs`: for each request that asked for them and computed prompt positions
    this step (sampling or not), the positions whose distribution this step produced.
    """

    step_id: int
    req_ids: list[str]
    token_ids: bytes
    logprobs: list[TokenLogprobs | None] | None = None
    failed: list[RequestFailure] = []
    prompt_logprobs: list[PromptLogprobs] = []
    grammars_ready: list[str] = []
    """Requests whose grammar (`BatchPlan.grammars`) finished compiling since the last answer;
    one that failed to compile (or ran past the compile timeout) is in `failed` instead."""
    pooled: list[PooledOutput] = []
    """Pooling requests whose last prompt token was computed this step, with their vectors
    (not in `req_ids`: nothing was sampled for them)."""
    num_tokens: bytes = b""
    """Speculative decoding: how many of `token_ids` each listed request has (packed int32,
    1 + its accepted drafts), in `req_ids` order; empty when every request has one."""


class WorkerFailed(msgspec.Struct, tag="failed", **_STRUCT):
    """A rank hit an exception it cannot recover from; the engine core fails in-flight work."""

    rank: int
    error: str


WorkerToCore = Union[WorkerReady, SampledTokens, WorkerFailed]
