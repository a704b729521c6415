"""Priority scheduling (docs/architecture.md §7.14-7.15) and async scheduling (§7.16-7.17)."""

import logging

import pytest
from sched_utils import (
    FakeWorker, make_request, make_scheduler, output_tokens, scheduled_tokens, step,
)

from tidal.engine_core.request import RequestStatus


@pytest.fixture(autouse=True)
def _quiet_preemption_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="tidal.engine_core.scheduler")


def _admitted(plan):
    return [n.req_id for n in plan.new_requests]


def test_priority_admission_order():
    """§7.14: priorities [2,0,1] are admitted as ids [1,2,0]; equal priorities go by arrival
    time, then by add() order; mixed by (priority, arrival). 20-token prompts, ample blocks."""
    sched = make_scheduler(policy="priority")
    for i, prio in enumerate([2, 0, 1]):
        sched.add(make_request(i, 20, priority=prio))
    assert _admitted(sched.schedule()) == ["1", "2", "0"]

    sched = make_scheduler(policy="priority")
    for name, prio, t in (("late", 0, 5.0), ("early", 0, 1.0), ("low", 1, 0.0),
                          ("tie-a", 0, 3.0), ("tie-b", 0, 3.0)):
        sched.add(make_request(name, 20, priority=prio, arrival_time=t))
    assert _admitted(sched.schedule()) == ["early", "tie-a", "tie-b", "late", "low"]


def test_priority_respects_max_num_seqs_and_one_at_a_time_is_sorted():
    """§7.14: max_num_seqs=2 admits only the two best of five; admitting one per step (token
    budget = one 20-token prompt... with max_num_seqs 1 and each finishing after 1 token)
    yields priorities in ascending order."""
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    for i, prio in enumerate([4, 3, 0, 2, 1]):
        sched.add(make_request(i, 20, priority=prio))
    assert _admitted(sched.schedule()) == ["2", "4"]
    assert [r.priority for r in sched.waiting] == [2, 3, 4]

    sched = make_scheduler(policy="priority", max_num_seqs=1)
    worker = FakeWorker(16)
    for i, prio in enumerate([3, 1, 4, 0, 2]):
        sched.add(make_request(i, 20, priority=prio, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        order += [sched_req_priority for sched_req_priority in
                  [int(n.req_id) for n in plan.new_requests]]
    assert [[3, 1, 4, 0, 2][i] for i in order] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_preempts_the_lowest_priority_running_request(policy):
    """§7.15: 11 blocks (10 usable). LOW (priority 5, 60 tokens, 4 blocks = 64 slots) is
    admitted first; HIGH (priority 0, 95 tokens, 6 blocks = 96 slots) second: pool full.
    In step 4 LOW computes position 62 (fits) and is scheduled first, then HIGH's position 96
    needs a 7th block. Under priority LOW is preempted although admitted first (its already
    scheduled token is taken back) and HIGH runs; under fcfs HIGH, the last admitted, is the
    victim (it preempts itself) and LOW runs."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, policy=policy)
    worker = FakeWorker(16)
    sched.add(make_request("low", 60, priority=5, max_tokens=20))
    step(sched, worker)
    sched.add(make_request("high", 95, priority=0, max_tokens=20))
    step(sched, worker)
    assert sched.block_pool.num_free_blocks == 0
    step(sched, worker)
    plan, _ = step(sched, worker)
    victim, survivor = ("low", "high") if policy == "priority" else ("high", "low")
    assert plan.preempted_req_ids == [victim]
    assert sched.requests[victim].status == RequestStatus.PREEMPTED
    assert [r.req_id for r in sched.running] == [survivor]
    assert scheduled_tokens(plan) == {survivor: 1}
    assert plan.total_num_scheduled_tokens == 1


def test_priority_no_preemption_with_free_blocks():
    """§7.15: with a free pool (9999 usable blocks) nobody is preempted, whatever the mix of
    priorities; a higher-priority arrival never preempts running work."""
    sched = make_scheduler(policy="priority")
    worker = FakeWorker(16)
    for i in range(4):
        sched.add(make_request(i, 30, priority=4 - i, max_tokens=8))
    step(sched, worker)
    sched.add(make_request("vip", 30, priority=-10, max_tokens=4))
    while sched.has_unfinished_requests():
        step(sched, worker)
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_async_exact_max_tokens_and_no_wasted_step(max_tokens):
    """§7.16: with two plans in flight, each request ends with exactly max_tokens outputs and
    the worker computed exactly prompt + max_tokens - 1 tokens for it (the last sampled token
    is never fed back: nobody is scheduled past max_tokens)."""
    sched = make_scheduler(async_scheduling=True)
    worker = FakeWorker(16)
    prompts = {"a": 10, "b": 37}
    for name, n in prompts.items():
        sched.add(make_request(name, n, max_tokens=max_tokens))
    tokens = {name: [] for name in prompts}
    inflight = []
    while sched.has_unfinished_requests() or inflight:
        if sched.has_unfinished_requests():
            plan = sched.schedule()
            inflight.append((plan, worker.execute(plan)))
        if len(inflight) > 1 or not sched.has_unfinished_requests():
            out = sched.update(*inflight.pop(0))
            for name in tokens:
                tokens[name] += output_tokens(out, name)
        sched.check_invariants()
    for name, n in prompts.items():
        assert len(tokens[name]) == max_tokens
        assert worker.num_scheduled[name] == n + max_tokens - 1


def test_async_aborts_drop_in_flight_outputs():
    """§7.17: five decoding requests, two plans always in flight; aborting one request per
    step leaves each aborted request with exactly the outputs of the steps whose results
    arrived before its abort (the results of in-flight steps are dropped)."""
    sched = make_scheduler(async_scheduling=True)
    worker = FakeWorker(16)
    names = [f"r{i}" for i in range(5)]
    for name in names:
        sched.add(make_request(name, 8, max_tokens=50))
    tokens = {name: [] for name in names}
    inflight = []
    for _ in range(2):
        plan = sched.schedule()
        inflight.append((plan, worker.execute(plan)))
    for name in names:
        out = sched.update(*inflight.pop(0))
        for n in names:
            tokens[n] += output_tokens(out, n)
        num_before = len(tokens[name])
        sched.abort([name])
        plan = sched.schedule()
        inflight.append((plan, worker.execute(plan)))
        out = sched.update(*inflight.pop(0))
        for n in names:
            tokens[n] += output_tokens(out, n)
        assert len(tokens[name]) == num_before
        plan = sched.schedule()
        inflight.append((plan, worker.execute(plan)))
        sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert [len(tokens[n]) for n in names] == [1, 3, 5, 7, 9]


def test_sync_and_async_give_the_same_tokens_under_preemption():
    """Async scheduling changes timing, never results: a tight pool (8 blocks, 7 usable, 112
    tokens) with 6 requests of 20-50 prompt tokens forces preemptions in both modes; each
    request's tokens match across the modes."""
    results = []
    for async_scheduling in (False, True):
        sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=48,
                               async_scheduling=async_scheduling)
        worker = FakeWorker(16)
        for i in range(6):
            sched.add(make_request(i, 20 + 6 * i, max_tokens=30))
        tokens = {str(i): [] for i in range(6)}
        inflight = []
        while sched.has_unfinished_requests() or inflight:
            if sched.has_unfinished_requests():
                plan = sched.schedule()
                inflight.append((plan, worker.execute(plan)))
            if not async_scheduling or len(inflight) > 1 or not sched.has_unfinished_requests():
                out = sched.update(*inflight.pop(0))
                for n in tokens:
                    tokens[n] += output_tokens(out, n)
            sched.check_invariants()
        assert sched.num_preemptions > 0
        results.append(tokens)
    assert results[0] == results[1]


def test_rolled_back_chunk_is_never_published():
    """A priority victim that was already scheduled earlier in the same step gives its chunk
    back, and the blocks of that chunk must not enter the prefix cache (their KV is never
    written). 11 blocks (10 usable), budget 64, per-request chunk cap 32.
    Step 1: LOW (priority 5, 128 tokens) alone takes 64 tokens (cap off with one request):
    4 blocks. Step 2: LOW 64..95 (6 blocks); HIGH (priority 0, 32 tokens) admitted whole
    (2 blocks), samples: 33 tokens; 2 blocks free. Step 3: LOW's chunk 96..127 takes the last
    2 blocks; HIGH's position 32 needs one more, so LOW (largest priority value) is preempted
    and its chunk is taken back: LOW's blocks 7 and 8 were never computed (HIGH gets block 8).
    X (priority 1) = LOW's first 112 tokens + 10 would hit 7 blocks had the chunk been
    published; it must hit 6 (96 tokens) and compute the rest (the fake worker checks every
    KV position before sampling)."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=64,
                           threshold=32, policy="priority")
    worker = FakeWorker(16)
    low_prompt = list(range(1, 129))
    sched.add(make_request("low", low_prompt, priority=5, max_tokens=4))
    step(sched, worker)
    sched.add(make_request("high", 32, priority=0, max_tokens=3))
    step(sched, worker)
    plan, _ = step(sched, worker)
    assert plan.preempted_req_ids == ["low"] and scheduled_tokens(plan) == {"high": 1}
    sched.add(make_request("x", low_prompt[:112] + [7] * 10, priority=1, max_tokens=2))
    hits = {}
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        hits.update({n.req_id: n.num_computed_tokens for n in plan.new_requests})
    assert hits["x"] == 96
