"""A fake AsyncLLM for unit tests of the HTTP layer alone (no engine core, no model).

It follows frontend-contract.md's AsyncLLM surface: `engine_info`, `tokenizer`, `model_name`,
`encode_prompt`, `check_structured_outputs` (the real xgrammar check), `generate` (async
iterator of the real `RequestOutput`s, with deltas), `abort`, `fail_requests`, `get_stats`,
`close`, `dead`, `attached`, `away_reason`. Tokens are deterministic: completion j of a
prompt whose last token is t generates t+1+j, t+2+j, ... (mod a small range of plain
tokens).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tidal.frontend.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tidal.frontend.structured_output import GrammarChecker
from tidal.ipc.frontend_messages import EngineInfo, SchedulerStats


class FakeEngine:
    """Deterministic token generator with the AsyncLLM surface the server uses."""

    def __init__(self, tokenizer, max_model_len: int = 64, token_delay: float = 0.0,
                 max_num_queued_reqs: int | None = None, fail_with: str | None = None,
                 refuse_with: str | None = None, scheduling_policy: str = "fcfs",
                 max_num_queued_tokens: int | None = None,
                 max_queue_delay: float | None = None):
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.engine_info = SimpleNamespace(model="/models/fake", max_model_len=max_model_len,
                                           max_num_queued_reqs=max_num_queued_reqs,
                                           max_num_queued_tokens=max_num_queued_tokens,
                                           max_queue_delay=max_queue_delay,
                                           scheduling_policy=scheduling_policy,
                                           stream_interval=1)
        self.token_delay = token_delay
        self.fail_with = fail_with
        self.refuse_with = refuse_with  # as the engine core refusing a request: ValueError
        self.failed_all: str | None = None  # fail_requests(reason) was called
        self.dead = False
        self.attached = True  # False: the core is away (503 with Retry-After)
        self.away_reason: str | None = None
        self.closed = False
        self.active: set[str] = set()
        self.aborted: list[str] = []  # generate() iterators closed before the end
        self.abort_calls: list[str] = []  # explicit abort(req_id) calls
        self.generated: dict[str, tuple] = {}  # req_id -> (prompt ids, params, priority)
        self.stats = SchedulerStats(num_kv_blocks=100)
        first = tokenizer.convert_tokens_to_ids("a")
        self._plain = list(range(first, first + 20))  # ids of ordinary tokens

    async def check_structured_outputs(self, params) -> None:
        """AsyncLLM's check: ValueError when the constraint does not compile."""
        info = EngineInfo(model="/models/fake", max_model_len=self.engine_info.max_model_len,
                          num_kv_blocks=100, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=64, vocab_size=len(self.tokenizer))
        eos = self.tokenizer.eos_token_id
        GrammarChecker(self.tokenizer, info, 0 if eos is None else eos).check(params)

    def encode_prompt(self, prompt):
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) \
            if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.engine_info.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len="
                             f"{self.engine_info.max_model_len}")
        return ids

    def _token(self, prompt_ids, index: int, step: int) -> int:
        return self._plain[(prompt_ids[-1] + index + step) % len(self._plain)]

    def _logprobs(self, token_id: int, num_top: int, rank: int = 1) -> dict:
        """The token at `rank`, then `num_top` alternatives at the other ranks from 1."""
        entry = {token_id: Logprob(token_id, -0.25 * rank, rank,
                                   self.tokenizer.decode([token_id]))}
        alt_ranks = [r for r in range(1, num_top + 2) if r != rank][:num_top]
        for alt_rank in alt_ranks:
            alt = self._plain[(token_id + alt_rank) % len(self._plain)]
            if alt not in entry:
                entry[alt] = Logprob(alt, -1.0 * alt_rank, alt_rank,
                                     self.tokenizer.decode([alt]))
        return entry

    async def generate(self, prompt, params, request_id=None, *, priority=0,
                       stream_interval=None):
        prompt_ids = list(prompt)
        self.generated[request_id] = (prompt_ids, params, priority)
        self.active.add(request_id)
        metrics = RequestMetrics(arrival_time=time.time(), first_token_time=None,
                                 last_token_time=None, finished_time=None, queue_time=None,
                                 num_prompt_tokens=len(prompt_ids), num_generation_tokens=0,
                                 num_cached_tokens=0)
        if self.refuse_with:
            self.active.discard(request_id)
            raise ValueError(self.refuse_with)
        tokens = {j: [] for j in range(params.n)}
        lps = {j: [] for j in range(params.n)}
        prompt_lps = None
        if params.prompt_logprobs is not None:  # the prompt token at rank 2, as a fake
            prompt_lps = [None] + [self._logprobs(t, params.prompt_logprobs, rank=2)
                                   for t in prompt_ids[1:]]
        try:
            for step in range(params.max_tokens or 8):
                await asyncio.sleep(self.token_delay)
                if self.failed_all:
                    yield self._failed(request_id, prompt_ids, params, tokens)
                    return
                outs = [self._step(prompt_ids, params, j, step, tokens[j], lps[j])
                        for j in range(params.n)]
                done = step + 1 == (params.max_tokens or 8)
                self._time(metrics, done)
                yield RequestOutput(request_id, None, prompt_ids, outs, done,
                                    metrics if done else None, prompt_lps)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        finally:
            self.active.discard(request_id)

    def _time(self, metrics: RequestMetrics, done: bool) -> None:
        now = time.time()
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.queue_time = 0.001
        else:
            metrics.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        if done:
            metrics.finished_time = now

    def _step(self, prompt_ids, params, index, step, tokens, lps) -> CompletionOutput:
        token = self._token(prompt_ids, index, step)
        tokens.append(token)
        delta_lp = None
        if params.logprobs is not None:
            delta_lp = [self._logprobs(token, params.logprobs)]
            lps.extend(delta_lp)
        last = step + 1 == (params.max_tokens or 8)
        reason = ("error" if self.fail_with else "length") if last else None
        return CompletionOutput(
            index=index, text=self.tokenizer.decode(tokens), token_ids=list(tokens),
            delta_text=self.tokenizer.decode([token]), delta_token_ids=[token],
            logprobs=list(lps) if params.logprobs is not None else None,
            delta_logprobs=delta_lp, cumulative_logprob=None, finish_reason=reason,
            stop_reason=None, error=self.fail_with if last else None)

    def _failed(self, request_id, prompt_ids, params, tokens) -> RequestOutput:
        outs = [CompletionOutput(
            index=j, text=self.tokenizer.decode(tokens[j]), token_ids=list(tokens[j]),
            delta_text="", delta_token_ids=[], logprobs=None, delta_logprobs=None,
            cumulative_logprob=None, finish_reason="error", stop_reason=None,
            error=self.failed_all) for j in range(params.n)]
        return RequestOutput(request_id, None, prompt_ids, outs, True, None)

    def fail_requests(self, reason: str) -> None:
        self.failed_all = reason

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    async def get_stats(self) -> SchedulerStats:
        self.stats.num_running = len(self.active)
        return self.stats

    async def close(self) -> None:
        self.closed = True
