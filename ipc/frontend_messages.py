"""The frontend ⇄ engine core conversation (`ipc/messages.py` has the overview and the
conventions): what a frontend sends (`FrontendMessage`) and what the engine core answers
(`CoreToFrontend`). The DP router speaks it on both of its sides."""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from .batch_view import BatchView
from .messages import LoRARequest, PromptLogprobs, SamplingParams, TokenLogprobs
from .pooling import PoolerInfo, PoolingParams

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


class FinishReason(enum.IntEnum):
    """Why a request ended; `str(reason)` gives the OpenAI / vLLM string."""

    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # aborted by the client or the frontend
    ERROR = 3  # the engine failed this request (a worker died, say)

    def __str__(self) -> str:
        return self.name.lower()


class Hello(msgspec.Struct, tag="hello", **_STRUCT):
    """First message of a frontend on its socket: who it is."""

    client_id: str
    kind: str = "python"  # "python", "http", or "router" (the data-parallel router)
    pid: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat", **_STRUCT):
    """Sent by a frontend every few seconds; a silent frontend's requests are aborted. The
    engine core echoes each one back (the same message), so a frontend that hears nothing
    from the core for `EngineInfo.frontend_timeout` seconds takes it as stopped or hung."""

    client_id: str


class Goodbye(msgspec.Struct, tag="goodbye", **_STRUCT):
    """A frontend detaches cleanly; its unfinished requests are aborted."""

    client_id: str


class AddRequest(msgspec.Struct, tag="add", **_STRUCT):
    """A new request. `prompt_token_ids` is packed int32 (see `pack_token_ids`)."""

    req_id: str
    prompt_token_ids: bytes
    sampling: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None
    num_resumed_tokens: int = 0
    """The prompt's last N tokens were generated for this completion by an engine core that
    was lost (a frontend's or router's resubmission): presence and frequency penalties count
    them as output, and a structured output's grammar replays them, as on the first core."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter to run with (None: the base model); needs --enable-lora."""
    pooling: PoolingParams | None = None
    """An embedding request (`ipc/pooling.py`): its prompt is pooled into one vector when its
    last token is computed, nothing is sampled (`sampling.max_tokens` is 1); only an engine
    with `EngineInfo.pooler` takes one, and only such requests."""


class Abort(msgspec.Struct, tag="abort", **_STRUCT):
    """Abort these requests (idempotent: unknown or finished ids are ignored)."""

    req_ids: list[str]


class StatsQuery(msgspec.Struct, tag="stats_query", **_STRUCT):
    """Ask the engine core for a `SchedulerStats` snapshot right now."""

    client_id: str
    view_since: int = -1
    """With 0 or more: also the live batch view (`SchedulerStats.view`) with the steps after
    step id `view_since` (`ipc/batch_view.py`); -1: the counters only."""


FrontendMessage = Union[Hello, Heartbeat, Goodbye, AddRequest, Abort, StatsQuery]


class EngineCoreOutput(msgspec.Struct, **_STRUCT):
    """What happened to one request in one step: only the new tokens (a delta)."""

    req_id: str
    new_token_ids: bytes
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at admission, in tokens
    error: str | None = None  # with FinishReason.ERROR: what went wrong
    queue_time: float | None = None  # first output only: seconds from add() to first scheduled
    refused: bool = False
    """With FinishReason.ERROR: the request itself was bad (a token id outside the vocabulary,
    a value a worker cannot hold) and never ran; `error` starts with the field's name. A
    client error: frontends raise ValueError / answer HTTP 400, not 500."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the first output with a token, when `sampling.prompt_logprobs` was set: every
    prompt position from 1 on, in one piece (empty for a one-token prompt)."""
    pooled: bytes | None = None
    """A pooling request's vector (little-endian float32), on its one output (finish_reason
    STOP, no token)."""


class SchedulerStats(msgspec.Struct, **_STRUCT):
    """A snapshot of the engine core; counters are totals since start-up."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use, 0..1
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0  # tokens computed for prompts (prefill), total
    generation_tokens: int = 0  # tokens sampled, total
    num_steps: int = 0
    preempted_prefix_cache_queries: int = 0  # tokens looked up when preempted requests resume
    preempted_prefix_cache_hits: int = 0  # their hits (mostly their own blocks), kept apart
    num_worker_restarts: int = 0  # times the core replaced its workers after a failure
    queued_prompt_tokens: int = 0
    """Prompt tokens of unfinished requests that have no generated token yet (waiting, or in
    prefill): what --max-num-queued-tokens limits."""
    # --max-queue-delay: a new request's estimated seconds to its first token are
    # est_queue_delay_s + its prompt tokens * est_s_per_prompt_token
    # (engine_core/advice/queue_estimate.py)
    est_queue_delay_s: float = 0.0
    est_s_per_prompt_token: float = 0.0
    est_s_per_queued_request: float = 0.0
    cores: list[SchedulerStats] = []
    """With data parallelism (the router's answer): each engine core's own snapshot, in core
    order; the fields above are then the whole server's. Empty from a single core."""
    view: BatchView | None = None
    """The live batch view, when the `StatsQuery` asked for it (with data parallelism, in
    each of `cores`)."""
    # speculative decoding (engine_core/spec_decode.py), vLLM's spec_decode counters
    spec_num_drafts: int = 0  # steps in which a request verified drafts
    spec_num_draft_tokens: int = 0  # draft tokens verified
    spec_num_accepted_tokens: int = 0  # draft tokens the target model accepted
    spec_accepted_per_pos: list[int] = []
    """Accepted drafts at each draft position (0 = the first), up to num_speculative_tokens."""


class EngineOutputs(msgspec.Struct, tag="outputs", **_STRUCT):
    """One step's outputs for one frontend."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineInfo(msgspec.Struct, tag="info", **_STRUCT):
    """The engine core's answer to `Hello`: what a frontend needs to know."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    stream_interval: int = 1
    max_num_queued_reqs: int | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    vocab_size: int = 0
    """Prompt token ids must be in [0, vocab_size): the model's, as the workers found it."""
    heartbeat_interval: float = 1.0
    """Seconds between two Heartbeats of the frontend (a quarter of --frontend-timeout, at
    most 1 s), so that a short timeout still tolerates a late beat or two."""
    scheduling_policy: str = "fcfs"
    """fcfs or priority; under fcfs a request's priority must be 0."""
    max_num_queued_tokens: int | None = None
    max_queue_delay: float | None = None
    """Seconds: frontends answer 503 when a new request's estimated time to first token (from
    `SchedulerStats.est_*`) exceeds it; None = off."""
    frontend_timeout: float = 10.0
    """The core's --frontend-timeout, both ways: a frontend silent this long is dropped, and a
    core that echoes no heartbeat for this long is taken by its frontends as stopped or hung."""
    structured_outputs_max_bytes: int = 128 * 2**10
    structured_outputs_compile_timeout: float = 10.0
    structured_outputs_cache_bytes: int = 512 * 2**20
    """The core's structured-output limits (`ModelConfig`), which frontends apply first."""
    max_lora_rank: int = 0
    """--max-lora-rank with --enable-lora (frontends check an adapter's folder against it
    before sending a request of it); 0: LoRA off, requests with an adapter are refused."""
    pooler: PoolerInfo | None = None
    """Set when the engine runs an embedding model (`--runner pooling`): it takes only
    pooling requests (`AddRequest.pooling`); None: it only generates."""


class EngineDead(msgspec.Struct, tag="dead", **_STRUCT):
    """The engine core is shutting down or failed; every unfinished request is over."""

    reason: str


class Detached(msgspec.Struct, tag="detached", **_STRUCT):
    """The engine core does not (or no longer) know this frontend: it dropped it after
    --frontend-timeout of silence, or it is a new core at the old address. Every request of
    the frontend that the core knew got an ERROR output first; a frontend that wants to go on
    says Hello again."""

    reason: str


CoreToFrontend = Union[EngineOutputs, EngineInfo, EngineDead, Detached, Heartbeat]
