"""vLLM's scheduler behaviours (docs/architecture.md §7, items 1-13), driven by a fake worker.

Block math is in each docstring; block size is 16 unless stated.
"""

import logging

import pytest
from sched_utils import (
    FakeWorker, make_request, make_scheduler, output_tokens, reference_tokens,
    scheduled_tokens, step,
)

from tidal.engine_core.request import RequestStatus
from tidal.ipc.frontend_messages import FinishReason
from tidal.ipc.messages import TokenLogprobs, pack_token_ids
from tidal.ipc.worker_messages import SampledTokens


@pytest.fixture(autouse=True)
def _quiet_preemption_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="tidal.engine_core.scheduler")


def test_add_and_abort_waiting():
    """§7.1: add() queues requests; aborting a waiting one removes it and shrinks the queue;
    the unfinished count drops per finish. No blocks are involved (nothing scheduled)."""
    sched = make_scheduler()
    for i in range(3):
        sched.add(make_request(i, 10))
    assert len(sched.waiting) == 3 and sched.num_unfinished_requests() == 3
    out = sched.abort(["1"])
    assert [o.finish_reason for o in out["c0"]] == [FinishReason.ABORT]
    assert [r.req_id for r in sched.waiting] == ["0", "2"]
    assert sched.num_unfinished_requests() == 2
    assert sched.abort(["1", "nope"]) == {}  # idempotent
    sched.abort(["0", "2"])
    assert not sched.has_unfinished_requests()
    sched.check_invariants()


def test_all_admitted_in_one_step_in_arrival_order():
    """§7.2: ten 20-token prompts (2 blocks each, 20 of 9999 usable blocks) fit the 8192-token
    budget: all are admitted as new with their whole prompt, waiting empties, running keeps
    arrival order."""
    sched = make_scheduler()
    for i in range(10):
        sched.add(make_request(i, 20))
    plan = sched.schedule()
    assert [n.req_id for n in plan.new_requests] == [str(i) for i in range(10)]
    assert all(n.num_scheduled_tokens == 20 and n.num_computed_tokens == 0
               for n in plan.new_requests)
    assert not plan.cached_requests and not sched.waiting
    assert [r.req_id for r in sched.running] == [str(i) for i in range(10)]
    assert plan.total_num_scheduled_tokens == 200


def test_chunked_prefill_80_tokens_budget_50():
    """§7.3: an 80-token prompt with a 50-token budget runs as 50 then exactly the remaining
    30 (blocks: 4 after step 1 (50 tokens), 5 after step 2). Nothing is emitted mid-prefill."""
    sched = make_scheduler(max_num_batched_tokens=50, max_num_seqs=4)
    worker = FakeWorker(16)
    sched.add(make_request("a", 80))
    plan, out = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 50} and out == {}
    assert len(sched.kv_cache_manager.req_blocks["a"]) == 4
    plan, out = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 30}
    assert plan.cached_requests[0].num_computed_tokens == 50
    assert len(output_tokens(out, "a")) == 1
    assert len(sched.kv_cache_manager.req_blocks["a"]) == 5


def test_long_prefill_threshold_three_800_token_prompts():
    """§7.4: threshold 400, budget 1024, three 800-token prompts (50 blocks each) →
    400/400/224, then 400/400/224, then 1/1/352 (the first two finished their prompts and
    decode while the third finishes its own)."""
    sched = make_scheduler(max_num_batched_tokens=1024, threshold=400, max_model_len=2048)
    worker = FakeWorker(16)
    for name in "abc":
        sched.add(make_request(name, 800))
    got = [scheduled_tokens(step(sched, worker)[0]) for _ in range(3)]
    assert got == [{"a": 400, "b": 400, "c": 224}, {"a": 400, "b": 400, "c": 224},
                   {"a": 1, "b": 1, "c": 352}]


def test_no_chunking_blocks_the_queue():
    """§7.5: chunked prefill off, budget 512: A (300 tokens) runs, B (400) does not fit the
    remaining 212 and blocks the queue, so C (10) waits although it would fit. With chunking,
    B gets 212 tokens: two new requests instead of one."""
    unchunked = make_scheduler(max_num_batched_tokens=512, chunked=False, max_model_len=512)
    chunked = make_scheduler(max_num_batched_tokens=512, max_model_len=512)
    for sched in (unchunked, chunked):
        for name, n in (("a", 300), ("b", 400), ("c", 10)):
            sched.add(make_request(name, n))
    assert scheduled_tokens(unchunked.schedule()) == {"a": 300}
    assert scheduled_tokens(chunked.schedule()) == {"a": 300, "b": 212}


def test_stop_on_eos():
    """§7.6: a request whose first sampled token is EOS finishes STOP with output [EOS]; the
    next plan lists it in finished_req_ids and its blocks (1 of 10 tokens) are free; the
    other request continues."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", 10, eos=2))
    sched.add(make_request("b", 10, eos=2))
    _, out = step(sched, worker, forced={"a": 2, "b": 5})
    (a_out,) = [o for o in out["c0"] if o.req_id == "a"]
    assert output_tokens(out, "a") == [2] and a_out.finish_reason == FinishReason.STOP
    assert a_out.stop_reason is None
    assert [r.req_id for r in sched.running] == ["b"]
    assert "a" not in sched.kv_cache_manager.req_blocks
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["a"] and scheduled_tokens(plan) == {"b": 1}


def test_stop_token_and_late_in_flight_token_dropped():
    """§7.7 (no drafts here): a stop token ends the request with stop_reason = that id and the
    stop token in the output. With async scheduling, the token of the step that was already
    in flight when the stop was seen is dropped, and the next plan tells the workers."""
    sched = make_scheduler(async_scheduling=True)
    worker = FakeWorker(16)
    sched.add(make_request("a", 10, stop_token_ids=[77]))
    plan1 = sched.schedule()
    res1 = worker.execute(plan1, forced={"a": 5})
    plan2 = sched.schedule()  # planned before step 1's result is known
    assert scheduled_tokens(plan2) == {"a": 1}
    res2 = worker.execute(plan2, forced={"a": 77})
    plan3 = sched.schedule()
    res3 = worker.execute(plan3, forced={"a": 9})
    sched.update(plan1, res1)
    out2 = sched.update(plan2, res2)
    out3 = sched.update(plan3, res3)
    (final,) = out2["c0"]
    assert final.finish_reason == FinishReason.STOP and final.stop_reason == 77
    assert output_tokens(out2, "a") == [77] and out3 == {}
    assert sched.schedule().finished_req_ids == ["a"]
    sched.check_invariants()


def test_max_tokens_and_context_length():
    """§7.8: output is exactly max_tokens long, finish LENGTH; a request near max_model_len
    (prompt 60 of 64) stops at the context length after 4 tokens even with max_tokens 16."""
    sched = make_scheduler(max_model_len=64)
    worker = FakeWorker(16)
    sched.add(make_request("a", 10, max_tokens=3))
    sched.add(make_request("b", 60, max_tokens=16))
    tokens = {"a": [], "b": []}
    reasons = {}
    while sched.has_unfinished_requests():
        _, out = step(sched, worker)
        for o in out.get("c0", []):
            tokens[o.req_id] += output_tokens({"c": [o]}, o.req_id)
            if o.finish_reason is not None:
                reasons[o.req_id] = o.finish_reason
    assert len(tokens["a"]) == 3 and len(tokens["b"]) == 4
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_ignore_eos():
    """§7.9: with ignore_eos, EOS is just a token; the request runs to max_tokens."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", 10, eos=2, ignore_eos=True, max_tokens=3))
    outs = [step(sched, worker, forced={"a": 2})[1] for _ in range(3)]
    assert [output_tokens(o, "a") for o in outs] == [[2], [2], [2]]
    assert outs[-1]["c0"][0].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("stopper", ["eos", "stop_token"])
def test_min_tokens(stopper):
    """§7.10: EOS or a stop token cannot end the request until more than min_tokens (3)
    tokens exist (the worker masks them before that); afterwards it stops normally."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", 10, eos=2, stop_token_ids=[3], min_tokens=3, max_tokens=10))
    tok = 2 if stopper == "eos" else 3
    outs = [step(sched, worker, forced={"a": tok})[1] for _ in range(4)]
    assert [o["c0"][0].finish_reason for o in outs] == [None, None, None, FinishReason.STOP]
    assert not sched.has_unfinished_requests()


def test_decode_scheduled_while_previous_step_in_flight():
    """§7.11: with a step in flight (A's prefill), the next plan already gives A one decode
    token (a placeholder for the token the worker is sampling); B, admitted in the second
    plan, gets its prompt. After step 1's result, A is scheduled 1 token again."""
    sched = make_scheduler(async_scheduling=True)
    worker = FakeWorker(16)
    sched.add(make_request("a", 20))
    plan1 = sched.schedule()
    res1 = worker.execute(plan1)
    sched.add(make_request("b", 12))
    plan2 = sched.schedule()
    assert scheduled_tokens(plan2) == {"b": 12, "a": 1}
    assert plan2.cached_requests[0].num_computed_tokens == 20
    res2 = worker.execute(plan2)
    sched.update(plan1, res1)
    plan3 = sched.schedule()
    assert scheduled_tokens(plan3) == {"a": 1, "b": 1}
    assert plan3.cached_requests[0].num_computed_tokens == 21
    sched.update(plan2, res2)
    sched.update(plan3, worker.execute(plan3))
    sched.check_invariants()


def test_preemption_during_execution_discards_and_recomputes():
    """§7.12: 11 blocks (10 usable), max_model_len 160; A and B have 80-token prompts (5
    blocks each, pool full). Async: step 2 is planned before step 1's result; A's decode at
    position 80 needs a 6th block, so B (last admitted) is preempted: running == [A], B is
    PREEMPTED and listed in preempted_req_ids. B's in-flight step-1 token is dropped when it
    arrives; B resumes after A finishes (B's first 4 blocks are still cached: 64-token hit)
    and its final tokens equal an unconstrained run."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, async_scheduling=True)
    worker = FakeWorker(16)
    a = make_request("a", 80, max_tokens=10)
    b = make_request("b", [3] * 80, max_tokens=4)
    sched.add(a)
    sched.add(b)
    plan1 = sched.schedule()
    res1 = worker.execute(plan1)
    plan2 = sched.schedule()
    assert [r.req_id for r in sched.running] == ["a"] and b.status == RequestStatus.PREEMPTED
    assert plan2.preempted_req_ids == ["b"] and scheduled_tokens(plan2) == {"a": 1}
    out1 = sched.update(plan1, res1)
    assert output_tokens(out1, "b") == [] and b.output_token_ids == []
    assert sched.num_preemptions == 1
    inflight = [(plan2, worker.execute(plan2))]
    tokens = {"a": output_tokens(out1, "a"), "b": []}
    while sched.has_unfinished_requests() or inflight:
        if sched.has_unfinished_requests():
            plan = sched.schedule()
            inflight.append((plan, worker.execute(plan)))
            if any(n.req_id == "b" for n in plan.new_requests):
                (nb,) = plan.new_requests
                assert nb.num_computed_tokens == 64 and len(nb.token_ids) == 80 * 4
        out = sched.update(*inflight.pop(0))
        for name in tokens:
            tokens[name] += output_tokens(out, name)
        sched.check_invariants()
    for req in (a, b):
        assert tokens[req.req_id] == reference_tokens(
            req.prompt_token_ids, max_tokens=req.sampling.max_tokens, max_model_len=160)
    stats = sched.stats()
    assert (stats.preempted_prefix_cache_queries, stats.preempted_prefix_cache_hits) == (80, 64)
    assert stats.prefix_cache_queries == 160 and stats.num_preemptions == 1


def test_preempted_request_resumes_with_all_its_tokens():
    """§7.13: 11 blocks (10 usable). A has 79 prompt tokens, B 78 (5 blocks each: pool full).
    Step 1 samples a1, b1; step 2 computes positions 79 and 78 in place; step 3 A needs
    position 80 → a 6th block → B is preempted after generating b1, b2 (4 of its blocks are
    published, the partial 5th goes to the free-list head and is A's new block). A finishes
    (max_tokens 3) in step 3; in step 4 B comes back as a new request with all 80 known
    tokens (78 prompt + 2 generated), a 64-token hit and 16 tokens to compute."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    sched.add(make_request("a", 79, max_tokens=3))
    sched.add(make_request("b", 78, max_tokens=8))
    step(sched, worker)
    _, out2 = step(sched, worker)
    b_tokens = sched.requests["b"].output_token_ids[:]
    assert len(b_tokens) == 2
    plan3, _ = step(sched, worker)
    assert plan3.preempted_req_ids == ["b"]
    (ca,) = plan3.cached_requests
    assert ca.req_id == "a" and ca.new_block_ids == [10]
    plan4, _ = step(sched, worker)
    (nb,) = plan4.new_requests
    assert nb.req_id == "b" and nb.prompt_len == 78
    assert len(nb.token_ids) == 80 * 4 and nb.token_ids[-8:] == pack_token_ids(b_tokens)
    assert nb.num_computed_tokens == 64 and nb.num_scheduled_tokens == 16
    assert nb.block_ids[:4] == [6, 7, 8, 9]


def test_outputs_carry_cached_tokens_logprobs_and_route_by_client():
    """Outputs: the first carries num_cached_tokens and queue_time, logprobs pass through,
    and each frontend gets only its own requests. A 32-token prompt shared by two clients: the
    second (admitted later) hits 16 tokens (the last prompt token is always computed)."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", [5] * 32, client_id="x"))
    step(sched, worker)
    sched.add(make_request("b", [5] * 32, client_id="y"))
    plan = sched.schedule()
    lp = TokenLogprobs(pack_token_ids([9]), b"\0\0\0\0")
    sampled = SampledTokens(plan.step_id, ["a", "b"], pack_token_ids([9, 9]), [None, lp])
    out = sched.update(plan, sampled)
    assert set(out) == {"x", "y"}
    (ob,) = out["y"]
    assert ob.num_cached_tokens == 16 and ob.queue_time is not None and ob.new_logprobs == [lp]
    assert out["x"][0].new_logprobs is None and out["x"][0].num_cached_tokens == 0


def test_abort_client_and_fail_all():
    """A frontend that goes away loses all its requests; a dead worker fails every unfinished
    request with ERROR and the message; blocks all return (10 usable)."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    for i, client in enumerate("xxy"):
        sched.add(make_request(i, 20, client_id=client))
    step(sched, worker)
    assert sched.abort_client("x") == 2 and sched.num_unfinished_requests() == 1
    out = sched.fail_all("worker 0 died")
    (o,) = out["y"]
    assert o.finish_reason == FinishReason.ERROR and o.error == "worker 0 died"
    assert sched.block_pool.num_free_blocks == 10
    assert sorted(sched.schedule().finished_req_ids) == ["0", "1", "2"]


def test_add_rejects_bad_requests_and_runtime_checks():
    """ValueErrors: duplicate id, empty prompt, prompt at max_model_len; a KV cache smaller
    than one max_model_len sequence (3 usable blocks of 16 = 48 < 64) refuses to start."""
    sched = make_scheduler(max_model_len=64)
    sched.add(make_request("a", 10))
    with pytest.raises(ValueError, match="req_id"):
        sched.add(make_request("a", 10))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add(make_request("b", []))
    with pytest.raises(ValueError, match="context length"):
        sched.add(make_request("c", 64))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=256, chunked=False, max_model_len=512)


def test_stats_match_the_queues():
    """§7.30: stats report running and waiting counts equal to the queues, KV usage as the
    fraction of usable blocks held (11 blocks, 10 usable; two 40-token prompts take 3 blocks
    each: 60%), and token counters: prompt tokens computed and tokens sampled."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_seqs=2,
                           max_num_batched_tokens=128)
    worker = FakeWorker(16)
    for i in range(3):
        sched.add(make_request(i, 40, max_tokens=4))
    step(sched, worker)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(0.6) and stats.num_kv_blocks == 11
    assert (stats.prompt_tokens, stats.generation_tokens, stats.num_steps) == (80, 2, 1)
    while sched.has_unfinished_requests():
        step(sched, worker)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert (stats.prompt_tokens, stats.generation_tokens) == (120, 12)


def test_no_admission_in_a_preempting_step_and_head_of_line_blocking():
    """§5 rules: 11 blocks (10 usable). A and B (80 tokens, 5 blocks each) fill the pool.
    Step 2: A's position 80 needs a block, B is preempted (A takes B's freed tail block), and
    no waiting request is admitted in that step although C (5 tokens) would fit. Step 3: B
    is at the front of the queue; it needs 6 blocks (81 tokens; 4 cached ones sit on the free
    list) with 4 free, so it blocks the queue: C is not admitted ahead of it, and waiting
    requests never preempt A."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    sched.add(make_request("a", 80, max_tokens=30))
    sched.add(make_request("b", [5] * 80, max_tokens=30))
    step(sched, worker)
    sched.add(make_request("c", 5))
    plan, _ = step(sched, worker)
    assert plan.preempted_req_ids == ["b"] and not plan.new_requests
    assert sched.block_pool.num_free_blocks == 4
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 1} and not plan.preempted_req_ids
    assert [r.req_id for r in sched.waiting] == ["b", "c"]


def test_stats_count_queued_prompt_tokens_until_the_first_token():
    """`queued_prompt_tokens` (what --max-num-queued-tokens limits across frontends): prompt
    tokens of unfinished requests without a generated token. Budget 16: a (20 tokens) takes
    two steps of prefill, b (10) is admitted in the second; both sample there."""
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    worker = FakeWorker(16)
    sched.add(make_request("a", 20, max_tokens=4))
    sched.add(make_request("b", 10, max_tokens=4))
    sched.add(make_request("c", 7, max_tokens=4))
    assert sched.stats().queued_prompt_tokens == 37
    step(sched, worker)  # a: 16 of 20, nothing sampled
    assert sched.stats().queued_prompt_tokens == 37
    sched.abort(["c"])
    assert sched.stats().queued_prompt_tokens == 30
    step(sched, worker)  # a: last 4 and b: all 10; both sample
    assert sched.stats().queued_prompt_tokens == 0
