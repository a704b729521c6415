"""A request as the engine core sees it: token ids, one progress counter, a status.

There is no prefill or decode phase. `num_computed_tokens` chases `num_tokens` (prompt plus
generated): chunked prefill, prefix-cache hits and recompute after preemption all fall out of
that one counter. With async scheduling a sampled token may be in flight (scheduled, not yet
known to the engine core); those are counted in `num_output_placeholders`:

    all_token_ids:  [ prompt ........... | generated (known) ] [ in flight ]
                    0                 prompt_len          num_tokens   num_tokens + placeholders
    num_computed_tokens: tokens whose KV is computed or scheduled (advanced at schedule time)
"""

from __future__ import annotations

import enum
import math

from ..ipc.frontend_messages import AddRequest, FinishReason
from ..ipc.grammar import check_structured_outputs
from ..ipc.messages import (
    INT32_MAX,
    LoRARequest,
    PromptLogprobs,
    SamplingParams,
    check_priority,
    unpack_token_ids,
)
from ..ipc.pooling import PoolerInfo, PoolingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; everything after PREEMPTED is finished."""

    WAITING_FOR_GRAMMAR = 0  # its structured-output grammar compiles on the workers
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    def is_finished(self) -> bool:
        """True for the four finished states."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The wire reason of a finished status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation request inside the engine core (mutable; owned by the scheduler)."""

    __slots__ = (
        "req_id", "client_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_output_placeholders", "sampling",
        "eos_token_id", "stop_token_ids", "min_tokens", "max_tokens", "priority",
        "arrival_time", "arrival_seq", "cache_salt", "status", "stop_reason", "block_hashes",
        "num_cached_tokens", "num_preemptions", "discard_before_step", "in_worker",
        "grammar_sent",
        "num_worker_tokens",
        "first_output_sent", "error", "add_time", "queue_time", "prompt_logprob_parts",
        "next_prompt_logprob", "num_resumed_tokens", "first_token_time", "finish_time",
        "lora", "pooling", "num_drafts_in_flight", "draft_match",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        client_id: str = "",
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.req_id = req_id
        """Unique within the engine core (frontends make it so)."""
        self.client_id = client_id
        """The frontend that sent the request; its outputs go back there."""
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        """Generated tokens known to the engine core (never placeholders)."""
        self.all_token_ids = list(self.prompt_token_ids)
        """Prompt then generated tokens; `len(all_token_ids) == num_tokens`."""
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose KV is computed or scheduled; reset to 0 by preemption."""
        self.num_output_placeholders = 0
        """Sampled tokens in flight (scheduled steps whose result has not arrived)."""
        self.sampling = sampling
        self.eos_token_id = None if sampling.ignore_eos else eos_token_id
        """The EOS token that stops the request (None with ignore_eos)."""
        self.stop_token_ids = frozenset(sampling.stop_token_ids)
        self.min_tokens = sampling.min_tokens
        self.max_tokens = sampling.max_tokens
        """Most tokens to generate; the scheduler caps it by the context length on add()."""
        self.priority = priority
        """Lower runs first under the priority policy."""
        self.arrival_time = arrival_time
        self.arrival_seq = 0
        """Order of add() calls, set by the scheduler; breaks arrival-time ties."""
        self.cache_salt = cache_salt
        """Mixed into the first block's hash: only requests with the same salt share KV."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        """The stop token id that ended the request, if one did."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of the full blocks of `all_token_ids` (filled lazily)."""
        self.num_cached_tokens = 0
        """Prefix-cache hit (tokens) at the first admission."""
        self.num_preemptions = 0
        self.discard_before_step = 0
        """Results of steps with a smaller step_id are stale (planned before a preemption)."""
        self.in_worker = False
        """The workers hold this request in their persistent batch."""
        self.grammar_sent = False
        """The workers were sent its grammar to compile (`BatchPlan.grammars`) and keep it
        until they are told the request finished."""
        self.num_worker_tokens = 0
        """Tokens the workers were sent (pipeline parallelism: the rest travel in the next
        plan, since only the last stage samples)."""
        self.first_output_sent = False
        self.error: str | None = None
        self.add_time = 0.0
        """Scheduler clock at add()."""
        self.first_token_time = 0.0
        """Scheduler clock when its first generated token came back (0 before)."""
        self.finish_time = 0.0
        """Scheduler clock when it finished (0 before)."""
        self.queue_time: float | None = None
        """Seconds from add() to the first admission."""
        self.prompt_logprob_parts: list[PromptLogprobs] | None = (
            [] if sampling.prompt_logprobs is not None else None)
        """Prompt logprobs received so far, in position order, until the first output
        carries them (then None: nothing more is wanted)."""
        self.next_prompt_logprob = 1
        """The first prompt position whose logprobs have not arrived yet."""
        self.num_resumed_tokens = num_resumed_tokens
        """The prompt's last tokens that an earlier core generated (penalties count them as
        output; see AddRequest)."""
        self.lora = lora
        """The LoRA adapter it runs with (None: the base model); part of its block hashes."""
        self.num_drafts_in_flight = 0
        """Speculative decoding: draft tokens scheduled in a step whose result has not come
        back (then `num_computed_tokens` counts them too, and the request is not scheduled
        again until it is back)."""
        self.draft_match = 0
        """The length of the match those drafts were proposed from (`proposers.Draft.match`): the
        policy learns acceptance per match length."""
        self.pooling = pooling
        """An embedding request's pooling (resolved by `check_pooling`): it finishes when its
        prompt is computed, with the vector the workers pooled (`SampledTokens.pooled`)."""

    @classmethod
    def from_add(cls, msg: AddRequest, client_id: str) -> Request:
        """Build from the wire message a frontend sent (ValueError if the prompt is not
        packed int32)."""
        if len(msg.prompt_token_ids) % 4:
            raise ValueError(f"prompt_token_ids must be packed int32 (a multiple of 4 bytes), "
                             f"got {len(msg.prompt_token_ids)} bytes")
        return cls(
            msg.req_id,
            unpack_token_ids(msg.prompt_token_ids).tolist(),
            msg.sampling,
            client_id=client_id,
            eos_token_id=msg.eos_token_id,
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            cache_salt=msg.cache_salt,
            num_resumed_tokens=msg.num_resumed_tokens,
            lora=msg.lora_request,
            pooling=msg.pooling,
        )

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated."""
        return len(self.all_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Its prompt logprobs are still to come: cached positions would have no logits, so it
        computes its whole prompt (vLLM's rule). Likewise a MEAN or CLS pooling request, whose
        vector needs the hidden states of cached positions too (LAST needs only the last
        token's, which is always computed)."""
        return self.prompt_logprob_parts is not None or (
            self.pooling is not None and self.pooling.pooling_type != "LAST")

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.name}, computed="
                f"{self.num_computed_tokens}/{len(self.all_token_ids)}, "
                f"placeholders={self.num_output_placeholders})")


def check_request(request: Request, vocab_size: int, scheduling_policy: str = "fcfs",
                  structured_outputs_max_bytes: int = 128 * 2**10) -> None:
    """ValueError naming the field of a request the workers could not run.

    Any process that reaches the engine socket can send an AddRequest, so nothing a worker
    indexes or converts is trusted: prompt token ids must be in the model's vocabulary
    (`vocab_size`, reported by the workers at start-up); EOS, like the stop token ids
    (checked by SamplingParams), must be an int32 id (an id outside the vocabulary is never
    sampled, so it is harmless); `n` must be 1 (frontends send one request per completion);
    logprobs and prompt logprobs may not ask for more alternatives than the vocabulary
    holds; a priority other than 0 needs the priority policy (as vLLM refuses it); a
    structured-output constraint must be within `structured_outputs_max_bytes` and have a
    token to stop on (`check_structured_outputs`). SamplingParams has checked its own ranges
    on decode.
    """
    ids = request.prompt_token_ids
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt_token_ids contains token id {bad}, outside the vocabulary "
                         f"[0, {vocab_size})")
    eos = request.eos_token_id
    if eos is not None and not 0 <= eos <= INT32_MAX:
        raise ValueError(f"eos_token_id must be a token id in [0, {INT32_MAX}], got {eos}")
    sampling = request.sampling
    if sampling.n != 1:
        raise ValueError(f"n must be 1 in an AddRequest (a frontend sends one request per "
                         f"completion), got {sampling.n}")
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(sampling, field)
        if value is not None and value > vocab_size:
            raise ValueError(f"{field} must be at most the vocabulary size {vocab_size}, got "
                             f"{value}")
    if not 0 <= request.num_resumed_tokens < request.num_prompt_tokens:
        raise ValueError(f"num_resumed_tokens must be in [0, {request.num_prompt_tokens}) (the "
                         f"prompt's own tokens come first), got {request.num_resumed_tokens}")
    check_priority(request.priority, scheduling_policy)
    check_structured_outputs(sampling, request.eos_token_id, structured_outputs_max_bytes)
    if not math.isfinite(request.arrival_time):
        raise ValueError(f"arrival_time must be a finite number, got {request.arrival_time}")



def check_pooling(request: Request, pooler: PoolerInfo | None) -> None:
    """An embedding engine (`pooler`) takes only pooling requests, a generating one none
    (vLLM's runners); a pooling request's unset fields take the engine's defaults
    (`PoolerInfo.resolve`: ValueError naming `dimensions` the model does not allow) and it
    samples nothing: max_tokens 1 stands for the vector."""
    if pooler is None:
        if request.pooling is not None:
            raise ValueError("pooling: this engine generates text (--runner generate); it "
                             "takes no embedding requests")
        return
    if request.pooling is None:
        raise ValueError("pooling: this engine runs an embedding model (--runner pooling); "
                         "it takes only embedding requests")
    request.pooling = pooler.resolve(request.pooling)
    request.max_tokens = 1
