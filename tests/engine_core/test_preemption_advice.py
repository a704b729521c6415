"""After a spell of preemptions the engine core has the simulator replay the traffic that
caused it (engine_core/preemption_advice.py): which requests go in, when, and how the
prediction reaches the warnings that follow."""

import logging
import tempfile
import time

from sched_utils import FakeWorker, make_request, make_scheduler, step
from tidal.engine_core import preemption_advice
from tidal.engine_core.preemption_advice import (
    PreemptionAdvisor, RecentRequests, prefix_hashes,
)
from tidal.engine_core.step_cost import StepCostModel

LOGGER = "tidal.test.advice"


def test_prefix_hashes_are_chained_per_16_token_block_and_salted():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    c = list(range(16)) + [7] * 16
    assert len(prefix_hashes(a)) == 2  # two full blocks; the last 8 tokens are not hashed
    assert prefix_hashes(a) == prefix_hashes(b)
    assert prefix_hashes(a)[0] == prefix_hashes(c)[0]
    assert prefix_hashes(a)[1] != prefix_hashes(c)[1]
    assert prefix_hashes(a, "salt")[0] != prefix_hashes(a)[0]
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in prefix_hashes(a))


def test_recent_requests_keep_the_unfinished_and_what_finished_within_the_window():
    sched = make_scheduler()
    now = [100.0]
    sched.clock = lambda: now[0]
    recent = RecentRequests(keep_s=10.0)
    requests = [make_request(i, 20) for i in range(3)]
    for r in requests:
        sched.add(r)
        recent.add(r)
    sched.abort(["0"])  # finished at 100
    now[0] = 105.0
    sched.abort(["1"])  # at 105
    recent.sweep(now=105.5)
    assert [r.req_id for r in recent.since(103.0)] == ["1", "2"]
    assert [r.req_id for r in recent.since(0.0)] == ["0", "1", "2"]
    recent.sweep(now=112.0)  # request 0 is forgotten after keep_s
    assert [r.req_id for r in recent.since(0.0)] == ["1", "2"]


def _pressured(tmp_path):
    """test_preemption_warning's scheduler (two 50-token prompts admitted into 10 usable
    blocks, preempting each other), a step cost model file, and an advisor over them."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    cost = tmp_path / "cost.json"
    StepCostModel(0.010).save(str(cost))
    advisor = PreemptionAdvisor(sched.config, 11, 160, str(cost), sched.preemption_log,
                                logging.getLogger(LOGGER))
    for i in range(3):
        request = make_request(i, 50, max_tokens=60)
        sched.add(request)
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
    assert any("simulating the last 3 requests" in r.getMessage() for r in caplog.records)
    _wait_for_answer(sched, advisor, clock, caplog)
    (advice,) = [r for r in caplog.records if "Preemption advice" in r.getMessage()]
    text = advice.getMessage()
    assert advice.levelno == logging.WARNING
    # steps took 0.1 s of the test's clock each, 10x the cost model: priced at the 4x limit
    assert ("replaying the last 3 requests, all within a second (steps at 4.00x the step "
            "cost model, the pace the engine ran at (") in text
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
    for i in range(3, 6):
        request = make_request(i, 50, max_tokens=60)
        sched.add(request)
        advisor.added(request)
    _run(sched, advisor, clock, worker)
    assert len(started) == 1
    clock[0] += preemption_advice.ADVICE_INTERVAL_S
    for i in range(6, 9):
        request = make_request(i, 50, max_tokens=60)
        sched.add(request)
        advisor.added(request)
    _run(sched, advisor, clock, worker)
    assert len(started) == 2


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
