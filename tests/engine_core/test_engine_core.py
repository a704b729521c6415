"""`EngineCore` (core.py) on the in-process fake executor: how many plans it keeps in flight,
and that the depth changes timing, never tokens."""

import logging

import pytest
from fake_executor import FakeExecutor
from sched_utils import FakeWorker, make_request, make_scheduler, output_tokens, reference_tokens

from tidal.engine_core.core import EngineCore, EngineObserver


@pytest.fixture(autouse=True)
def _quiet_preemption_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="tidal.engine_core.scheduler")


def _run(core: EngineCore, req_ids) -> dict[str, list[int]]:
    """Step until every request finished; each request's tokens."""
    tokens = {r: [] for r in req_ids}
    while core.has_work():
        outputs = core.step()
        assert outputs is not None  # the fake executor always answers
        for r in tokens:
            tokens[r] += output_tokens(outputs, r)
        core.scheduler.check_invariants()
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_equal_the_reference_under_preemption(async_scheduling):
    """A tight pool (8 blocks of 16, 112 tokens) and 6 requests of 20-50 prompt tokens force
    preemptions; every request still gets exactly the fake model's tokens."""
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=48,
                           async_scheduling=async_scheduling)
    executor = FakeExecutor(FakeWorker(16))
    core = EngineCore(sched, executor, sched.config.pipeline_depth("cpu"))
    prompts = {str(i): [i + 1] * (20 + 6 * i) for i in range(6)}
    for req_id, prompt in prompts.items():
        sched.add(make_request(req_id, prompt, max_tokens=30))
    tokens = _run(core, prompts)
    assert sched.num_preemptions > 0
    assert tokens == {r: reference_tokens(p, max_tokens=30, max_model_len=112)
                      for r, p in prompts.items()}
    assert executor.max_pending == (2 if async_scheduling else 1)



def _pipelined_core(pp: int, async_scheduling: bool, **sched_kwargs):
    sched = make_scheduler(async_scheduling=async_scheduling, pp=pp, **sched_kwargs)
    executor = FakeExecutor(FakeWorker(16, pipelined=True), num_stages=pp)
    return EngineCore(sched, executor, sched.config.pipeline_depth("cpu")), executor


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pipeline_tokens_equal_the_reference_under_preemption(async_scheduling):
    """PP=2: up to 2 (3 with async) plans in flight; the workers never sample for the first
    stage, so every generated token reaches them through the plans; a tight pool forces
    preemptions. Every request gets exactly the fake model's tokens."""
    core, executor = _pipelined_core(2, async_scheduling, num_blocks=8, max_model_len=112,
                                     max_num_batched_tokens=48)
    prompts = {str(i): [i + 1] * (20 + 6 * i) for i in range(6)}
    for req_id, prompt in prompts.items():
        core.scheduler.add(make_request(req_id, prompt, max_tokens=30))
    tokens = _run(core, prompts)
    assert core.scheduler.num_preemptions > 0
    assert tokens == {r: reference_tokens(p, max_tokens=30, max_model_len=112)
                      for r, p in prompts.items()}
    assert 2 <= executor.max_pending <= core.depth  # pipelined, never past the depth


def test_pipeline_keeps_both_stages_busy():
    """PP=2, each stage taking 1 (virtual) second per plan; four requests with a budget of
    two prompts per step form two batches that take turns. With two plans in flight both
    stages work nearly all the time; with one (no pipelining) each idles half of it."""
    utilization = {}
    for depth in (1, 2):
        sched = make_scheduler(pp=2, max_num_batched_tokens=16)
        executor = FakeExecutor(FakeWorker(16, pipelined=True), num_stages=2)
        core = EngineCore(sched, executor, depth)
        for i in range(4):
            sched.add(make_request(i, 8, max_tokens=20))
        _run(core, [str(i) for i in range(4)])
        utilization[depth] = [executor.utilization(s) for s in (0, 1)]
    assert min(utilization[2]) > 0.9, utilization
    assert max(utilization[1]) < 0.55, utilization


class Recorder(EngineObserver):
    """Every event, in order: (name, detail)."""

    def __init__(self) -> None:
        self.events = []

    def attach(self, scheduler):
        self.events.append(("attach", scheduler))

    def request_added(self, request, now):
        self.events.append(("added", request.req_id))

    def preempted(self, num_requests, now):
        self.events.append(("preempted", num_requests))

    def step_ran(self, plan, seconds, now):
        self.events.append(("step", (plan.step_id, seconds, now)))

    def stats(self, stats, now):
        stats.est_queue_delay_s = 7.0
        self.events.append(("stats", now))

    def tick(self, now):
        self.events.append(("tick", now))

    def close(self):
        self.events.append(("close", None))

    def named(self, name):
        return [detail for event, detail in self.events if event == name]


def test_each_plans_time_at_the_workers_is_reported():
    """An observer hears (plan, seconds) as each plan's tokens arrive, in the core's clock: a
    plan's own time at the workers, from the later of its submission and the previous plan's
    tokens. Sync: each plan runs 1 s after its submission. With async scheduling two plans are
    in flight and the second is submitted when the first is, but its own time still counts
    from the first's tokens: 1 s each as well."""
    for async_scheduling in (False, True):
        sched = make_scheduler(async_scheduling=async_scheduling)
        executor = FakeExecutor(FakeWorker(16), stage_latency=1.0)
        recorder = Recorder()
        core = EngineCore(sched, executor, sched.config.pipeline_depth("cpu"), [recorder],
                          clock=lambda: executor.now)
        core.add(make_request("a", 20, max_tokens=4))
        _run(core, ["a"])
        steps = recorder.named("step")
        assert [s for _, s, _ in steps] == [1.0] * 4
        assert [i for i, _, _ in steps] == sorted(i for i, _, _ in steps)


def test_observers_hear_the_loop_and_add_to_its_stats():
    """The one observer interface: attached to the scheduler once, told each request added,
    the preemptions of each plan (they add up to the scheduler's count), each tick; a stats
    snapshot carries what they fill in; close when the core stops. A request the scheduler
    refuses is not told."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    executor = FakeExecutor(FakeWorker(16), stage_latency=0.5)
    recorder = Recorder()
    core = EngineCore(sched, executor, 1, [recorder], clock=lambda: executor.now)
    assert recorder.events == [("attach", sched)]
    for i in range(3):  # 50-token prompts in 10 usable blocks: they preempt each other
        core.add(make_request(i, 50, max_tokens=60))
    with pytest.raises(ValueError):
        core.add(make_request(0, 50))  # a duplicate id
    _run(core, ["0", "1", "2"])
    core.tick()
    assert core.stats().est_queue_delay_s == 7.0
    core.close()
    assert recorder.named("added") == ["0", "1", "2"]
    assert sched.num_preemptions > 0
    assert sum(recorder.named("preempted")) == sched.num_preemptions
    assert recorder.named("tick") == recorder.named("stats") == [executor.now]
    assert recorder.events[-1] == ("close", None)


def test_without_observers_the_core_runs_alone():
    sched = make_scheduler()
    core = EngineCore(sched, FakeExecutor(FakeWorker(16)), 1)
    core.add(make_request("a", 20, max_tokens=3))
    assert len(_run(core, ["a"])["a"]) == 3
    core.tick()
    core.close()
    assert core.stats().est_queue_delay_s == 0.0
