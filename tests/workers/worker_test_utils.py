"""Test helpers for the worker: a minimal engine-core stand-in that scripts BatchPlans
(sync scheduling, chunked prefill, block allocation) and feeds back sampled tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tidal.engine_core.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData, WorkerConfig


def worker_config(model: str, rank: int = 0, dist_init_method: str = "",
                  **fields) -> WorkerConfig:
    """Worker `rank`'s config as the engine core builds it (`EngineConfig.worker_config`),
    for a CPU engine sized for tiny models (float32, 256-token context, 16 sequences, 128 KV
    blocks); `fields` set EngineConfig fields by name, in whichever part holds them."""
    values = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
                  max_num_batched_tokens=512, num_kv_blocks_override=128) | fields
    parts = {}
    for part in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        names = {f.name for f in dataclasses.fields(part)} & values.keys()
        parts[part] = {name: values.pop(name) for name in names}
    assert not values, f"not EngineConfig fields: {sorted(values)}"
    config = EngineConfig(ModelConfig(model, **parts[ModelConfig]),
                          CacheConfig(**parts[CacheConfig]),
                          SchedulerConfig(**parts[SchedulerConfig]),
                          ParallelConfig(**parts[ParallelConfig]))
    return config.worker_config(rank, config.model.max_model_len, dist_init_method)


@dataclass
class ScriptedRequest:
    req_id: str
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    seen: bool = False
    eos_token_id: int | None = None
    num_resumed_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


class PlanScript:
    """Schedules every unfinished request each step, at most `chunk` tokens each."""

    def __init__(self, block_size: int = 16, first_block: int = 1):
        self.block_size = block_size
        self.next_block = first_block
        self.step_id = 0
        self.requests: dict[str, ScriptedRequest] = {}
        self.finished: list[str] = []
        self.done: dict[str, ScriptedRequest] = {}

    def add(self, req_id: str, prompt: list[int], sampling: SamplingParams | None = None,
            num_computed: int = 0, block_ids: list[int] | None = None,
            eos_token_id: int | None = None, num_resumed_tokens: int = 0) -> ScriptedRequest:
        req = ScriptedRequest(req_id, list(prompt), len(prompt),
                              sampling or SamplingParams(temperature=0.0, max_tokens=8),
                              list(block_ids or []), num_computed, eos_token_id=eos_token_id,
                              num_resumed_tokens=num_resumed_tokens)
        self.requests[req_id] = req
        return req

    def _allocate(self, req: ScriptedRequest, num_tokens: int) -> None:
        while len(req.block_ids) * self.block_size < num_tokens:
            req.block_ids.append(self.next_block)
            req.new_block_ids.append(self.next_block)
            self.next_block += 1

    def plan(self, chunk: int = 10**9) -> BatchPlan:
        new, cached = [], []
        total = 0
        for req in self.requests.values():
            n = min(len(req.token_ids) - req.num_computed, chunk)
            self._allocate(req, req.num_computed + n)
            total += n
            if not req.seen:
                new.append(NewRequestData(
                    req.req_id, pack_token_ids(req.token_ids), req.prompt_len,
                    list(req.block_ids), req.num_computed, n, req.sampling,
                    eos_token_id=req.eos_token_id,
                    num_resumed_tokens=req.num_resumed_tokens))
                req.seen = True
            else:
                cached.append(CachedRequestData(req.req_id, list(req.new_block_ids),
                                                req.num_computed, n))
            req.new_block_ids = []
            req.num_computed += n
        plan = BatchPlan(self.step_id, new, cached, finished_req_ids=self.finished,
                         total_num_scheduled_tokens=total)
        self.finished = []
        self.step_id += 1
        return plan

    def record(self, sampled) -> None:
        """Append sampled tokens: a SampledTokens (rank 0) or a runner StepResult (any rank)."""
        if sampled is None:
            return
        tokens = sampled.token_ids
        tokens = unpack_token_ids(tokens) if isinstance(tokens, bytes) else tokens.tolist()
        for req_id, token in zip(sampled.req_ids, tokens):
            req = self.requests[req_id]
            req.token_ids.append(token)
            if len(req.output_ids) >= req.sampling.max_tokens:
                self.finish(req_id)

    def finish(self, req_id: str) -> None:
        self.done[req_id] = self.requests.pop(req_id)
        self.finished.append(req_id)

    def run(self, worker, chunk: int = 10**9, max_steps: int = 1000,
            any_rank: bool = False) -> dict[str, list[int]]:
        """Step until every request is finished; returns req_id -> output token ids.
        `any_rank` steps the runner directly, so ranks other than 0 see their tokens too."""
        step = worker.runner.execute if any_rank else worker.execute
        for _ in range(max_steps):
            if not self.requests:
                break
            self.record(step(self.plan(chunk)))
        return {req_id: req.output_ids for req_id, req in self.done.items()}


class AsyncPlanScript(PlanScript):
    """Async scheduling as the engine core does it: plan N+1 is built before step N's
    tokens are known. A request that samples in step N gets a placeholder (-1) token, so
    plan N+1 schedules it one token past it; the worker fills the placeholder itself (the
    token it sampled). No request is scheduled past max_tokens, placeholders counted."""

    def plan(self, chunk: int = 10**9) -> BatchPlan:
        full = [r for r in self.requests.values()
                if len(r.output_ids) >= r.sampling.max_tokens]
        held = {r.req_id: self.requests.pop(r.req_id) for r in full}
        plan = super().plan(chunk)
        self.requests.update(held)
        for req in self.requests.values():
            if req.req_id not in held and req.num_computed == len(req.token_ids):
                req.token_ids.append(-1)  # placeholder for the token being sampled
        return plan

    def record(self, sampled) -> None:
        tokens = sampled.token_ids
        tokens = unpack_token_ids(tokens) if isinstance(tokens, bytes) else tokens.tolist()
        for req_id, token in zip(sampled.req_ids, tokens):
            req = self.requests[req_id]
            req.token_ids[req.token_ids.index(-1)] = token
            if -1 not in req.token_ids and len(req.output_ids) >= req.sampling.max_tokens:
                self.finish(req_id)

    def run(self, worker, chunk: int = 10**9, max_steps: int = 1000,
            any_rank: bool = False) -> dict[str, list[int]]:
        step = worker.runner.execute if any_rank else worker.execute
        plan = self.plan(chunk)
        for _ in range(max_steps):
            result = step(plan)  # step N runs ...
            has_next = any(len(r.output_ids) < r.sampling.max_tokens
                           for r in self.requests.values())
            plan = self.plan(chunk) if has_next else None  # ... while N+1 is planned
            self.record(result)
            if plan is None:
                break
        return {req_id: req.output_ids for req_id, req in self.done.items()}


# ---------------------------------------------------------------------------------------------
# logits against transformers


def prompt_ids(seed: int = 0, n: int = 100) -> list[int]:
    """`n` token ids in [3, 512) (the tiny models' vocabulary), fixed by `seed`."""
    import torch

    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(path: str, dtype: str, tokens: list[int]):
    """transformers' logits for every position of `tokens`, the model loaded in `dtype`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|, in ref's dtype."""
    return ((ours.to(ref.dtype) - ref).abs().max() / ref.abs().max()).item()


def loaded_worker(path: str, dtype: str, **overrides):
    """A CPU Worker on `path`, loaded, its KV cache allocated."""
    from tidal.workers.worker import Worker

    worker = Worker(worker_config(path, dtype=dtype, **overrides))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    return worker


def chunked_logits(worker, tokens: list[int], chunk: int, req_id: str, **add):
    """Logits of every scheduled token, the prompt fed `chunk` tokens per step."""
    import torch

    script = PlanScript(first_block=add.pop("first_block", 1))
    script.add(req_id, tokens, **add)
    parts = []
    while script.requests[req_id].num_computed < len(tokens):
        parts.append(worker.runner.compute_logits_all(script.plan(chunk)))
    return torch.cat(parts)
