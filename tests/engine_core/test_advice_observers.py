"""The advisory wing's observers of an engine core (engine_core/advice/observers.py): which ones
the daemon gets for a config, and what each takes from the loop (`EngineCore` on the fake
executor, its clock virtual)."""

import dataclasses
import logging

import pytest
from fake_executor import FakeExecutor
from sched_utils import FakeWorker, make_request, make_scheduler

from tidal.engine_core.advice.observers import (
    PreemptionAdviceObserver, QueueDelayObserver, observers_for,
)
from tidal.engine_core.advice.queue_estimate import QueueDelayEstimator
from tidal.engine_core.advice.step_cost import StepCostModel
from tidal.engine_core.config import EngineConfig, ModelConfig, SchedulerConfig
from tidal.engine_core.core import EngineCore

LOGGER = logging.getLogger("tidal.test.observers")
COST = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002)


@pytest.fixture(autouse=True)
def _quiet_preemption_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="tidal.engine_core.scheduler")


def _config(**scheduler) -> EngineConfig:
    return EngineConfig(model=ModelConfig("unused-model-dir"),
                        scheduler=SchedulerConfig(**scheduler))


def _kinds(observers) -> list[type]:
    return [type(o) for o in observers]


def test_the_observers_a_config_gets(tmp_path, monkeypatch, caplog):
    """None without a step cost model; with one, the preemption advisor, and with
    --max-queue-delay the queue estimate too. --max-queue-delay without a cost model is
    refused; a cost model file that cannot be read turns the advice off, said at once."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))  # no profile cached
    assert observers_for(_config(), LOGGER) == []
    with pytest.raises(ValueError, match="tidal tune profile"):
        observers_for(_config(max_queue_delay=2.0), LOGGER)
    path = str(tmp_path / "cost.json")
    COST.save(path)
    assert _kinds(observers_for(_config(step_cost_model=path), LOGGER)) == [
        PreemptionAdviceObserver]
    assert _kinds(observers_for(_config(step_cost_model=path, max_queue_delay=2.0),
                                LOGGER)) == [QueueDelayObserver, PreemptionAdviceObserver]
    (tmp_path / "bad.json").write_text("{}")
    caplog.set_level(logging.WARNING, logger=LOGGER.name)
    assert observers_for(_config(step_cost_model=str(tmp_path / "bad.json")), LOGGER) == []
    assert "no simulation after preemptions" in caplog.text


def test_the_queue_estimate_rides_in_every_stats_snapshot():
    """The estimate of the scheduler's state goes into the snapshot (three waiting 100-token
    prompts: 313 ms, test_queue_estimate's first case); the steps the core times feed the
    estimator's pace (1 s each at the fake workers, priced 310 ms and less: slower than
    priced)."""
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    executor = FakeExecutor(FakeWorker(16), stage_latency=1.0)
    estimator = QueueDelayEstimator(COST)
    core = EngineCore(sched, executor, 1, [QueueDelayObserver(estimator)],
                      clock=lambda: executor.now)
    for i in range(3):
        core.add(make_request(i, 100, max_tokens=4))
    stats = core.stats()
    assert stats.est_queue_delay_s == pytest.approx(0.010 + 0.303)
    assert stats.est_s_per_prompt_token == pytest.approx(0.00101)
    while core.has_work():
        core.step()
    assert estimator.step_ratio() > 1.0


def test_the_advisor_counts_the_preemptions_and_keeps_the_requests(tmp_path):
    """Attached, the advisor watches the scheduler's preemption log; it keeps every request
    added and counts the preemptions of each plan, as the scheduler counts them."""
    path = str(tmp_path / "cost.json")
    COST.save(path)
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    executor = FakeExecutor(FakeWorker(16), stage_latency=0.1)
    sched.clock = lambda: executor.now  # one clock, as in the daemon
    config = dataclasses.replace(sched.config, scheduler=dataclasses.replace(
        sched.config.scheduler, step_cost_model=path))
    (observer,) = observers_for(config, LOGGER)
    core = EngineCore(sched, executor, 1, [observer], clock=lambda: executor.now)
    for i in range(3):  # 50-token prompts in 10 usable blocks: they preempt each other
        core.add(make_request(i, 50, max_tokens=60))
    while core.has_work():
        core.step()
        core.tick()
    core.close()
    assert sched.num_preemptions > 0
    assert observer.num_preemptions == sched.num_preemptions
    assert observer.advisor.num_kv_blocks == 11
    finished, unfinished = observer.advisor.recent.since(0.0)  # swept at most every POLL_S
    assert len(finished) + len(unfinished) == 3
