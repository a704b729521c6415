"""Prompt logprobs in the engine core: every prompt position after the first comes once, in
order, on the first output with a token, however the prompt was chunked or recomputed; a
request asking for them does not read the prefix cache until they are in. Block size 16."""

import pytest
from sched_utils import (
    FakeWorker, fake_prompt_logprob, make_request, make_scheduler, step,
    unpack_prompt_logprobs,
)


def _expected(prompt):
    return [(pos, prompt[pos]) for pos in range(1, len(prompt))]


def _positions(part):
    return [(pos, token) for pos, token, _ in unpack_prompt_logprobs(part)]


def _first_output(outputs, req_id):
    return next(o for outs in outputs.values() for o in outs if o.req_id == req_id)


def test_chunked_prompt_gives_every_position_once_with_the_first_token():
    """Budget 8, a 20-token prompt: chunks [0, 8), [8, 16), [16, 20). The worker reports
    positions 1-8, 9-16 and 17-19 (19 = the last; position 19's logits sample); nothing goes
    to the frontend before the first token, which carries positions 1-19 in one piece."""
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    worker = FakeWorker(16)
    prompt = list(range(100, 120))
    sched.add(make_request("a", prompt, max_tokens=3, prompt_logprobs=2))
    reported = []
    for _ in range(2):
        plan = sched.schedule()
        sampled = worker.execute(plan)
        reported.append([(p.start, p.num_positions) for p in sampled.prompt_logprobs])
        assert sched.update(plan, sampled) == {}
    _, outputs = step(sched, worker)
    assert reported == [[(1, 8)], [(9, 8)]]
    part = _first_output(outputs, "a").prompt_logprobs
    assert part.num_logprobs == 2 and _positions(part) == _expected(prompt)
    values = [v for _, _, v in unpack_prompt_logprobs(part)]
    assert values == pytest.approx([fake_prompt_logprob(p, t) for p, t in _expected(prompt)])
    _, later = step(sched, worker)
    assert all(o.prompt_logprobs is None for outs in later.values() for o in outs)


def test_one_token_prompt_gets_an_empty_piece():
    sched = make_scheduler()
    sched.add(make_request("a", [7], max_tokens=1, prompt_logprobs=0))
    _, outputs = step(sched, FakeWorker(16))
    part = _first_output(outputs, "a").prompt_logprobs
    assert part is not None and part.num_positions == 0


def test_prompt_logprobs_skip_the_prefix_cache():
    """A computes a 40-token prompt (2 full blocks published). B, the same prompt with
    prompt_logprobs, computes all 40 (no hit, and no prefix-cache query counted: vLLM
    counts none for it); C, the same prompt without, hits 32."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    prompt = list(range(200, 240))
    sched.add(make_request("a", prompt, max_tokens=1))
    step(sched, worker)
    queries = sched.prefix_cache_queries
    sched.add(make_request("b", prompt, max_tokens=1, prompt_logprobs=1))
    plan, outputs = step(sched, worker)
    assert plan.new_requests[0].num_computed_tokens == 0
    assert plan.new_requests[0].num_scheduled_tokens == 40
    first = _first_output(outputs, "b")
    assert first.num_cached_tokens == 0 and _positions(first.prompt_logprobs) == _expected(prompt)
    assert sched.prefix_cache_queries == queries
    sched.add(make_request("c", prompt, max_tokens=1))
    plan, outputs = step(sched, worker)
    assert plan.new_requests[0].num_computed_tokens == 32
    assert _first_output(outputs, "c").num_cached_tokens == 32


def test_recompute_mid_prompt_sends_no_position_twice():
    """Budget 8, a 20-token prompt: after the first chunk (positions 1-8 in) the request is
    sent back to waiting (as a preemption does; here by resetting the prefix cache with its
    running requests). It recomputes from 0, the worker reports 1-8 again, and the first
    output still holds 1-19 once each. Once they are delivered, a second recompute sends the
    request without prompt_logprobs (nothing is computed again for them)."""
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    worker = FakeWorker(16)
    prompt = list(range(300, 320))
    sched.add(make_request("a", prompt, max_tokens=4, prompt_logprobs=3))
    step(sched, worker)
    assert sched.reset_prefix_cache(reset_running_requests=True)
    outputs = {}
    while not outputs:
        plan, outputs = step(sched, worker)
    assert _positions(_first_output(outputs, "a").prompt_logprobs) == _expected(prompt)
    assert sched.reset_prefix_cache(reset_running_requests=True)
    plan = sched.schedule()
    (resent,) = plan.new_requests
    assert resent.req_id == "a" and resent.sampling.prompt_logprobs is None
    sampled = worker.execute(plan)
    assert not sampled.prompt_logprobs
    sched.update(plan, sampled)
