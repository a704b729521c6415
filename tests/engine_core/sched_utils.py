"""Test helpers for the scheduler: configs, requests, and a fake worker.

The fake worker plays the worker's side of the contract exactly as a real one would: it keeps a
persistent batch (token ids and block table per request), appends the tokens it samples itself,
drops finished and preempted requests, and keeps a fake KV cache (block id -> token id per slot)
so that every sample first checks that the KV of every earlier position holds the right token:
a prefix-cache hit on a wrong or overwritten block fails the test. The "model" is a
deterministic function of the whole token sequence.
"""

from __future__ import annotations

from array import array

import numpy as np

from tidal.engine_core.config import (
    CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
)
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.ipc.messages import (
    PromptLogprobs,
    SamplingParams,
    StructuredOutputsParams,
    pack_token_ids,
    unpack_token_ids,
)
from tidal.ipc.worker_messages import BatchPlan, RequestFailure, SampledTokens

VOCAB = 1000


def fake_model(tokens: list[int], vocab: int = VOCAB) -> int:
    """The next token: a deterministic function of the whole sequence."""
    h = 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFF
    return (h >> 7) % vocab


def fake_prompt_logprob(position: int, token: int) -> float:
    """The fake worker's log-probability of the prompt token at `position`."""
    return -position - token / 1000


def unpack_prompt_logprobs(part: PromptLogprobs) -> list[tuple[int, int, float]]:
    """(position, prompt token, its logprob) per row of a PromptLogprobs."""
    width = 1 + part.num_logprobs
    ids = unpack_token_ids(part.token_ids)
    values = array("f")
    values.frombytes(part.logprobs)
    return [(part.start + i, ids[i * width], values[i * width])
            for i in range(part.num_positions)]


def make_config(*, block_size: int = 16, max_num_seqs: int | None = None,
                max_num_batched_tokens: int = 8192, chunked: bool = True,
                caching: bool = True, policy: str = "fcfs", threshold: int = 0,
                async_scheduling: bool = False, pp: int = 1,
                speculative_config: dict | None = None) -> EngineConfig:
    if max_num_seqs is None:
        max_num_seqs = min(256, max_num_batched_tokens)
    return EngineConfig(
        model=ModelConfig("unused-model-dir"),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=chunked, scheduling_policy=policy,
                                  long_prefill_token_threshold=threshold,
                                  async_scheduling=async_scheduling,
                                  speculative_config=speculative_config),
        parallel=ParallelConfig(pipeline_parallel_size=pp))


def make_scheduler(*, num_blocks: int = 10_000, max_model_len: int = 4096,
                   **config_kwargs) -> Scheduler:
    return Scheduler(make_config(**config_kwargs), num_blocks, max_model_len)


def make_request(req_id, prompt, *, max_tokens: int | None = 16, min_tokens: int = 0,
                 eos: int | None = None, stop_token_ids=(), ignore_eos: bool = False,
                 priority: int = 0, arrival_time: float = 0.0, client_id: str = "c0",
                 cache_salt: str | None = None, prompt_logprobs: int | None = None,
                 structured_outputs: StructuredOutputsParams | None = None) -> Request:
    """`prompt` is a list of token ids, or an int n meaning [id-derived token] * n."""
    if isinstance(prompt, int):
        prompt = [hash_free_token(req_id)] * prompt
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                              stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                              prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured_outputs)
    return Request(str(req_id), prompt, sampling, client_id=client_id, eos_token_id=eos,
                   priority=priority, arrival_time=arrival_time, cache_salt=cache_salt)


def hash_free_token(req_id) -> int:
    """A per-request prompt token that does not depend on Python's hash() seed."""
    return sum(str(req_id).encode()) % 997 + 1


class _WorkerRequest:
    __slots__ = ("tokens", "table", "prompt_len", "prompt_logprobs")

    def __init__(self, tokens: list[int], table: list[int], prompt_len: int = 0,
                 prompt_logprobs: int | None = None) -> None:
        self.tokens = tokens
        self.table = table
        self.prompt_len = prompt_len
        self.prompt_logprobs = prompt_logprobs


class FakeWorker:
    """A worker with a persistent batch, a token-level fake KV cache and a fake model."""

    def __init__(self, block_size: int, model=fake_model, pipelined: bool = False,
                 draft_model=None) -> None:
        self.block_size = block_size
        self.model = model
        self.draft_model = draft_model
        """Speculative draft_model: tokens -> next token, greedy, for `num_model_drafts`."""
        self.pipelined = pipelined
        """As the stages of a pipeline: sampled tokens are not appended here; they come back
        in the next plan's `new_token_ids`."""
        self.batch: dict[str, _WorkerRequest] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.num_scheduled: dict[str, int] = {}
        """req_id -> tokens computed over the whole run (for waste checks)."""
        self.refuse: set[str] = set()
        """req_ids refused as a real worker refuses bad data: never taken in, reported in
        `SampledTokens.failed`, skipped while later plans still list them."""
        self.refused: set[str] = set()
        self.grammars: dict[str, str] = {}
        """req_id -> "compiling" | "compiled" | "failed", from `BatchPlan.grammars` until the
        request is finished (as a real worker's compiles)."""
        self.hold_grammars: set[str] = set()
        """Grammars that do not finish compiling while listed here (a slow compile)."""
        self.bad_grammars: set[str] = set()
        """Grammars that fail to compile."""

    def execute(self, plan: BatchPlan, forced: dict[str, int] | None = None) -> SampledTokens:
        """Run one step; `forced` overrides the model's token for some requests."""
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            had_grammar = (self.grammars.pop(req_id, None) is not None
                           if req_id in plan.finished_req_ids else req_id in self.grammars)
            if req_id in self.refused:
                self.refused.discard(req_id)
                continue
            assert self.batch.pop(req_id, None) is not None or had_grammar, (
                f"dropped unknown {req_id}")
        for job in plan.grammars:
            assert job.req_id not in self.grammars, f"{job.req_id}'s grammar sent twice"
            self.grammars[job.req_id] = "compiling"
        work, failed, num_skipped = [], [], 0
        drafts: dict[str, list[int]] = {}  # speculative decoding: this step's drafts
        for new in plan.new_requests:
            if new.req_id in self.refuse:
                self.refused.add(new.req_id)
                failed.append(RequestFailure(new.req_id, f"token_ids of {new.req_id} are bad"))
                num_skipped += new.num_scheduled_tokens
                continue
            assert new.req_id not in self.batch, f"{new.req_id} sent twice as new"
            if new.sampling.structured_outputs is not None:
                assert self.grammars.get(new.req_id) == "compiled", (
                    f"{new.req_id} scheduled before its grammar compiled")
            if new.sampling.prompt_logprobs is not None:
                assert new.num_computed_tokens == 0, "prompt logprobs over a prefix-cache hit"
            state = _WorkerRequest(unpack_token_ids(new.token_ids).tolist(), list(new.block_ids),
                                   new.prompt_len, new.sampling.prompt_logprobs)
            self.batch[new.req_id] = state
            work.append((new.req_id, state, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in plan.cached_requests:
            if cached.req_id in self.refused:
                num_skipped += cached.num_scheduled_tokens
                continue
            state = self.batch[cached.req_id]
            state.table.extend(cached.new_block_ids)
            if self.pipelined:
                state.tokens += unpack_token_ids(cached.new_token_ids).tolist()
            else:
                assert not cached.new_token_ids, "tokens sent to a worker that samples them"
            if cached.spec_token_ids:
                drafts[cached.req_id] = unpack_token_ids(cached.spec_token_ids).tolist()
            if cached.num_model_drafts:  # as workers/drafter.py: the draft's greedy run
                seq = list(state.tokens)
                for _ in range(cached.num_model_drafts):
                    seq.append(self.draft_model(seq))
                drafts[cached.req_id] = seq[len(state.tokens):]
            work.append((cached.req_id, state, cached.num_computed_tokens,
                         cached.num_scheduled_tokens))
        assert sum(w[3] for w in work) + num_skipped == plan.total_num_scheduled_tokens
        for req_id, state, start, num in work:  # pass 1: write the step's KV
            draft = drafts.get(req_id, [])  # the drafts' KV too, right or wrong
            state.tokens += draft
            self._write_kv(state, start, start + num)
            del state.tokens[len(state.tokens) - len(draft):]
            self.num_scheduled[req_id] = self.num_scheduled.get(req_id, 0) + num
        prompt_logprobs = [part for req_id, state, start, num in work
                           if (part := self._prompt_logprobs(req_id, state, start, num))]
        req_ids, token_ids, counts = [], [], []
        for req_id, state, start, num in work:  # pass 2: attention + sampling
            draft = drafts.get(req_id, [])
            if start + num == len(state.tokens) + len(draft):
                self._check_kv(req_id, state)
                tokens = self._verify(state.tokens, draft, (forced or {}).get(req_id))
                if not self.pipelined:
                    state.tokens += tokens
                req_ids.append(req_id)
                token_ids += tokens
                counts.append(len(tokens))
        ready = self._grammar_news(failed)
        return SampledTokens(plan.step_id, req_ids, pack_token_ids(token_ids), failed=failed,
                             prompt_logprobs=prompt_logprobs, grammars_ready=ready,
                             num_tokens=pack_token_ids(counts) if drafts else b"")

    def _verify(self, tokens: list[int], draft: list[int], forced: int | None) -> list[int]:
        """The model's token after `tokens`, and after each draft it agrees with (greedy
        verification); `forced` replaces the first token."""
        seq, out = list(tokens), []
        for j in range(len(draft) + 1):
            token = forced if forced is not None and j == 0 else self.model(seq)
            out.append(token)
            if j == len(draft) or draft[j] != token:
                return out
            seq.append(token)
        return out

    def _grammar_news(self, failed: list[RequestFailure]) -> list[str]:
        """Compiles that ended this step: the ready ones returned, the bad ones in `failed`."""
        ready = []
        for req_id, state in self.grammars.items():
            if state != "compiling" or req_id in self.hold_grammars:
                continue
            if req_id in self.bad_grammars:
                self.grammars[req_id] = "failed"
                failed.append(RequestFailure(req_id, "structured_outputs.json does not compile"))
            else:
                self.grammars[req_id] = "compiled"
                ready.append(req_id)
        return ready

    @staticmethod
    def _prompt_logprobs(req_id: str, state: _WorkerRequest, start: int,
                         num: int) -> PromptLogprobs | None:
        """As the real worker: positions start+1 .. min(start+num, prompt_len-1) of a request
        that wants them (each row's alternatives are the prompt token plus 1, 2, ...)."""
        k = state.prompt_logprobs
        end = min(start + num, state.prompt_len - 1)
        if k is None or end <= start:
            return None
        ids, values, ranks = [], [], []
        for pos in range(start + 1, end + 1):
            token = state.tokens[pos]
            ids += [token] + [token + j for j in range(1, k + 1)]
            values += [fake_prompt_logprob(pos, token)] + [-0.5 * j for j in range(1, k + 1)]
            ranks.append(1 + token % 3)
        return PromptLogprobs(req_id, start + 1, k, pack_token_ids(ids),
                              np.asarray(values, "<f4").tobytes(), pack_token_ids(ranks))

    def _write_kv(self, state: _WorkerRequest, start: int, end: int) -> None:
        assert 0 <= start < end <= len(state.tokens), (start, end, len(state.tokens))
        bs = self.block_size
        assert len(state.table) * bs >= end, "block table too short"
        for pos in range(start, end):
            block = self.kv.setdefault(state.table[pos // bs], [None] * bs)
            block[pos % bs] = state.tokens[pos]

    def _check_kv(self, req_id: str, state: _WorkerRequest) -> None:
        bs = self.block_size
        for pos, token in enumerate(state.tokens):
            block_id = state.table[pos // bs]
            assert block_id != 0, "null block in a block table"
            got = self.kv.get(block_id, [None] * bs)[pos % bs]
            assert got == token, f"{req_id}: KV at position {pos} holds {got}, expected {token}"


def step(sched: Scheduler, worker: FakeWorker, forced: dict[str, int] | None = None):
    """One synchronous step: schedule, execute, update. Returns (plan, outputs)."""
    plan = sched.schedule()
    sampled = worker.execute(plan, forced)
    outputs = sched.update(plan, sampled)
    sched.check_invariants()
    return plan, outputs


def scheduled_tokens(plan: BatchPlan) -> dict[str, int]:
    """req_id -> tokens scheduled in this plan."""
    out = {n.req_id: n.num_scheduled_tokens for n in plan.new_requests}
    out.update({c.req_id: c.num_scheduled_tokens for c in plan.cached_requests})
    return out


def output_tokens(outputs: dict, req_id: str) -> list[int]:
    """New token ids for one request in one update() result."""
    return [t for outs in outputs.values() for o in outs if o.req_id == req_id
            for t in unpack_token_ids(o.new_token_ids)]


def reference_tokens(prompt: list[int], *, max_tokens: int, max_model_len: int,
                     eos: int | None = None, stop_token_ids=(), min_tokens: int = 0,
                     model=fake_model) -> list[int]:
    """What an unconstrained run of the fake model generates."""
    tokens, out = list(prompt), []
    max_tokens = min(max_tokens, max_model_len - len(prompt))
    while True:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) > min_tokens and (t == eos or t in stop_token_ids):
            return out
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out
