"""After a spell of preemptions the engine core has the simulator replay the traffic that
caused it (engine_core/advice/preemption_advice.py): which requests go in, when, and how the
prediction reaches the warnings that follow."""

import logging
import tempfile
import time

from sched_utils import FakeWorker, make_request, make_scheduler, step
from tidal.engine_core.advice import preemption_advice
from tidal.engine_core.advice.preemption_advice import (
    PreemptionAdvisor, RecentRequests, window_request,
)
from tidal.engine_core.advice.step_cost import StepCostModel

LOGGER = "tidal.test.advice"


def test_a_finished_request_is_kept_as_lengths_times_and_its_prefix_cache_hashes():
    """Two 40-token prompts sharing their first 32 tokens, block size 16: two full prompt
    blocks each, both hashes shared (the prefix cache's chained hashes, cut to 64 bits);
    a third sharing only the first block shares only the first hash."""
    sched = make_scheduler()
    now = [10.0]
    sched.clock = lambda: now[0]
    worker = FakeWorker(16)
    prompts = [list(range(40)), list(range(32)) + [99] * 8, list(range(16)) + [7] * 24]
    requests = [make_request(i, p, max_tokens=3) for i, p in enumerate(prompts)]
    for r in requests:
        sched.add(r)
    while sched.has_unfinished_requests():
        now[0] += 0.5
        step(sched, worker)
    a, b, c = (window_request(r, 16) for r in requests)
    assert (a.arrival_time, a.prompt_len, a.output_len) == (10.0, 40, 3)
    assert len(a.prefix_hashes) == 2 * 8  # 8 bytes a block
    assert a.prefix_hashes == b.prefix_hashes
    assert c.prefix_hashes[:8] == a.prefix_hashes[:8]
    assert c.prefix_hashes[8:] != a.prefix_hashes[8:]
    assert 10.0 < a.first_token_time < a.finish_time <= now[0]


def test_recent_requests_keep_the_unfinished_and_what_finished_within_the_window():
    sched = make_scheduler()
    now = [100.0]
    sched.clock = lambda: now[0]
    recent = RecentRequests(keep_s=10.0, block_size=16)
    requests = [make_request(i, 20) for i in range(3)]
    for r in requests:
        sched.add(r)
        recent.add(r)
    sched.abort(["0"])  # finished at 100
    now[0] = 105.0
    sched.abort(["1"])  # at 105
    recent.sweep(now=105.5)

    def ids(start):
        finished, unfinished = recent.since(start)
        return [r.finish_time for r in finished], [r.req_id for r in unfinished]

    assert ids(103.0) == ([105.0], ["2"])
    assert ids(0.0) == ([100.0, 105.0], ["2"])
    recent.sweep(now=112.0)  # request 0 is forgotten after keep_s
    assert ids(0.0) == ([105.0], ["2"])


def _pressured(tmp_path, track: bool = True):
    """test_preemption_warning's scheduler (two 50-token prompts admitted into 10 usable
    blocks, preempting each other), a step cost model file, and an advisor over them (told
    of the requests unless `track` is false)."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    cost = tmp_path / "cost.json"
    StepCostModel(0.010).save(str(cost))
    advisor = PreemptionAdvisor(sched.config, 11, 160, str(cost), sched.preemption_log,
                                logging.getLogger(LOGGER))
    for i in range(3):
        request = make_request(i, 50, max_tokens=60)
        sched.add(request)
        if track:
            advisor.added(request)
    return sched, advisor


def _run(sched, advisor, clock, worker):
    while sched.has_unfinished_requests():
        step(sched, worker)
        clock[0] += 0.1
        advisor.poll(sched.num_preemptions, clock[0])
    for _ in range(2):  # the daemon loop goes on polling while idle: the spell ends
        clock[0] += preemption_advice.QUIET_S
        advisor.poll(sched.num_preemptions, clock[0])


def _wait_for_answer(sched, advisor, clock, caplog):
    deadline = time.monotonic() + 120
    while not any("Preemption advice" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no answer from the advisor process"
        time.sleep(0.1)
        clock[0] += preemption_advice.POLL_S
        advisor.poll(sched.num_preemptions, clock[0])


def test_warning_before_and_after_the_simulation(tmp_path, caplog, monkeypatch):
    """While the spell lasts, the warning says a prediction will come; when the preempted
    requests have finished the child process simulates the three requests and the core logs
    its table; the next warning quotes its summary. The window file is gone by then."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sched, advisor = _pressured(tmp_path)
    worker = FakeWorker(16)
    clock = [1000.0]
    sched.clock = lambda: clock[0]
    _run(sched, advisor, clock, worker)
    first = [r.getMessage() for r in caplog.records if "is preempted" in r.getMessage()]
    assert "The simulator will replay this traffic with each change" in first[0]
    assert "once this spell of preemptions is over" in first[0]
    assert any("simulating the last 3 requests" in r.getMessage() for r in caplog.records)
    _wait_for_answer(sched, advisor, clock, caplog)
    (advice,) = [r for r in caplog.records if "Preemption advice" in r.getMessage()]
    text = advice.getMessage()
    assert advice.levelno == logging.WARNING
    # steps took 0.1 s of the test's clock each, 10x the cost model: priced at the 4x limit
    assert ("replaying the last 3 requests, all within a second (steps at 4.00x the step "
            "cost model, capped, from the pace the engine ran at (") in text
    assert " ms per output token)), predicts with" in text
    assert ": no preemptions at that load" in text
    assert f"{sched.num_preemptions} seen" in text
    assert "\n  as configured" in text
    assert not list(tmp_path.glob("tidal-preemption-window-*"))

    clock[0] += sched.preemption_log.interval_s
    caplog.clear()
    for i in range(3, 6):
        sched.add(make_request(i, 50, max_tokens=60))
    _run(sched, advisor, clock, worker)
    later = [r.getMessage() for r in caplog.records if "is preempted" in r.getMessage()]
    assert later and " the simulator, replaying the last 3 requests, all within a second (" \
        in later[0]
    assert later[0].split("To avoid it: ")[1].count(". At ") == 1


def test_one_simulation_per_interval(tmp_path, caplog, monkeypatch):
    """A second spell within ADVICE_INTERVAL_S starts no second child."""
    caplog.set_level(logging.INFO)
    started = []
    monkeypatch.setattr(PreemptionAdvisor, "_simulate",
                        lambda self, now: (started.append(now), setattr(self, "_window", None)))
    sched, advisor = _pressured(tmp_path)
    worker = FakeWorker(16)
    clock = [1000.0]
    sched.clock = lambda: clock[0]
    _run(sched, advisor, clock, worker)
    _add_three(sched, advisor, 3)
    _run(sched, advisor, clock, worker)
    assert len(started) == 1
    clock[0] += preemption_advice.ADVICE_INTERVAL_S
    _add_three(sched, advisor, 6)
    _run(sched, advisor, clock, worker)
    assert len(started) == 2


def _add_three(sched, advisor, first_id):
    """Three more 50-token prompts, as `_pressured` adds: enough to preempt again."""
    for i in range(first_id, first_id + 3):
        request = make_request(i, 50, max_tokens=60)
        sched.add(request)
        advisor.added(request)


def test_no_cost_model_says_how_to_get_predictions(caplog):
    caplog.set_level(logging.WARNING)
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(make_request(i, 50, max_tokens=60))
    worker = FakeWorker(16)
    while sched.num_preemptions == 0:
        step(sched, worker)
    (msg,) = [r.getMessage() for r in caplog.records if "is preempted" in r.getMessage()]
    assert "after `tidal tune profile` with these engine flags, these warnings say what the " \
        "simulator predicts" in msg


def _spell_then_simulate(advisor, count, t):
    """Polls that start a spell at t, end it 5 s later and hand the window over."""
    advisor.poll(count, t)
    advisor.poll(count, t + preemption_advice.QUIET_S)
    advisor.poll(count, t + preemption_advice.QUIET_S + 1)


def test_preemptions_counted_while_a_simulation_runs_start_no_spell_later(tmp_path,
                                                                          monkeypatch):
    """Preemptions during a simulation belong to the spell being simulated: once the
    answer is in and the interval has passed, only a new preemption starts a spell."""
    started = []

    def fake_simulate(self, now):
        started.append(now)
        self._window, self._child = None, "running"

    monkeypatch.setattr(PreemptionAdvisor, "_simulate", fake_simulate)
    monkeypatch.setattr(PreemptionAdvisor, "_collect",
                        lambda self, now: setattr(self, "_child", None) if now > 200 else None)
    _, advisor = _pressured(tmp_path, track=False)
    _spell_then_simulate(advisor, 1, 0.0)
    assert started == [6.0]
    advisor.poll(40, 10.0)  # 39 more while the child runs
    advisor.poll(40, 400.0)  # the answer comes, past the interval
    for t in range(401, 420):
        advisor.poll(40, float(t))
    assert started == [6.0]
    _spell_then_simulate(advisor, 41, 420.0)
    assert started == [6.0, 426.0]


def test_a_failure_to_start_the_simulation_turns_the_advice_off_not_the_engine(
        tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_process(*args, **kwargs):
        raise OSError("[Errno 11] Resource temporarily unavailable")

    monkeypatch.setattr(preemption_advice.subprocess, "Popen", no_process)
    sched, advisor = _pressured(tmp_path, track=False)
    _spell_then_simulate(advisor, 1, 0.0)
    assert advisor.broken
    assert any("preemption advice off: OSError: [Errno 11]" in r.getMessage()
               for r in caplog.records)
    assert not list(tmp_path.glob("tidal-preemption-window-*"))
    advisor.added(make_request(99, 20))
    assert advisor.recent.since(0.0) == ([], [])  # off: it keeps no requests
    worker = FakeWorker(16)
    while sched.num_preemptions == 0:
        step(sched, worker)
    (msg,) = [r.getMessage() for r in caplog.records if "is preempted" in r.getMessage()]
    assert "The simulator will replay" not in msg


def test_a_simulation_that_fails_is_said_and_the_next_spell_tries_again(tmp_path, caplog,
                                                                         monkeypatch):
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(preemption_advice, "ADVISOR_MODULE", "tidal.no_such_module")
    _, advisor = _pressured(tmp_path, track=False)
    _spell_then_simulate(advisor, 1, 0.0)
    deadline = time.monotonic() + 60
    t = 7.0
    while not any("simulation failed" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        t += preemption_advice.POLL_S
        advisor.poll(1, t)
    assert any("the simulation failed (exit status 1)" in r.getMessage()
               for r in caplog.records)
    assert not advisor.broken
