"""From the engine core's token deltas to user-facing `RequestOutput`s.

One `OutputProcessor` per frontend holds the state of every request that frontend has in
flight. A user request ("parent") with `n` completions is sent to the engine core as `n`
engine requests ("children"): `n == 1` uses the parent's engine id itself, `n > 1` uses
`"{i}_{parent_engine_id}"` for completion `i`, each with `n = 1` and, when the parent has a
seed, seed `seed + i` (vLLM's rule) so the completions differ but stay reproducible.

Per completion, for every new token id (in order):

    token_ids.append(id)   ->  text += detokenizer.step(id)   (a stop token's own text is
                               left out unless include_stop_str_in_output)
    if len(token_ids) > min_tokens: search the stop strings in the new characters plus a
                               look-back of max(len(stop)) - 1 characters (a stop string
                               split across tokens is found when its last piece arrives)
    on a match:            ->  text truncated at the stop string (or just after it with
                               include_stop_str_in_output), finish_reason "stop",
                               stop_reason = the string, later tokens of the same message
                               dropped, and the engine request is returned in
                               `reqs_to_abort` so the caller tells the core to stop it.

A request the engine core refused (`refused`: bad input, the error names the field) is
dropped at once with all its completions and reported in `ProcessedOutputs.refused`, for the
caller to raise as a ValueError rather than deliver as an output.

Emission (streaming): a completion is reported on its first token, when it finishes, and
otherwise once `stream_interval` tokens have accumulated since its last report. With stop
strings (and not include_stop_str_in_output) the last `max(len(stop)) - 1` characters are held
back until the completion finishes, so a partial stop string is never shown. A "final only"
request (LLM.generate) is reported once, when all n completions are finished.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import msgspec

from .detokenizer import IncrementalDetokenizer, decode_token
from .outputs import (
    CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestMetrics,
    RequestOutput,
)
from ..ipc.frontend_messages import AddRequest, EngineCoreOutput, FinishReason
from ..ipc.messages import (
    LoRARequest,
    PromptLogprobs,
    SamplingParams,
    TokenLogprobs,
    pack_token_ids,
    unpack_token_ids,
)
from ..ipc.pooling import PoolingParams, unpack_floats
from ..ipc.resume import lost_finish, resume_params


@dataclass
class _Completion:
    """State of one engine request (one of the parent's n completions)."""

    index: int
    req_id: str  # the engine request id (a new one on each resubmission)
    params: SamplingParams  # as sent to the engine core (n == 1)
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # full detokenized text (truncated at a matched stop string)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # what the last report already carried
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_unsent_tokens: int = 0  # tokens since the last report (stream interval)
    reported: bool = False
    # metrics
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_req_id: str = ""  # the engine id it was first sent under
    queue_time: float | None = None
    num_cached_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    pooled: bytes | None = None  # a pooling request's vector (float32), once it came

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    """State of one user request and its completions."""

    request_id: str  # the caller's id
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    final_only: bool  # report once, at the end, with all completions
    stream_interval: int
    stop_buffer_len: int  # characters held back while streaming (partial stop strings)
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None  # as sent with the AddRequest
    num_resubmits: int = 0  # times sent again to a new engine core
    wants_prompt_logprobs: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # from completion 0
    lora_request: LoRARequest | None = None  # as sent with the AddRequest
    pooling: PoolingParams | None = None  # an embedding request: one vector, no tokens

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Completion 0 will bring them with its first token: until then no completion is
        reported, so every update a user sees carries them (a completion 0 that ends
        without a token, aborted or failed, brings none)."""
        return (self.wants_prompt_logprobs and self.prompt_logprobs is None
                and not self.completions[0].finished)


@dataclass
class ProcessedOutputs:
    """What one batch of engine outputs turned into."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    """User-facing updates, at most one per parent request (its changed completions)."""
    reqs_to_abort: list[str] = field(default_factory=list)
    """Engine request ids stopped by a stop string here: tell the engine core to abort them."""
    refused: dict[str, str] = field(default_factory=dict)
    """request_id -> error, for requests the engine core refused (forgotten here already)."""


def child_params(params: SamplingParams, index: int, max_tokens: int) -> SamplingParams:
    """The engine-side params of completion `index`: n = 1, seed + index, capped lengths;
    only completion 0 asks for the prompt logprobs (they are the prompt's, not its own)."""
    seed = params.seed if params.seed is None else params.seed + index
    if seed is not None and seed >= 2**63:  # wrap, keeping it a signed 64-bit integer
        seed -= 2**64
    return msgspec.structs.replace(
        params, n=1, seed=seed, max_tokens=max_tokens,
        min_tokens=min(params.min_tokens, max_tokens),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class OutputProcessor:
    """Per-request detokenization, stop strings, n > 1 merging and stream intervals."""

    def __init__(self, tokenizer, eos_token_id: int | None = None,
                 extra_stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        # generation_config.json may list several EOS ids; all but the first act as stop ids
        self.extra_stop_token_ids = list(extra_stop_token_ids or [])
        self._parents: dict[str, _Parent] = {}  # request_id -> parent
        self._children: dict[str, tuple[_Parent, _Completion]] = {}  # engine req_id -> both
        self.num_unknown_outputs = 0  # outputs for ids not in flight here (late, or misrouted)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob entries)

    # -- registration ---------------------------------------------------------------------

    def add_request(self, request_id: str, engine_req_id: str, prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    *, priority: int = 0, final_only: bool = False, stream_interval: int = 1,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None,
                    pooling: PoolingParams | None = None) -> list[AddRequest]:
        """Register a request; return the AddRequest message(s) to send to the engine core.

        `max_tokens` (None = up to the context length) is capped at
        `max_model_len - len(prompt_token_ids)`, as vLLM's default is. With `pooling` (an
        embedding request: `params` is SamplingParams(max_tokens=1), `final_only`) the
        request's one update is an `EmbeddingRequestOutput`.
        """
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        room = max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_buffer = 0
        if params.stop and not params.include_stop_str_in_output:
            stop_buffer = max(len(s) for s in params.stop) - 1
        parent = _Parent(request_id, prompt, list(prompt_token_ids), [], final_only,
                         max(1, stream_interval), stop_buffer, arrival_time, priority,
                         self.eos_token_id,
                         wants_prompt_logprobs=params.prompt_logprobs is not None,
                         lora_request=lora_request, pooling=pooling)
        if pooling is not None:
            max_tokens = 1  # the vector; a prompt may fill the context
        packed_prompt = pack_token_ids(prompt_token_ids)
        messages = []
        for i in range(params.n):
            req_id = engine_req_id if params.n == 1 else f"{i}_{engine_req_id}"
            sent = child_params(params, i, max_tokens)
            if self.extra_stop_token_ids and not sent.ignore_eos:
                extra = [t for t in self.extra_stop_token_ids if t not in sent.stop_token_ids]
                sent = msgspec.structs.replace(sent, stop_token_ids=sent.stop_token_ids + extra)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           params.skip_special_tokens)
            comp = _Completion(i, req_id, sent, detok, first_req_id=req_id)
            if params.logprobs is not None:
                comp.logprobs, comp.cumulative_logprob = [], 0.0
            parent.completions.append(comp)
            messages.append(AddRequest(req_id, packed_prompt, sent, self.eos_token_id,
                                       priority, arrival_time, lora_request=lora_request,
                                       pooling=pooling))
        self._parents[request_id] = parent
        for comp in parent.completions:
            self._children[comp.req_id] = (parent, comp)
        return messages

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; return the engine ids of its completions still running."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for comp in parent.completions:
            self._children.pop(comp.req_id, None)
        return [c.req_id for c in parent.completions if not c.finished]

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is still in flight."""
        return request_id in self._parents

    def num_unfinished_requests(self) -> int:
        """User requests (parents) still in flight."""
        return len(self._parents)

    def engine_req_ids(self) -> list[str]:
        """Every engine request id still in flight."""
        return [rid for rid, (_, comp) in self._children.items() if not comp.finished]

    # -- resubmission ---------------------------------------------------------------------

    def resubmit_all(self) -> tuple[list[AddRequest], list[RequestOutput]]:
        """After the engine core was lost: every unfinished completion as a new engine
        request that continues where its delivered tokens end (see `resume_params`), under
        a new engine id (late outputs of the old one are then ignored). A completion with
        nothing left to generate (its final output was lost in flight) is finished here.

        Returns (the AddRequests to send, the final updates of requests finished here).
        """
        messages: list[AddRequest] = []
        finished: list[RequestOutput] = []
        for parent in list(self._parents.values()):
            parent.num_resubmits += 1
            done_here = []
            for comp in parent.completions:
                if comp.finished:
                    continue
                params = resume_params(comp.params, comp.token_ids)
                if params is None:
                    comp.finish_reason, comp.stop_reason = lost_finish(
                        comp.params, comp.token_ids, parent.eos_token_id)
                    done_here.append(comp)
                    continue
                del self._children[comp.req_id]
                comp.req_id = f"{comp.first_req_id}~{parent.num_resubmits}"
                self._children[comp.req_id] = (parent, comp)
                prompt = pack_token_ids(parent.prompt_token_ids + comp.token_ids)
                messages.append(AddRequest(comp.req_id, prompt, params, parent.eos_token_id,
                                           parent.priority, parent.arrival_time,
                                           num_resumed_tokens=len(comp.token_ids),
                                           lora_request=parent.lora_request,
                                           pooling=parent.pooling))
            if done_here and (parent.finished or not parent.final_only):
                finished.append(self._make_output(parent, done_here, time.time()))
        return messages, finished

    # -- processing -----------------------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float | None = None) -> ProcessedOutputs:
        """Apply one message's engine outputs; return the user updates and ids to abort."""
        now = time.time() if now is None else now
        result = ProcessedOutputs()
        changed: dict[str, dict[int, _Completion]] = {}  # request_id -> index -> completion
        for out in outputs:
            entry = self._children.get(out.req_id)
            if entry is None:
                self.num_unknown_outputs += 1  # aborted or finished already: a late output
                continue
            parent, comp = entry
            if comp.finished:
                continue
            if out.refused:
                self._refuse(parent, comp, out.error, result)
                continue
            if self._apply(parent, comp, out, now) and out.finish_reason is None:
                result.reqs_to_abort.append(comp.req_id)
            if self._should_report(parent, comp):
                changed.setdefault(parent.request_id, {})[comp.index] = comp
            if parent.wants_prompt_logprobs:  # held-back siblings may be due now
                for other in parent.completions:
                    if self._unsent(other) and (other.token_ids or other.finished) \
                            and self._should_report(parent, other):
                        changed.setdefault(parent.request_id, {})[other.index] = other
        for request_id, comps in changed.items():
            if request_id in result.refused:
                continue
            parent = self._parents[request_id]
            result.request_outputs.append(self._make_output(parent, list(comps.values()), now))
        return result

    def _refuse(self, parent: _Parent, comp: _Completion, error: str | None,
                result: ProcessedOutputs) -> None:
        """Forget a request one of whose completions the engine core refused; the others
        still running are aborted."""
        running = self.abort_request(parent.request_id)
        result.reqs_to_abort.extend(r for r in running if r != comp.req_id)
        result.refused[parent.request_id] = error or "the engine core refused this request"

    def finish_request(self, request_id: str, finish_reason: str,
                       error: str | None = None) -> tuple[RequestOutput | None, list[str]]:
        """End a request now (abort, engine death): its final update, and the engine ids of
        completions that were still running (to abort in the core). (None, []) if unknown."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None, []
        running = [c for c in parent.completions if not c.finished]
        comps = running + [c for c in parent.completions if c.finished and self._unsent(c)]
        for comp in running:
            comp.finish_reason, comp.error = finish_reason, error
        return self._make_output(parent, comps, time.time()), [c.req_id for c in running]

    def fail_all(self, reason: str, finish_reason: str = "error") -> list[RequestOutput]:
        """End every request in flight (engine death); return their final updates."""
        return [self.finish_request(rid, finish_reason, reason)[0] for rid in list(self._parents)]

    def _apply(self, parent: _Parent, comp: _Completion, out: EngineCoreOutput,
               now: float) -> bool:
        """Apply one engine output to one completion; True if a stop string ended it."""
        new_ids = unpack_token_ids(out.new_token_ids).tolist()
        self._record_timing(comp, out, now, bool(new_ids))
        if out.pooled is not None:
            comp.pooled = out.pooled
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None, *self._convert_prompt_logprobs(out.prompt_logprobs)]
        stop_token_finish = out.finish_reason == FinishReason.STOP
        stopped_by_string = False
        for pos, token_id in enumerate(new_ids):
            is_last = pos == len(new_ids) - 1
            skip_text = (is_last and stop_token_finish
                         and not comp.params.include_stop_str_in_output)
            if self._append_token(comp, token_id, out.new_logprobs, pos, skip_text):
                stopped_by_string = True
                break
        if not stopped_by_string and out.finish_reason is not None:
            comp.finish_reason = str(FinishReason(out.finish_reason))
            comp.stop_reason = out.stop_reason
            comp.error = out.error
        return stopped_by_string

    def _record_timing(self, comp: _Completion, out: EngineCoreOutput, now: float,
                       has_tokens: bool) -> None:
        if out.queue_time is not None and comp.queue_time is None:
            comp.queue_time = out.queue_time
        if out.num_cached_tokens:
            comp.num_cached_tokens = out.num_cached_tokens
        if not has_tokens:
            return
        if comp.first_token_time is None:
            comp.first_token_time = now
        else:
            comp.inter_token_latencies.append(now - comp.last_token_time)
        comp.last_token_time = now

    def _append_token(self, comp: _Completion, token_id: int,
                      new_logprobs: list[TokenLogprobs] | None, pos: int,
                      skip_text: bool) -> bool:
        """Append one token (and its logprobs); True if it completed a stop string."""
        comp.token_ids.append(token_id)
        comp.num_unsent_tokens += 1
        if comp.logprobs is not None and new_logprobs is not None and pos < len(new_logprobs):
            entry = self._convert_logprobs(new_logprobs[pos])
            comp.logprobs.append(entry)
            if token_id in entry:
                comp.cumulative_logprob += entry[token_id].logprob
        if skip_text:
            return False
        num_old_chars = len(comp.text)
        comp.text += comp.detokenizer.step(token_id)
        params = comp.params
        if not params.stop or len(comp.token_ids) <= params.min_tokens:
            return False
        match = find_stop_string(comp.text, num_old_chars, params.stop,
                                 params.include_stop_str_in_output)
        if match is None:
            return False
        stop_str, truncate_to = match
        comp.text = comp.text[:truncate_to]
        comp.finish_reason, comp.stop_reason = "stop", stop_str
        return True

    def _convert_logprobs(self, tl: TokenLogprobs) -> dict[int, Logprob]:
        """Wire logprobs (sampled token first, then top alternatives by rank) to a dict."""
        values = array("f")
        values.frombytes(tl.logprobs)
        return self._entry(unpack_token_ids(tl.token_ids).tolist(), values, tl.sampled_rank)

    def _convert_prompt_logprobs(self, part: PromptLogprobs) -> list[dict[int, Logprob]]:
        """Wire prompt logprobs to one dict per position (the prompt token first)."""
        width = 1 + part.num_logprobs
        ids = unpack_token_ids(part.token_ids).tolist()
        values = array("f")
        values.frombytes(part.logprobs)
        ranks = unpack_token_ids(part.ranks).tolist()
        return [self._entry(ids[i * width:(i + 1) * width],
                            values[i * width:(i + 1) * width], rank)
                for i, rank in enumerate(ranks)]

    def _entry(self, ids, values, first_rank: int) -> dict[int, Logprob]:
        """One position: the chosen token (rank `first_rank`), then alternatives 1, 2, ..."""
        entry: dict[int, Logprob] = {}
        for i, (tid, lp) in enumerate(zip(ids, values)):
            if tid not in entry:
                entry[tid] = Logprob(tid, float(lp), first_rank if i == 0 else i,
                                     self._token_text(tid))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = decode_token(self.tokenizer, token_id)
        return text

    # -- reporting ------------------------------------------------------------------------

    @staticmethod
    def _unsent(comp: _Completion) -> bool:
        return comp.num_unsent_tokens > 0 or not comp.reported

    def _should_report(self, parent: _Parent, comp: _Completion) -> bool:
        if parent.final_only:
            return parent.finished
        if parent.awaits_prompt_logprobs:
            return False
        if comp.finished or not comp.reported:
            return True
        return comp.num_unsent_tokens >= parent.stream_interval

    def _make_output(self, parent: _Parent, comps: list[_Completion],
                     now: float) -> RequestOutput:
        """Build the user update for `comps`; drop the parent's state once it is finished."""
        if parent.pooling is not None:
            return self._embedding_output(parent)
        if parent.final_only:
            comps = parent.completions
        finished = parent.finished
        outputs = [self._snapshot(parent, c) for c in sorted(comps, key=lambda c: c.index)]
        if finished:
            self._parents.pop(parent.request_id, None)
            for comp in parent.completions:
                self._children.pop(comp.req_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             outputs, finished, self._metrics(parent, now, finished),
                             parent.prompt_logprobs)

    def _embedding_output(self, parent: _Parent) -> EmbeddingRequestOutput:
        """An embedding request's one update, final (the vector, or why there is none);
        its state is dropped."""
        self._parents.pop(parent.request_id, None)
        comp = parent.completions[0]
        self._children.pop(comp.req_id, None)
        vector = None if comp.pooled is None else EmbeddingOutput(unpack_floats(comp.pooled))
        return EmbeddingRequestOutput(parent.request_id, vector, parent.prompt_token_ids,
                                      True, parent.prompt, comp.finish_reason or "abort",
                                      comp.error)

    def _snapshot(self, parent: _Parent, comp: _Completion) -> CompletionOutput:
        """The completion as reported now; advances what counts as already sent."""
        hold = 0 if comp.finished else parent.stop_buffer_len
        visible = comp.text[:max(0, len(comp.text) - hold)] if hold else comp.text
        delta_text = visible[comp.num_sent_chars:]
        delta_ids = comp.token_ids[comp.num_sent_tokens:]
        logprobs = delta_logprobs = None
        if comp.logprobs is not None:
            logprobs = list(comp.logprobs)
            delta_logprobs = comp.logprobs[comp.num_sent_tokens:]
        comp.num_sent_chars = max(comp.num_sent_chars, len(visible))
        comp.num_sent_tokens = len(comp.token_ids)
        comp.num_unsent_tokens = 0
        comp.reported = True
        return CompletionOutput(
            index=comp.index, text=visible, token_ids=list(comp.token_ids),
            delta_text=delta_text, delta_token_ids=delta_ids, logprobs=logprobs,
            delta_logprobs=delta_logprobs, cumulative_logprob=comp.cumulative_logprob,
            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, error=comp.error)

    def _metrics(self, parent: _Parent, now: float, finished: bool) -> RequestMetrics:
        first = parent.completions[0]
        return RequestMetrics(
            arrival_time=parent.arrival_time, first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=now if finished else None, queue_time=first.queue_time,
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_generation_tokens=sum(len(c.token_ids) for c in parent.completions),
            num_cached_tokens=first.num_cached_tokens,
            inter_token_latencies=list(first.inter_token_latencies))


def find_stop_string(text: str, num_old_chars: int, stop: list[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """Find a stop string that ends in `text[num_old_chars:]` (the newly added characters).

    Only the new characters plus a look-back of `len(stop_str) - 1` are searched, so a stop
    string completed by this token is found even when earlier tokens hold its start. Returns
    (the stop string, the length to truncate the text to) for the earliest match, or None.
    """
    if len(text) <= num_old_chars:
        return None
    best: tuple[str, int] | None = None
    best_pos = len(text)
    for stop_str in stop:
        start = max(0, num_old_chars - len(stop_str) + 1)
        pos = text.find(stop_str, start)
        if pos != -1 and pos < best_pos:
            best, best_pos = stop_str, pos
    if best is None:
        return None
    return best, best_pos + len(best) if include_in_output else best_pos
