"""The continuous-batching scheduler (its rules: docs/architecture.md §5).

One step:

    plan = scheduler.schedule()              # who runs, how many tokens, which blocks
    ... the workers run the plan ...
    outputs = scheduler.update(plan, sampled)   # append tokens, check stops, free finished

`schedule()` is three passes: running requests in admission order (decodes and unfinished
prefill chunks; preempt when a block is missing), then waiting requests while the token budget
and `max_num_seqs` allow (never in a step that preempted), then the plan for the workers.

Async scheduling: `schedule()` for step N+1 may run before `update()` for step N. A request
whose token from an in-flight step is not yet known has a placeholder
(`num_output_placeholders`) and is scheduled one more token; the worker fills the token in
from its own sampler. Nobody is scheduled past max_tokens or the context length. A result
that arrives for a request finished meanwhile, or planned before it was preempted, changes
nothing (the preempted request recomputes that token after it resumes).

Structured output: a constrained request waits apart (`awaiting_grammar`, status
WAITING_FOR_GRAMMAR) while the workers compile its grammar off the step path; the next plan
carries the grammar (`BatchPlan.grammars`), and the request joins the waiting queue (at its
end) once a result lists it in `grammars_ready`, or fails alone if it did not compile. While
any request waits so, every plan says `awaits_grammars`, and one with nothing else to run is
still sent: the workers' answer to it is the poll.

Pipeline parallelism (several stages): up to one plan per stage is in flight, but only the
last stage samples, so the first one cannot fill in a placeholder. A request whose sampled
token is in flight is therefore not scheduled again until it is back (another request fills
the next plan); its new tokens then travel in the plan (`CachedRequestData.new_token_ids`).
Prefill chunks of one request may still follow each other: every stage runs plans in order.

Speculative decoding (`engine_core/drafting.py`, `spec_decode.py`): after the running and waiting passes,
each running request that decodes one token (its last token known, nothing in flight) may
get k draft tokens from the proposer, k chosen by the adaptive policy within what is left of
the token budget; they get KV slots (never by preemption: a request whose drafts do not fit
gets none) and ride in the plan (`CachedRequestData.spec_token_ids`; with a draft model only
their count, `num_model_drafts`: the workers make them at step time). `num_computed_tokens`
advances over them at schedule time; `update()` sets it back to what was accepted (the
rejected drafts' slots are overwritten next step; the blocks stay with the request, which
needs them next step anyway). A request with drafts in flight is not scheduled again until
its result is back (async scheduling and pipeline stages alike); so is, with speculation
on, any request that may draft (async scheduling thus plans ahead only for the others and
for prefill chunks: drafts need the last token). Speculation is off for
requests with logprobs, penalties, a grammar, min_tokens still to reach, a LoRA adapter, or
pooling.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Iterable

from .block_pool import BlockPool
from .config import EngineConfig, check_lengths
from .kv_cache_manager import KVCacheManager
from .lora import LoRASlots, adapters_in_use
from .preemption_log import PreemptionLog
from .request import Request, RequestStatus
from .request_outputs import (
    add_prompt_logprobs, check_stop, mark_first_output, take_prompt_logprobs,
)
from .request_queue import create_request_queue, priority_key
from .drafting import Drafting
from .spec_decode import parse_speculative_config
from ..ipc.batch_view import BatchView, StepRecord
from ..ipc.frontend_messages import EngineCoreOutput, FinishReason, SchedulerStats
from ..ipc.messages import pack_token_ids, unpack_token_ids
from ..ipc.pooling import PooledOutput
from ..ipc.worker_messages import (
    BatchPlan,
    CachedRequestData,
    GrammarToCompile,
    NewRequestData,
    RequestFailure,
    SampledTokens,
)

logger = logging.getLogger("tidal.engine_core.scheduler")

_pack_one = struct.Struct("<i").pack
_RUNNING = RequestStatus.RUNNING

Outputs = dict[str, list[EngineCoreOutput]]
"""client_id -> outputs for that frontend, in order."""


class _Step:
    """Scratch state of one schedule() call."""

    __slots__ = ("step_id", "budget", "scheduled", "preempted_req_ids", "num_preempted",
                 "drafts")

    def __init__(self, step_id: int, budget: int) -> None:
        self.step_id = step_id
        self.budget = budget
        self.scheduled: dict[str, tuple[Request, int, list[int], bool]] = {}
        """req_id -> (request, num_new_tokens, new_block_ids, admitted this step), in batch
        order; blocks of requests admitted this step are published already."""
        self.preempted_req_ids: list[str] = []
        self.num_preempted = 0
        self.drafts: dict[str, list[int]] = {}
        """req_id -> the draft tokens it verifies this step (speculative decoding)."""


class Scheduler:
    """Decides each step's batch and owns the KV block pool (ids and hashes, not tensors)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the window every attention layer of the model shares (the
        workers report it), under which requests give back the blocks that fall out of it
        (`KVCacheManager`); None when any layer attends globally."""
        _check_runtime(config, num_kv_blocks, max_model_len)
        sched = config.scheduler
        self.config = config
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = config.cache.block_size
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.chunked_prefill = sched.enable_chunked_prefill
        self.policy = sched.scheduling_policy
        self.pipelined = config.parallel.pipeline_parallel_size > 1
        self.long_prefill_token_threshold = (
            sched.long_prefill_token_threshold if sched.enable_chunked_prefill else 0)
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, self.block_size,
                                               config.cache.enable_prefix_caching,
                                               sliding_window)
        self.requests: dict[str, Request] = {}
        """req_id -> every unfinished request (running or waiting)."""
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        """Requests holding KV blocks, in admission order (the fcfs victim is the last)."""
        self._finished_req_ids: list[str] = []
        """Requests the workers hold that finished since the last plan."""
        self._preempted_req_ids: list[str] = []
        """Requests sent back to waiting outside schedule() (prefix-cache reset)."""
        self.awaiting_grammar: dict[str, Request] = {}
        """req_id -> constrained requests whose grammar the workers compile, in arrival order
        (in neither queue until it compiled); those whose `grammar_sent` is False go out
        in the next plan."""
        self.lora_slots = LoRASlots(config.lora.max_loras) if config.lora.enable_lora else None
        """Which adapter each of the workers' LoRA slots holds (None: LoRA off)."""
        self._next_step_id = 1
        self._num_added = 0
        self.clock = time.monotonic
        self.preemption_log = PreemptionLog(logger, config, num_kv_blocks)
        spec = parse_speculative_config(config.scheduler.speculative_config)
        self.drafting = None if spec is None else Drafting(spec, max_model_len)
        """Speculative decoding's proposer, policy and counters (None: off)."""
        self._init_counters()

    def _init_counters(self) -> None:
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache at first admissions."""
        self.prefix_cache_hits = 0
        self.preempted_prefix_cache_queries = 0
        """Tokens looked up when preempted requests resume (kept apart: they mostly hit their
        own blocks, which is recompute, not sharing)."""
        self.preempted_prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.num_finished = 0
        """Requests finished for any reason (the queue estimate's finish rate)."""

    @property
    def block_pool(self) -> BlockPool:
        """The KV block pool (ids, reference counts, prefix-cache map)."""
        return self.kv_cache_manager.block_pool

    # -- requests in and out ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request. ValueError if its id is taken, its prompt is empty or leaves
        no room to generate within max_model_len."""
        if request.req_id in self.requests:
            raise ValueError(f"req_id {request.req_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if request.pooling is not None:
            self._check_pooling_length(request)
        elif request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: input length ({request.num_prompt_tokens}) must be below "
                f"the model's maximum context length ({self.max_model_len})")
        if request.lora is not None:
            self._check_lora(request.lora)
        room = self.max_model_len - request.num_prompt_tokens
        request.max_tokens = room if request.max_tokens is None else min(request.max_tokens,
                                                                         room)
        if request.pooling is not None:
            request.max_tokens = 1  # the vector: the one "output" its last chunk makes
        self._num_added += 1
        request.arrival_seq = self._num_added
        request.add_time = self.clock()
        self.requests[request.req_id] = request
        if request.sampling.structured_outputs is None:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        else:
            self._await_grammar(request)

    def _check_lora(self, lora) -> None:
        """ValueError naming lora_request when this engine cannot run the adapter."""
        if self.lora_slots is None:
            raise ValueError(f"lora_request {lora.lora_name!r} needs an engine started with "
                             "--enable-lora")
        self.lora_slots.check(lora)

    def _check_pooling_length(self, request: Request) -> None:
        """A pooling request generates nothing: its prompt may fill the whole context."""
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: input length ({request.num_prompt_tokens}) must be at most "
                f"the model's maximum context length ({self.max_model_len})")

    def _await_grammar(self, request: Request) -> None:
        """Hold a constrained request out of the queues until the workers compiled its
        grammar, which the next plan sends them."""
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.awaiting_grammar[request.req_id] = request

    def _grammars_ready(self, req_ids: list[str]) -> None:
        """Constrained requests whose grammar compiled join the waiting queue."""
        for req_id in req_ids:
            request = self.awaiting_grammar.pop(req_id, None)
            if request is not None:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)

    def abort(self, req_ids: Iterable[str]) -> Outputs:
        """Finish these requests with ABORT (unknown or finished ids are ignored)."""
        return self._finish_many(req_ids, RequestStatus.FINISHED_ABORTED, None)

    def abort_client(self, client_id: str) -> int:
        """Abort every request of a frontend that went away; returns how many."""
        req_ids = [r.req_id for r in self.requests.values() if r.client_id == client_id]
        self.abort(req_ids)
        return len(req_ids)

    def fail_client(self, client_id: str, error: str) -> Outputs:
        """Every request of one frontend finishes with FinishReason.ERROR and this message."""
        req_ids = [r.req_id for r in self.requests.values() if r.client_id == client_id]
        return self._finish_many(req_ids, RequestStatus.FINISHED_ERROR, error)

    def fail_all(self, error: str) -> Outputs:
        """Every unfinished request finishes with FinishReason.ERROR and this message."""
        return self._finish_many(list(self.requests), RequestStatus.FINISHED_ERROR, error)

    def _finish_many(self, req_ids: Iterable[str], status: RequestStatus,
                     error: str | None) -> Outputs:
        outputs: Outputs = {}
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self._finish(request, status)
            request.error = error
            finished.append(request)
            out = EngineCoreOutput(req_id, b"", status.finish_reason, error=error)
            mark_first_output(request, out)
            outputs.setdefault(request.client_id, []).append(out)
        if finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
            self.waiting.remove_many(r for r in finished)
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, free blocks, tell the workers; the caller unlinks the queues."""
        request.status = status
        request.finish_time = self.clock()
        del self.requests[request.req_id]
        self.num_finished += 1
        self.kv_cache_manager.free(request)
        self.awaiting_grammar.pop(request.req_id, None)
        if self.drafting is not None:
            self.drafting.finished(request, status)
        if request.in_worker or request.grammar_sent:
            self._finished_req_ids.append(request.req_id)
            request.in_worker = request.grammar_sent = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- schedule -----------------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        """Plan the next step (see the module docstring)."""
        step = _Step(self._next_step_id, self.max_num_batched_tokens)
        self._next_step_id += 1
        if self._preempted_req_ids:
            step.preempted_req_ids, self._preempted_req_ids = self._preempted_req_ids, []
        self._schedule_running(step)
        if step.num_preempted == 0:
            self._schedule_waiting(step)
        if self.drafting is not None and step.budget > 0:
            self.drafting.add_drafts(step, self.kv_cache_manager)
        return self._build_plan(step)

    def _long_prefill_cap(self) -> int:
        """Per-request chunk cap this step (0 = none); off while only one request exists."""
        if self.long_prefill_token_threshold and len(self.requests) > 1:
            return self.long_prefill_token_threshold
        return 0

    def _schedule_running(self, step: _Step) -> None:
        """Give each running request its next tokens, in admission order; preempt for
        blocks. Full blocks are published only after the pass, when nothing can be undone."""
        cap = self._long_prefill_cap()
        max_model_len = self.max_model_len
        block_size = self.block_size
        kv = self.kv_cache_manager
        req_blocks = kv.req_blocks
        windowed = kv.sliding_window is not None
        scheduled = step.scheduled
        budget = step.budget
        drafting = self.drafting
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != _RUNNING:  # preempted earlier in this pass
                continue
            placeholders = request.num_output_placeholders
            if placeholders and (self.pipelined or drafting is not None
                                 and drafting.may_draft(request)):
                # its token is still in the pipeline (the first stage lacks it), or it may
                # draft (drafts follow its last token; how many come back is not known)
                continue
            num_projected = len(request.all_token_ids) + placeholders
            if request.pooling is not None:
                if placeholders:
                    continue  # its prompt is computed; its vector is on the way
            elif (num_projected >= max_model_len
                    or len(request.output_token_ids) + placeholders >= request.max_tokens):
                continue  # its last token is in flight: scheduling more would be wasted
            num_computed = request.num_computed_tokens
            num_new = num_projected - num_computed
            if num_new <= 0:
                continue  # nothing known to compute (defensive: a sampled step adds one)
            if cap and num_new > cap:
                num_new = cap
            if num_new > budget:
                num_new = budget
            if num_computed + num_new <= len(req_blocks[request.req_id]) * block_size:
                new_block_ids = []  # fast path: the last block has room (most decodes)
                if windowed:  # blocks that fell out of the window go back at once
                    kv.free_out_of_window(request.req_id, num_computed)
            else:
                new_block_ids = kv.allocate_slots(request, num_new, publish=False)
                if new_block_ids is None:
                    step.budget = budget
                    new_block_ids = self._preempt_until_fits(request, num_new, step)
                    budget = step.budget
                    if new_block_ids is None:
                        if self.policy == "fcfs":
                            break  # it was the last running request
                        continue  # lower-priority ones are gone; later ones may still fit
            scheduled[request.req_id] = (request, num_new, new_block_ids, False)
            budget -= num_new
        step.budget = budget

    def _preempt_until_fits(self, request: Request, num_new: int,
                            step: _Step) -> list[int] | None:
        """Preempt victims until the request's blocks fit; None if it was preempted itself."""
        while True:
            victim = self._select_victim()
            self._preempt(victim, step)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new,
                                                                 publish=False)
            if new_block_ids is not None:
                return new_block_ids

    def _select_victim(self) -> Request:
        """fcfs: the last admitted; priority: the largest (priority, arrival)."""
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=priority_key)

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Recompute mode: free the victim's blocks, keep its tokens, requeue it."""
        if self.running and self.running[-1] is victim:
            self.running.pop()
        else:
            self.running.remove(victim)
        undone = step.scheduled.pop(victim.req_id, None)
        if undone is not None:
            step.budget += undone[1]
        num_lost = victim.num_computed_tokens
        usage = self.kv_cache_manager.usage()  # before the victim's blocks come back
        self._requeue(victim, step.step_id, step.preempted_req_ids)
        step.num_preempted += 1
        self.num_preemptions += 1
        self.preemption_log.record(victim, num_lost, len(self.running) + 1, usage,
                                   self.num_preemptions, self.clock())

    def _requeue(self, request: Request, stale_before_step: int,
                 preempted_req_ids: list[str]) -> None:
        """A request that left `running`: free its blocks, keep its tokens, put it back at
        the front of the waiting queue; results of steps before `stale_before_step` are
        dropped, and the workers are told to drop it."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_drafts_in_flight = 0
        request.discard_before_step = stale_before_step
        request.num_preemptions += 1
        if request.in_worker:
            preempted_req_ids.append(request.req_id)
            request.in_worker = False
        self.waiting.prepend(request)

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests in queue order while budget, max_num_seqs and blocks allow;
        the first one that does not fit stops admission (no skipping ahead)."""
        kv = self.kv_cache_manager
        cap = self._long_prefill_cap()
        now = None
        slots = self.lora_slots
        in_use = adapters_in_use(self.running) if slots is not None else set()
        skipped: list[Request] = []  # other adapters' requests while the slots are taken
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if slots is not None and not slots.can_admit(request.lora, in_use):
                skipped.append(self.waiting.pop())  # vLLM's rule: skip, keep the order
                continue
            if request.skips_prefix_cache:
                hit_blocks, num_hit = [], 0
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_tokens = len(request.all_token_ids)
            num_new = num_tokens - num_hit
            if not self.chunked_prefill:
                if num_new > step.budget:
                    break
            else:
                if cap and num_new > cap:
                    num_new = cap
                num_new = min(num_new, step.budget)
            # Admit only if the whole sequence known so far fits in free blocks now: a
            # check, not a reservation (vLLM's scheduler_reserve_full_isl).
            if kv.num_blocks_needed(request, num_tokens, hit_blocks) > kv.num_free_blocks():
                break
            new_block_ids = kv.allocate_slots(request, num_new, hit_blocks)
            if new_block_ids is None:
                break
            self.waiting.pop()
            if now is None:
                now = self.clock()
            if request.lora is not None:
                slots.admit(request.lora, in_use)
                in_use.add(request.lora.lora_int_id)
            self._admit(request, num_hit, now)
            step.scheduled[request.req_id] = (request, num_new, new_block_ids, True)
            step.budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _admit(self, request: Request, num_hit: int, now: float) -> None:
        """Waiting -> running, with prefix-cache statistics counted once per admission (not
        for a request that did not look the cache up, as vLLM counts)."""
        num_tokens = len(request.all_token_ids)
        if self.kv_cache_manager.enable_caching and not request.skips_prefix_cache:
            if request.num_preemptions:
                self.preempted_prefix_cache_queries += num_tokens
                self.preempted_prefix_cache_hits += num_hit
            else:
                self.prefix_cache_queries += num_tokens
                self.prefix_cache_hits += num_hit
        if request.queue_time is None:
            request.queue_time = max(0.0, now - request.add_time)
            request.num_cached_tokens = num_hit
        request.status = _RUNNING
        request.num_computed_tokens = num_hit
        self.running.append(request)

    def _build_plan(self, step: _Step) -> BatchPlan:
        """Advance every scheduled request's counters and describe the step for the workers:
        full data for requests they do not hold, deltas for the rest."""
        kv = self.kv_cache_manager
        caching = kv.enable_caching
        num_cached_blocks = kv.num_cached_blocks
        block_size = self.block_size
        new_reqs, cached_reqs = [], []
        total = num_prompt_tokens = 0
        for request, num_new, new_block_ids, admitted in step.scheduled.values():
            start = request.num_computed_tokens
            end = start + num_new
            total += num_new
            num_tokens = len(request.all_token_ids)
            if (caching and not admitted and (end if end < num_tokens else num_tokens)
                    // block_size > num_cached_blocks[request.req_id]):
                kv.publish_full_blocks(request, end)
            request.num_computed_tokens = end
            if end >= num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples a token
            if start < request.num_prompt_tokens:
                num_prompt_tokens += min(end, request.num_prompt_tokens) - start
            if request.in_worker:
                cached = CachedRequestData(request.req_id, new_block_ids, start, num_new)
                if self.pipelined and request.num_worker_tokens < num_tokens:
                    cached.new_token_ids = pack_token_ids(
                        request.all_token_ids[request.num_worker_tokens:])
                    request.num_worker_tokens = num_tokens
                if step.drafts:
                    draft = step.drafts.get(request.req_id)
                    if draft is not None and self.drafting.drafts_in_worker:
                        cached.num_model_drafts = len(draft)  # the workers make them
                    elif draft is not None:
                        cached.spec_token_ids = pack_token_ids(draft)
                cached_reqs.append(cached)
            else:
                request.in_worker = True
                request.num_worker_tokens = num_tokens
                new_reqs.append(NewRequestData(
                    request.req_id, pack_token_ids(request.all_token_ids),
                    request.num_prompt_tokens, kv.get_block_ids(request.req_id), start,
                    num_new, request.sampling, request.eos_token_id,
                    request.num_resumed_tokens,
                    request.lora.lora_int_id if request.lora is not None else 0,
                    pooling=request.pooling))
        self.prompt_tokens += num_prompt_tokens
        if total:
            self.num_steps += 1
        finished, self._finished_req_ids = self._finished_req_ids, []
        plan = BatchPlan(step.step_id, new_reqs, cached_reqs, finished, step.preempted_req_ids,
                         total, self._take_grammars(), bool(self.awaiting_grammar))
        if self.lora_slots is not None:
            plan.lora_slots = self.lora_slots.take_loads()
        return plan

    def _take_grammars(self) -> list[GrammarToCompile]:
        """The grammars the workers have not been sent, of requests still waiting for them."""
        jobs = []
        for request in self.awaiting_grammar.values():
            if not request.grammar_sent:
                request.grammar_sent = True
                jobs.append(GrammarToCompile(request.req_id,
                                             request.sampling.structured_outputs))
        return jobs

    # -- update -------------------------------------------------------------------------------

    def update(self, plan: BatchPlan, sampled: SampledTokens) -> Outputs:
        """Append the step's sampled tokens, check stops, free finished requests. Results for
        requests finished meanwhile, or preempted after the step was planned, are dropped;
        requests the workers refused fail alone."""
        if sampled.step_id != plan.step_id:
            raise ValueError(f"sampled.step_id {sampled.step_id} does not match plan.step_id "
                             f"{plan.step_id}")
        outputs: Outputs = {}
        if sampled.failed:
            self._fail_refused(sampled.failed, outputs)
        if sampled.grammars_ready:
            self._grammars_ready(sampled.grammars_ready)
        step_id = plan.step_id
        requests = self.requests
        max_model_len = self.max_model_len
        token_ids = unpack_token_ids(sampled.token_ids)
        logprobs = sampled.logprobs
        if sampled.prompt_logprobs:
            add_prompt_logprobs(self.requests, sampled.prompt_logprobs, step_id)
        if sampled.pooled:
            self._finish_pooled(sampled.pooled, step_id, outputs)
        if sampled.num_tokens or self.drafting is not None:
            self._update_multi(sampled, step_id, token_ids, outputs)
            return outputs
        num_finished = num_accepted = 0
        for i, req_id in enumerate(sampled.req_ids):
            request = requests.get(req_id)
            if (request is None or step_id < request.discard_before_step
                    or request.num_output_placeholders <= 0):
                continue
            token = token_ids[i]
            num_accepted += 1
            request.num_output_placeholders -= 1
            output_token_ids = request.output_token_ids
            output_token_ids.append(token)
            request.all_token_ids.append(token)
            lp = logprobs[i] if logprobs else None
            out = EngineCoreOutput(req_id, _pack_one(token), None, None,
                                   None if lp is None else [lp])
            if not request.first_output_sent:
                self._first_output(request, out)
            num_output = len(output_token_ids)
            if (num_output >= request.max_tokens or len(request.all_token_ids) >= max_model_len
                    or (num_output > request.min_tokens and (
                        token == request.eos_token_id or token in request.stop_token_ids))):
                status = check_stop(request, token, self.max_model_len)
                out.finish_reason = status.finish_reason
                out.stop_reason = request.stop_reason
                self._finish(request, status)
                num_finished += 1
            client_outputs = outputs.get(request.client_id)
            if client_outputs is None:
                outputs[request.client_id] = [out]
            else:
                client_outputs.append(out)
        self.generation_tokens += num_accepted
        if num_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def _first_output(self, request: Request, out: EngineCoreOutput) -> None:
        """`out` is the request's first output: its first-token time, the queue time and
        cache hit it reports (`mark_first_output`), and its prompt logprobs, all at once."""
        request.first_token_time = self.clock()
        mark_first_output(request, out)
        if request.prompt_logprob_parts is not None:
            out.prompt_logprobs = take_prompt_logprobs(request)

    def _update_multi(self, sampled: SampledTokens, step_id: int, token_ids,
                      outputs: Outputs) -> None:
        """`update` for a step where requests verified drafts: each listed request has
        `num_tokens[i]` tokens (1 + its accepted drafts), applied one by one (a stop ends
        the run there); a request that had drafts gets `num_computed_tokens` set to what
        was accepted."""
        requests = self.requests
        counts = unpack_token_ids(sampled.num_tokens) if sampled.num_tokens else None
        logprobs = sampled.logprobs
        num_finished = num_appended = 0
        pos = 0
        for i, req_id in enumerate(sampled.req_ids):
            count = counts[i] if counts is not None else 1
            tokens = token_ids[pos:pos + count]
            pos += count
            request = requests.get(req_id)
            if (request is None or step_id < request.discard_before_step
                    or request.num_output_placeholders <= 0):
                continue
            request.num_output_placeholders -= 1
            num_drafts = request.num_drafts_in_flight
            if num_drafts:
                self.drafting.record(request, num_drafts, count - 1)
            status = None
            appended = 0
            for token in tokens:
                request.output_token_ids.append(token)
                request.all_token_ids.append(token)
                appended += 1
                status = check_stop(request, token, self.max_model_len)
                if status is not None:
                    break
            num_appended += appended
            if num_drafts and status is None:
                request.num_computed_tokens = len(request.all_token_ids) - 1
            lp = logprobs[i] if logprobs else None
            out = EngineCoreOutput(req_id, pack_token_ids(tokens[:appended]), None, None,
                                   None if lp is None else [lp])
            if not request.first_output_sent:
                self._first_output(request, out)
            if status is not None:
                out.finish_reason = status.finish_reason
                out.stop_reason = request.stop_reason
                self._finish(request, status)
                num_finished += 1
            outputs.setdefault(request.client_id, []).append(out)
        self.generation_tokens += num_appended
        if num_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]

    def step_ran(self, plan: BatchPlan, seconds: float) -> None:
        """`plan` took `seconds` at the workers (the engine core's measure): speculation's
        policy learns what steps cost here (`Drafting.step_ran`)."""
        if self.drafting is not None:
            self.drafting.step_ran(plan, seconds)

    def use_step_cost_model(self, model) -> bool:
        """The advisory wing's measured step cost model (`tidal tune profile`), for
        speculation's pricing of steps not yet measured; False (unused) without speculation."""
        if self.drafting is None:
            return False
        self.drafting.policy.use_cost_model(model)
        return True

    def _finish_pooled(self, pooled: list[PooledOutput], step_id: int,
                       outputs: Outputs) -> None:
        """Pooling requests whose prompt the step computed: each finishes (STOP) with its
        vector and frees its blocks (a result planned before a preemption is dropped, as
        a token is: the request recomputes its prompt)."""
        num_finished = 0
        for item in pooled:
            request = self.requests.get(item.req_id)
            if (request is None or step_id < request.discard_before_step
                    or request.num_output_placeholders <= 0 or request.pooling is None):
                continue
            request.num_output_placeholders -= 1
            request.first_token_time = self.clock()
            out = EngineCoreOutput(item.req_id, b"", FinishReason.STOP, pooled=item.data)
            mark_first_output(request, out)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.setdefault(request.client_id, []).append(out)
            num_finished += 1
        if num_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]

    def _fail_refused(self, failures: list[RequestFailure], outputs: Outputs) -> None:
        """Requests whose data a worker refused (the engine core's checks let them through):
        each finishes with an error of its own, refused, and frees its blocks."""
        for failure in failures:
            finished = self._finish_many([failure.req_id], RequestStatus.FINISHED_ERROR,
                                         failure.error)
            for client_id, client_outputs in finished.items():
                for out in client_outputs:
                    out.refused = True
                outputs.setdefault(client_id, []).extend(client_outputs)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """A snapshot; counters are totals since start-up."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.awaiting_grammar),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_kv_blocks=self.num_kv_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
            preempted_prefix_cache_queries=self.preempted_prefix_cache_queries,
            preempted_prefix_cache_hits=self.preempted_prefix_cache_hits,
            queued_prompt_tokens=sum(r.num_prompt_tokens for r in self.requests.values()
                                     if not r.output_token_ids),
            **(self.drafting.counters() if self.drafting is not None else {}),
        )

    def batch_view(self, steps: list[StepRecord], skipped: int,
                   warnings: list[str]) -> BatchView:
        """The live view's snapshot (`ipc/batch_view.py`) around `steps` someone recorded."""
        used, cached = self.kv_cache_manager.block_counts()
        by_priority: dict[int, int] = {}
        for request in self.waiting:
            by_priority[request.priority] = by_priority.get(request.priority, 0) + 1
        return BatchView(steps, skipped, self.max_num_seqs, self.max_num_batched_tokens,
                         self.num_kv_blocks, used, cached, by_priority, warnings)

    def kv_blocks_used(self) -> int:
        """KV blocks held by requests now (O(1): for every step of the live view)."""
        return self.num_kv_blocks - 1 - self.kv_cache_manager.num_free_blocks()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash; refused (False) while any request holds blocks.
        With `reset_running_requests`, every running request first goes back to the front of
        the waiting queue in its running order (recomputed later; not counted as a
        preemption), and the next plan tells the workers to drop them."""
        if reset_running_requests and self.running:
            for request in reversed(self.running):
                self._requeue(request, self._next_step_id, self._preempted_req_ids)
            self.running = []
        return self.kv_cache_manager.reset_prefix_cache()

    def recompute_all(self) -> int:
        """The workers were replaced and their KV cache is gone: every running request goes
        back to the front of the waiting queue in its running order, to be recomputed from
        its prompt and the tokens it already has (as a preemption does, not counted as one),
        every cached block hash is forgotten, and nothing is owed to the old workers (no
        finished or preempted ids are sent to the new ones). The new workers lack every
        grammar: each constrained request waits for its grammar again (sent in the next plan),
        then rejoins the waiting queue at its end. Returns how many were running."""
        num_running = len(self.running)
        self.reset_prefix_cache(reset_running_requests=True)
        self._finished_req_ids.clear()
        self._preempted_req_ids.clear()
        if self.lora_slots is not None:  # the new workers hold no adapter
            self.lora_slots.reset()
        constrained = [r for r in self.requests.values()
                       if r.sampling.structured_outputs is not None]
        self.waiting.remove_many(constrained)
        self.awaiting_grammar.clear()
        for request in sorted(constrained, key=lambda r: r.arrival_seq):
            request.grammar_sent = False
            self._await_grammar(request)
        return num_running

    def check_invariants(self) -> None:
        """AssertionError if the scheduler or the block pool is inconsistent."""
        self.kv_cache_manager.check_invariants()
        running_ids = [r.req_id for r in self.running]
        waiting_ids = [r.req_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is twice in waiting"
        assert not set(running_ids) & set(waiting_ids), "a request is running and waiting"
        assert not set(self.awaiting_grammar) & (set(running_ids) | set(waiting_ids)), (
            "a request awaits its grammar and is queued")
        assert set(running_ids) | set(waiting_ids) | set(self.awaiting_grammar) == set(
            self.requests), "requests and queues disagree"
        for request in self.awaiting_grammar.values():
            assert request.status == RequestStatus.WAITING_FOR_GRAMMAR, request
            assert not request.in_worker and request.num_computed_tokens == 0, request
        assert len(self.running) <= self.max_num_seqs, "more running than max_num_seqs"
        assert set(self.kv_cache_manager.req_blocks) <= set(running_ids), (
            "a request that is not running holds blocks")
        for request in self.running:
            _check_running(request, self.kv_cache_manager, self.block_size)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0 and request.num_output_placeholders == 0
            assert not request.in_worker, f"{request} waits but the workers hold it"


def _check_running(request: Request, kv: KVCacheManager, block_size: int) -> None:
    assert request.status == _RUNNING, request
    assert request.num_output_placeholders >= 0, request
    assert request.in_worker, f"{request} runs but the workers were never told"
    assert request.num_computed_tokens <= (len(request.all_token_ids)
                                           + request.num_output_placeholders
                                           + request.num_drafts_in_flight), request
    num_slots = len(kv.req_blocks.get(request.req_id, ())) * block_size
    assert request.num_computed_tokens <= num_slots, f"{request} has too few blocks"
    assert (len(request.output_token_ids) + request.num_output_placeholders
            <= request.max_tokens), f"{request} scheduled past max_tokens"


def _check_runtime(config: EngineConfig, num_kv_blocks: int, max_model_len: int) -> None:
    """ValueErrors for start-up facts that cannot work."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    if num_kv_blocks < 2:
        raise ValueError(f"num_kv_blocks must be at least 2 (block 0 is reserved), "
                         f"got {num_kv_blocks}")
    check_lengths(config, max_model_len)
    capacity = (num_kv_blocks - 1) * config.cache.block_size
    if capacity < max_model_len:
        raise ValueError(
            f"max_model_len ({max_model_len}) does not fit in the KV cache: {num_kv_blocks - 1} "
            f"usable blocks of {config.cache.block_size} tokens hold {capacity} tokens. Lower "
            f"--max-model-len to at most {capacity} or give the KV cache more memory "
            "(--gpu-memory-utilization, --kv-cache-memory)")
