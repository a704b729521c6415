"""Every message that crosses a process boundary in tidal.

Three conversations, each a tagged union so a decoder built for one side accepts exactly the
messages that side may receive (anything else fails to decode, is logged and dropped):

    frontend ──FrontendMessage──► engine core ──CoreToWorker──► workers (every rank)
    frontend ◄──CoreToFrontend─── engine core ◄──WorkerToCore── worker (rank 0 answers a step)

and one short-lived side conversation, whose types are in `ipc/advice.py`: after preemptions
the engine core hands the requests it saw (`PreemptionWindow`, a msgpack file) to a simulator
process (`tidal.engine_core.advice.advise`), which answers with a `PreemptionPrediction` on
stdout.

Conventions:
- Structs are `array_like=True` (positional on the wire, new fields go at the end),
  `omit_defaults=True`, `gc=False`; none of them holds a reference cycle.
- Token ids travel as little-endian int32 `bytes` (see `pack_token_ids` / `unpack_token_ids`),
  never as one Python object per token on the hot path.
- A request id (`req_id`) is a string unique within the engine core; frontends make it unique.
"""

from __future__ import annotations

import enum
import json
import sys
from array import array
from typing import Union

import msgspec

from .batch_view import BatchView
from .grammar import TOO_DEEP, compile_constraint
from .pooling import PooledOutput, PoolerInfo, PoolingParams

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)

INT32_MAX = 2**31 - 1
"""Largest token id, top_k or min_tokens a worker takes (token ids travel as int32)."""
FLOAT32_MAX = 3.4028234663852886e38
"""Largest temperature or repetition penalty a worker takes (it samples in float32)."""

# ---------------------------------------------------------------------------------------------
# token id arrays

_LITTLE = sys.byteorder == "little"


def pack_token_ids(token_ids) -> bytes:
    """Token ids (any iterable of ints, an `array('i')` or an int32 numpy array) to bytes."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return bytes(token_ids)
    if isinstance(token_ids, array) and token_ids.typecode == "i":
        arr = token_ids
    elif hasattr(token_ids, "astype") and hasattr(token_ids, "tobytes"):  # numpy array
        return token_ids.astype("<i4", copy=False).tobytes()
    else:
        arr = array("i", token_ids)
    if not _LITTLE:
        arr = array("i", arr)
        arr.byteswap()
    return arr.tobytes()


def unpack_token_ids(data: bytes) -> array:
    """Bytes from `pack_token_ids` back to an `array('i')` (supports slicing, len, tolist)."""
    arr = array("i")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr


# ---------------------------------------------------------------------------------------------
# structured output


class StructuredOutputsParams(msgspec.Struct, **_STRUCT):
    """Constrain a request's output to a grammar (vLLM's `StructuredOutputsParams`): exactly
    one of `json`, `regex`, `choice`, `grammar`, `json_object`. The worker compiles it with
    xgrammar and masks every token the grammar does not allow; the request finishes with
    "stop" on the EOS / stop token the grammar allows once it is complete.

    Checked for shape here (the engine core decodes it without xgrammar); whether it compiles
    is checked by the frontend, which has the tokenizer (ValueError naming the field).
    """

    json: str | dict | None = None
    """A JSON schema (a dict or its JSON text): the output is one JSON value it accepts."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar / GBNF syntax, the rule `root` first)."""
    json_object: bool = False
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (a model that rambles spaces cannot)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # one canonical form on the wire: the schema's text
            try:
                self.json = json.dumps(self.json)
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of json, regex, choice, grammar, json_object; got "
               f"{', '.join(given) or 'none'}")
        _check(self.choice is None or (len(self.choice) > 0 and all(
            isinstance(c, str) and c and is_valid_unicode(c) for c in self.choice)),
            "structured_outputs.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)

    @property
    def num_bytes(self) -> int:
        """The constraint's size: its schema's text, regex, grammar, or choices together
        (UTF-8 bytes), what `--structured-outputs-max-bytes` limits."""
        if self.json_object:
            return 0
        text = self.json if self.json is not None else self.regex if self.regex is not None \
            else self.grammar if self.grammar is not None else "".join(self.choice or ())
        return len(text.encode("utf-8", "surrogatepass"))

    def compile_with(self, compiler):
        """The xgrammar `CompiledGrammar` of this constraint (`grammar.compile_constraint`);
        ValueError naming the field when it does not compile."""
        return compile_constraint(self, compiler)


# ---------------------------------------------------------------------------------------------
# sampling


class SamplingParams(msgspec.Struct, **_STRUCT):
    """How to pick tokens for one request. Validated on construction and on decode.

    Defaults follow vLLM's `SamplingParams`. `temperature == 0` means greedy.
    """

    n: int = 1
    """Number of completions for the prompt; the frontend fans out n > 1 into n requests."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """Tokens generated before EOS or a stop token / stop string may end the request."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence of a token among the generated tokens."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in prompt or output (HF)."""
    stop: list[str] = []
    """Stop strings, applied by the frontend on detokenized text."""
    stop_token_ids: list[int] = []
    """Token ids that end the request (the stop token is part of the output)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token plus this many top alternatives."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    prompt_logprobs: int | None = None
    """Return, for every prompt position after the first, the log-probability of the prompt
    token there plus this many top alternatives (vLLM's semantics). Such a request does not
    read the prefix cache until they are computed (cached positions have no logits)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see the class)."""

    def __post_init__(self) -> None:
        """ValueError naming the field for a value out of range, or one the worker cannot
        hold (it keeps these in float32 / int64 arrays): the same rules run on decode, so
        a value that passes here never reaches a worker it would crash."""
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= INT32_MAX, "min_tokens",
               f"must be in [0, {INT32_MAX}], got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.temperature >= 0.0, "temperature",
               f"must be non-negative, got {self.temperature}")
        _check(self.temperature <= FLOAT32_MAX, "temperature",
               f"must be finite (at most {FLOAT32_MAX:.4g}), got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k <= INT32_MAX, "top_k",
               f"must be -1, 0 (off) or positive (at most {INT32_MAX}), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= FLOAT32_MAX, "repetition_penalty",
               f"must be positive and finite, got {self.repetition_penalty}")
        _check(all(isinstance(s, str) and s and is_valid_unicode(s) for s in self.stop),
               "stop", "must be non-empty strings of valid Unicode (no lone surrogates)")
        _check(all(0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
               f"must be token ids in [0, {INT32_MAX}]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
               "must fit in a signed 64-bit integer")
        _check(self.structured_outputs is None or not self.ignore_eos or self.stop_token_ids,
               "ignore_eos", "cannot be set with structured_outputs unless stop_token_ids "
               "are given: a complete grammar ends the request on EOS or a stop token")
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
               "cannot be set with structured_outputs: the grammar decides where the output "
               "ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


def is_valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON may escape one, "\\ud800"): no
    tokenizer can encode it and msgpack cannot carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_priority(priority: int, scheduling_policy: str) -> None:
    """ValueError for a priority other than 0 under the fcfs policy (vLLM refuses it too:
    the request would be scheduled as if it had none). Frontends check before sending; the
    engine core checks again."""
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority {priority} needs --scheduling-policy priority; this engine "
                         "schedules fcfs, where every request's priority must be 0")


# ---------------------------------------------------------------------------------------------
# frontend ⇄ engine core


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


class LoRARequest(msgspec.Struct, **_STRUCT):
    """A LoRA adapter a request runs with (vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`): a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) that
    every worker reads itself, so only the path crosses the wire, never tensors. The id names
    the adapter in the engine core (its slots, the prefix cache) and must be at least 1; one
    id always means one (name, path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        _check(isinstance(self.lora_name, str) and self.lora_name != "", "lora_request",
               "lora_name must be a non-empty string")
        _check(1 <= self.lora_int_id <= INT32_MAX, "lora_request",
               f"lora_int_id must be in [1, {INT32_MAX}], got {self.lora_int_id}")
        _check(isinstance(self.lora_path, str) and self.lora_path != "", "lora_request",
               "lora_path must be a non-empty path to a PEFT adapter folder")


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


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probabilities at one position: the sampled token first, then the top alternatives.

    `token_ids` is packed int32, `logprobs` packed float32; `sampled_rank` is the sampled
    token's rank in the distribution (1 = the most likely).
    """

    token_ids: bytes
    logprobs: bytes
    sampled_rank: int = 1


class PromptLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probabilities of the prompt tokens at positions [start, start + num_positions) of
    one request, each from the model's distribution after the tokens before it.

    Row i is position start + i: `token_ids` (packed int32) and `logprobs` (packed float32)
    hold `1 + num_logprobs` entries per row, the prompt token first, then the top
    alternatives, most likely first; `ranks` (packed int32) is the prompt token's rank in the
    distribution (1 = the most likely). Position 0 has no distribution and never appears.
    """

    req_id: str
    start: int
    num_logprobs: int
    token_ids: bytes
    logprobs: bytes
    ranks: bytes

    @property
    def num_positions(self) -> int:
        return len(self.ranks) // 4


def join_prompt_logprobs(parts: list[PromptLogprobs]) -> PromptLogprobs:
    """Consecutive parts of one request (each starting where the previous ends) as one."""
    first = parts[0]
    if len(parts) == 1:
        return first
    return PromptLogprobs(first.req_id, first.start, first.num_logprobs,
                          b"".join(p.token_ids for p in parts),
                          b"".join(p.logprobs for p in parts), b"".join(p.ranks for p in parts))


def drop_prompt_positions(part: PromptLogprobs, num_rows: int) -> PromptLogprobs:
    """The part without its first `num_rows` positions."""
    width = 4 * (1 + part.num_logprobs)
    return PromptLogprobs(part.req_id, part.start + num_rows, part.num_logprobs,
                          part.token_ids[num_rows * width:], part.logprobs[num_rows * width:],
                          part.ranks[num_rows * 4:])


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


# ---------------------------------------------------------------------------------------------
# engine core ⇄ workers


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
