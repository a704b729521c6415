"""Pooling (embedding) requests in the scheduler: a prefill that finishes when its prompt is
computed, chunked like any other, its blocks freed at once; MEAN / CLS never read the prefix
cache, LAST does (docs/embeddings.md)."""

from __future__ import annotations

import pytest

from tidal.engine_core.request import Request, check_pooling
from tidal.ipc.frontend_messages import FinishReason
from tidal.ipc.messages import SamplingParams
from tidal.ipc.pooling import PooledOutput, PoolerInfo, PoolingParams
from tidal.ipc.worker_messages import SampledTokens

from sched_utils import make_scheduler

POOLER = PoolerInfo("LAST", True, 64)


def pooling_request(req_id: str, prompt: list[int], kind: str = "LAST") -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                      client_id="c0", pooling=PoolingParams(kind))
    check_pooling(request, POOLER)
    return request


def pooled_answer(plan, prompt_lens: dict[str, int]) -> SampledTokens:
    """What the last-stage worker answers: a vector for each request whose prompt the plan
    completes (the fake's vector is its id's bytes)."""
    scheduled = [*plan.new_requests, *plan.cached_requests]
    pooled = [PooledOutput(r.req_id, r.req_id.encode()) for r in scheduled
              if r.num_computed_tokens + r.num_scheduled_tokens >= prompt_lens[r.req_id]]
    return SampledTokens(plan.step_id, [], b"", pooled=pooled)


def run(scheduler) -> tuple[dict[str, bytes], list[int]]:
    """Steps until every request finished: (vector per request, tokens per step)."""
    prompt_lens = {r.req_id: r.num_prompt_tokens for r in scheduler.requests.values()}
    vectors, steps = {}, []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        steps.append(plan.total_num_scheduled_tokens)
        outputs = scheduler.update(plan, pooled_answer(plan, prompt_lens))
        for out in outputs.get("c0", []):
            assert out.finish_reason == FinishReason.STOP and out.new_token_ids == b""
            vectors[out.req_id] = out.pooled
        scheduler.check_invariants()
        assert len(steps) < 50
    return vectors, steps


def test_chunked_pooling_requests_finish_when_their_prompt_is_computed():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    scheduler.add(pooling_request("a", list(range(1, 81))))  # 80 tokens: 32 + 32 + 16
    scheduler.add(pooling_request("b", list(range(100, 110))))
    vectors, steps = run(scheduler)
    assert vectors == {"a": b"a", "b": b"b"}
    assert steps == [32, 32, 26]  # b joins the third step beside a's last 16
    assert not scheduler.kv_cache_manager.req_blocks  # no request keeps a block
    assert scheduler.stats().generation_tokens == 0


def test_a_pooling_prompt_may_fill_the_context_but_not_more():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64)
    scheduler.add(pooling_request("full", list(range(1, 65))))  # == max_model_len: chunked
    vectors, _ = run(scheduler)
    assert vectors == {"full": b"full"}
    with pytest.raises(ValueError, match="at most the model's maximum context length"):
        scheduler.add(pooling_request("over", list(range(1, 66))))


@pytest.mark.parametrize("kind, hit", [("LAST", 32), ("MEAN", 0), ("CLS", 0)])
def test_only_last_pooling_reads_the_prefix_cache(kind, hit):
    scheduler = make_scheduler(max_num_batched_tokens=64, block_size=16)
    prompt = list(range(1, 41))
    scheduler.add(pooling_request("first", prompt, kind))
    run(scheduler)
    scheduler.add(pooling_request("again", prompt, kind))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == hit


def test_an_engine_takes_only_its_kind_of_request():
    generate = Request("g", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="only embedding requests"):
        check_pooling(generate, POOLER)
    check_pooling(generate, None)
    with pytest.raises(ValueError, match="takes no embedding requests"):
        check_pooling(Request("p", [1], SamplingParams(), pooling=PoolingParams()), None)


def test_dimensions_need_matryoshka_as_vllm():
    with pytest.raises(ValueError, match="does not support matryoshka"):
        POOLER.resolve(PoolingParams(dimensions=16))
    listed = PoolerInfo("LAST", True, 64, is_matryoshka=True, matryoshka_dimensions=[16, 32])
    assert listed.resolve(PoolingParams(dimensions=16)).dimensions == 16
    with pytest.raises(ValueError, match=r"only supports \[16, 32\]"):
        listed.resolve(PoolingParams(dimensions=8))
    free = PoolerInfo("MEAN", False, 64, is_matryoshka=True)
    assert free.resolve(None) == PoolingParams("MEAN", False, None)
    with pytest.raises(ValueError, match="at most the model's hidden size 64"):
        free.resolve(PoolingParams(dimensions=65))
