"""The engine core's estimate of a new request's wait (--max-queue-delay), on the real
Scheduler with a fabricated step cost model: t = 10 ms + 1 ms per prompt token + 2 ms per
decode. Arithmetic in each docstring."""

import logging

import pytest
from sched_utils import FakeWorker, make_request, make_scheduler, step

from tidal.engine_core.advice.queue_estimate import QueueDelayEstimator
from tidal.engine_core.advice.step_cost import StepCostModel

COST = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002)


def test_prompt_tokens_queued_ahead():
    """Three waiting 100-token prompts, nothing running, budget 1000: a step holds 1000 prompt
    tokens and takes 10 + 1000 ms, so each prompt token costs 1.01 ms: 300 of them 303 ms,
    and the new request's own step its fixed 10 ms (nothing is in flight)."""
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    for i in range(3):
        sched.add(make_request(i, 100))
    est = QueueDelayEstimator(COST).estimate(sched, now=0.0)
    assert est.s_per_prompt_token == pytest.approx(0.00101)
    assert est.queue_delay_s == pytest.approx(0.010 + 0.303)
    assert est.s_per_queued_request == 0.0


def test_attention_pairs_priced_per_prompt():
    """With 1 us per attention pair, two waiting prompts of 100 and 300 tokens hold 5050 +
    45150 = 50200 causal pairs (L(L+1)/2 each), not the pairs of one 1000-token chunk: 400
    tokens cost 400 ms + 50.2 ms, plus 0.4 of a step's fixed 10 ms, plus the own step's 10 ms.
    A token is priced 10/1000 + 1 ms + 125.5 pairs (50200 / 400) * 1 us."""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_prefill_attention_pair_s=1e-6)
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    sched.add(make_request("short", 100))
    sched.add(make_request("long", 300))
    est = QueueDelayEstimator(cost).estimate(sched, now=0.0)
    assert est.queue_delay_s == pytest.approx(0.010 + 0.004 + 0.400 + 0.0502)
    assert est.s_per_prompt_token == pytest.approx(0.00001 + 0.001 + 0.0001255)


def test_running_decodes_share_each_step():
    """After one step the three decode (context 101 each) and a 50-token prompt waits: a step
    holds 997 prompt tokens beside 3 decodes, 10 + 997 + 6 = 1013 ms; the step in flight is
    10 + 6 = 16 ms, and so is the fixed part of the new request's own step; so
    16 + 16 ms + 50 * 1013/997 ms."""
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    worker = FakeWorker(16)
    for i in range(3):
        sched.add(make_request(i, 100, max_tokens=50))
    step(sched, worker)
    sched.add(make_request("late", 50))
    est = QueueDelayEstimator(COST).estimate(sched, now=0.0)
    assert est.s_per_prompt_token == pytest.approx(1.013 / 997)
    assert est.queue_delay_s == pytest.approx(0.032 + 50 * 1.013 / 997)


def test_served_steps_are_priced_with_the_serving_terms():
    """The same queue with serving terms: 1 ms per step, 0.5 ms per token streamed, 20 ms +
    0.01 ms per prompt token on a request's way in. A full step streams 3 decodes and the
    prompt's first token: 1013 + 1 + 2 = 1016 ms for 997 tokens; the step in flight 16 + 1 +
    1.5 = 18.5 ms, and so the own step's fixed part; so 18.5 + 18.5 + 20 ms + 50 * (1016/997
    + 0.01) ms."""
    served = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002,
                           per_step_overhead_s=0.001, per_streamed_token_s=0.0005,
                           request_latency_s=0.020, per_prompt_token_latency_s=0.00001)
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    for i in range(3):
        sched.add(make_request(i, 100, max_tokens=50))
    step(sched, FakeWorker(16))
    sched.add(make_request("late", 50))
    est = QueueDelayEstimator(served).estimate(sched, now=0.0)
    assert est.s_per_prompt_token == pytest.approx(1.016 / 997 + 0.00001)
    assert est.queue_delay_s == pytest.approx(0.0185 * 2 + 0.020 + 50 * (1.016 / 997 + 0.00001))


def test_waiting_for_a_free_slot_at_the_measured_finish_rate():
    """max_num_seqs 1, one request running, three waiting: a new one waits for 4 finishes.
    Two finishes in the last 4 s: 0.5 per second, so 2 s each, 8 s in all (more than the
    token work, so it is the estimate)."""
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=1)
    worker = FakeWorker(16)
    sched.add(make_request("run", 10, max_tokens=1000))
    step(sched, worker)
    for i in range(3):
        sched.add(make_request(i, 10))
    estimator = QueueDelayEstimator(COST)
    assert estimator.estimate(sched, now=0.0).s_per_queued_request == 0.0  # no finish seen
    sched.num_finished += 2
    est = estimator.estimate(sched, now=4.0)
    assert est.s_per_queued_request == pytest.approx(2.0)
    assert est.queue_delay_s == pytest.approx(8.0)


def test_steps_slower_than_their_price_raise_the_estimate():
    """The first test's queue while the CPU is shared: steps are measured at 2x, 3x and 2.5x
    their price (10 + 100 ms for 100 prompt tokens), so every price is 2.5x (the median):
    2.5 * 1.01 ms a prompt token, 2.5 * 10 ms for the own step. A step's ratio is taken when
    the next step is timed (the requests that came in while it ran are read after it); two
    are not enough to go by (the estimate stays the model's); the median takes no notice of
    one outlier."""
    from tidal.engine_core.advice.queue_estimate import SLOWDOWN_WINDOW

    other = make_scheduler(max_num_batched_tokens=1000)
    other.add(make_request("measured", 100))
    plan = other.schedule()  # one 100-token prefill
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    for i in range(3):
        sched.add(make_request(i, 100))
    estimator = QueueDelayEstimator(COST)
    assert COST.step_time(plan) == pytest.approx(0.110)
    for seconds in (0.220, 0.330, 0.275):
        estimator.note_step(plan, seconds)
    assert estimator.slowdown(0.0) == 1.0  # two ratios taken; the third waits for its intake
    estimator.note_step(plan, 0.110)
    assert estimator.slowdown(0.0) == pytest.approx(2.5)
    est = estimator.estimate(sched, now=0.0)
    assert est.s_per_prompt_token == pytest.approx(2.5 * 0.00101)
    assert est.queue_delay_s == pytest.approx(2.5 * (0.010 + 0.303))
    for _ in range(SLOWDOWN_WINDOW - 1):  # the slow steps leave the window
        estimator.note_step(plan, 0.110)
    estimator.note_step(plan, 5.0)
    estimator.note_step(plan, 0.110)
    assert estimator.slowdown(0.0) == pytest.approx(1.0)


def test_the_intake_of_arriving_requests_slows_the_steps_ahead():
    """The serving cost model charges 5 ms to the steps for each request arriving (plus 0.01
    ms a prompt token). 40 requests of 50 tokens, one each 10 ms from t = 0, are 40 * 5.5 =
    220 ms of intake: at t = 0.45, over the 0.45 s since the first, 0.489 s a second, so the
    steps ahead are priced 1.489x; at t = 0.5 the first has left the window: 39 over 0.49 s;
    once all are more than ARRIVAL_WINDOW_S old, 1x again. Ten of them in the first 0.05 s
    of a burst count over ARRIVAL_MIN_SPAN_S: 55 ms in 0.1 s, 1.55x. A step measured at
    110 + 55 ms while ten such requests came in (read after it) ran at its price with their
    intake charged (10 * 5.5 ms): a ratio of 1, where without the intake it would have
    counted as 1.5x."""
    from tidal.engine_core.advice.queue_estimate import ARRIVAL_WINDOW_S, SLOWDOWN_MIN_STEPS

    burst = QueueDelayEstimator(StepCostModel(0.010, per_arrival_s=0.005,
                                              per_arrival_prompt_token_s=0.00001))
    for i in range(10):
        burst.note_arrival(50, now=i * 0.005)
    assert burst.slowdown(0.05) == pytest.approx(1.55)

    served = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002,
                           per_arrival_s=0.005, per_arrival_prompt_token_s=0.00001)
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    for i in range(3):
        sched.add(make_request(i, 100))
    estimator = QueueDelayEstimator(served)
    for i in range(40):
        estimator.note_arrival(50, now=i * 0.01)
    assert estimator.arrival_load(0.45) == pytest.approx(0.220 / 0.45)
    assert estimator.slowdown(0.45) == pytest.approx(1 + 0.220 / 0.45)
    est = estimator.estimate(sched, now=0.45)
    assert est.queue_delay_s == pytest.approx((1 + 0.220 / 0.45) * (0.010 + 0.303))
    assert estimator.arrival_load(0.5) == pytest.approx(39 * 0.0055 / 0.49)
    assert estimator.slowdown(0.4 + ARRIVAL_WINDOW_S) == pytest.approx(1.0)

    other = make_scheduler(max_num_batched_tokens=1000)
    other.add(make_request("measured", 100))
    plan = other.schedule()  # one 100-token prefill: 110 ms
    for _ in range(SLOWDOWN_MIN_STEPS):
        estimator.note_step(plan, 0.110 + 0.055)
        for _ in range(10):  # read after the step: they came in while it ran
            estimator.note_arrival(50, now=10.0)
    estimator.note_step(plan, 0.110)  # the next step timed: the last one's ratio is taken
    assert estimator.step_ratio() == pytest.approx(1.0)


def test_finish_rate_forgets_old_samples():
    estimator = QueueDelayEstimator(COST, window_s=10.0)
    assert estimator.finish_rate(0, 0.0) == 0.0
    assert estimator.finish_rate(10, 5.0) == pytest.approx(2.0)
    assert estimator.finish_rate(10, 12.0) == pytest.approx(10 / 12)
    assert estimator.finish_rate(12, 20.0) == pytest.approx(2 / 15)  # since t=5


def _config(model: str, **scheduler):
    from tidal.engine_core.config import EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(model=ModelConfig(model), scheduler=SchedulerConfig(**scheduler))


def test_the_flag_is_refused_without_a_step_cost_model(tiny_llama, tmp_path, monkeypatch):
    """No profile cached for this model and machine: the engine core does not start (exit 2)
    and says how to make one; with the file `tidal tune profile` would write, it starts the
    estimator; an explicit --step-cost-model wins."""
    from tidal.engine_core.advice.observers import queue_estimator
    from tidal.engine_core.daemon import EXIT_BAD_START, EngineCoreDaemon

    def _queue_estimator(config):
        return queue_estimator(config, logging.getLogger("tidal.test"))
    from tidal.engine_core.advice.step_cost import config_profile_key, profile_path

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    config = _config(tiny_llama, max_queue_delay=2.0)
    with pytest.raises(ValueError, match="tidal tune profile"):
        _queue_estimator(config)
    daemon = EngineCoreDaemon(config, f"ipc://{tmp_path}/core.sock")
    assert daemon.run() == EXIT_BAD_START
    COST.save(profile_path(config_profile_key(config)))
    assert _queue_estimator(config).cost_model == COST
    other = StepCostModel(0.5)
    other.save(str(tmp_path / "mine.json"))
    mine = _config(tiny_llama, max_queue_delay=2.0, step_cost_model=str(tmp_path / "mine.json"))
    assert _queue_estimator(mine).cost_model == other
    assert _queue_estimator(_config(tiny_llama)) is None  # the flag is off


def test_a_profile_is_kept_per_cpu_ops_choice(tiny_llama):
    """A profile taken with torch's ops (--cpu-kernels torch) is not found for the C kernels:
    the CPU ops are part of the profile's key."""
    from tidal.engine_core.advice.step_cost import config_profile_key, profile_path
    from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig

    ours = _config(tiny_llama)
    torch_ops = EngineConfig(model=ModelConfig(tiny_llama),
                             parallel=ParallelConfig(cpu_kernels="torch"))
    assert config_profile_key(ours)["cpu_kernels"] == "auto"
    assert profile_path(config_profile_key(ours)) != profile_path(config_profile_key(torch_ops))
