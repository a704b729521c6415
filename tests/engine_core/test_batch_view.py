"""The live batch view's engine-core side (engine_core/batch_view.py): steps are recorded only
while a view is watched, a view carries the steps after the one the page saw (the newest
MAX_STEPS_PER_VIEW), each request's part as a prefill chunk or a decode, preemptions, the KV
blocks and the queue by priority; warnings are kept. `EngineCore` on the fake executor."""

import logging

from fake_executor import FakeExecutor
from sched_utils import FakeWorker, make_request, make_scheduler

from tidal.engine_core.batch_view import ACTIVE_S, KEPT_WARNINGS, BatchViewObserver
from tidal.engine_core.core import EngineCore
from tidal.ipc.batch_view import MAX_STEPS_PER_VIEW


def _core(**scheduler):
    sched = make_scheduler(**scheduler)
    executor = FakeExecutor(FakeWorker(16), stage_latency=0.01)
    view = BatchViewObserver(wall_clock=lambda: 1000.0 + executor.now)
    core = EngineCore(sched, executor, 1, [view], clock=lambda: executor.now)
    return core, view, executor


def _run(core, steps=None):
    n = 0
    while core.has_work() and (steps is None or n < steps):
        core.step()
        n += 1


def test_nothing_is_recorded_until_a_view_is_asked_for():
    core, view, executor = _core()
    core.add(make_request("a", 20, max_tokens=4))
    _run(core)
    assert len(view.steps) == 0
    first = view.view(0, executor.now)
    assert first.steps == [] and first.max_num_seqs == 256
    core.add(make_request("b", 20, max_tokens=4))
    _run(core)
    assert [s.step_id for s in view.view(0, executor.now).steps] == [
        plan.step_id for plan, *_ in view.steps] and len(view.steps) == 4


def test_a_step_says_who_ran_and_how():
    """A 40-token prompt in chunks of 16 next to a decoding request: prefill chunks, then
    decodes; the token budget used; KV blocks held."""
    core, view, executor = _core(max_num_batched_tokens=17, max_num_seqs=4)
    view.view(0, executor.now)
    core.add(make_request("short", 1, max_tokens=8))
    core.step()
    core.add(make_request("long", 40, max_tokens=2))
    _run(core, 3)
    steps = view.view(0, executor.now).steps
    parts = [{r.req_id: (r.num_tokens, r.prefill) for r in s.requests} for s in steps]
    assert parts[0] == {"short": (1, True)}
    assert parts[1] == {"short": (1, False), "long": (16, True)}
    assert parts[2] == {"short": (1, False), "long": (16, True)}
    assert parts[3] == {"short": (1, False), "long": (8, True)}
    assert [s.num_tokens for s in steps] == [1, 17, 17, 9]
    assert all(s.kv_blocks_used >= 1 for s in steps) and steps[-1].time > 1000.0


def test_a_view_carries_the_newest_steps_after_the_one_seen():
    core, view, executor = _core()
    view.view(0, executor.now)
    core.add(make_request("a", 10, max_tokens=MAX_STEPS_PER_VIEW + 30, ignore_eos=True))
    _run(core)
    answer = view.view(0, executor.now)
    assert len(answer.steps) == MAX_STEPS_PER_VIEW and answer.skipped == 30
    last = answer.steps[-1].step_id
    assert view.view(last, executor.now).steps == []
    assert [s.step_id for s in view.view(last - 3, executor.now).steps] == [
        last - 2, last - 1, last]


def test_recording_stops_when_nobody_watches():
    core, view, executor = _core()
    view.view(0, executor.now)
    executor.now += ACTIVE_S + 1
    core.add(make_request("a", 10, max_tokens=4))
    _run(core)
    assert len(view.steps) == 0


def test_the_queue_by_priority_the_blocks_and_preemptions():
    """Two priority classes waiting behind a full batch; 50-token prompts in 10 usable blocks
    preempt each other and the steps say which."""
    core, view, executor = _core(policy="priority", max_num_seqs=1)
    for i, prio in enumerate([0, 1, 1, 2]):
        core.add(make_request(i, 20, max_tokens=2, priority=prio))
    answer = view.view(0, executor.now)
    assert answer.waiting_by_priority == {0: 1, 1: 2, 2: 1}
    core.step()
    answer = view.view(0, executor.now)
    assert answer.waiting_by_priority == {1: 2, 2: 1} and answer.kv_blocks_used == 2

    core, view, executor = _core(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    view.view(0, executor.now)
    for i in range(3):
        core.add(make_request(i, 50, max_tokens=60))
    preempted, last = [], 0
    while core.has_work():  # a page polling between steps
        core.step()
        for step in view.view(last, executor.now).steps:
            preempted += step.preempted
            last = step.step_id
    assert preempted and core.scheduler.num_preemptions == len(preempted)
    answer = view.view(0, executor.now)
    assert answer.kv_blocks_used == 0 and answer.kv_blocks_cached > 0


def test_warnings_are_kept_newest_last():
    view = BatchViewObserver()
    log = logging.getLogger("tidal.test.batch_view")
    log.addHandler(view.warnings)
    try:
        for i in range(KEPT_WARNINGS + 5):
            log.warning("preempted %d: raise --kv-cache-memory", i)
        log.info("not kept")
    finally:
        log.removeHandler(view.warnings)
    kept = list(view.warnings.messages)
    assert len(kept) == KEPT_WARNINGS and kept[-1].endswith(f"preempted {KEPT_WARNINGS + 4}: "
                                                            "raise --kv-cache-memory")
