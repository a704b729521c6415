"""The simulator runs the daemon's own Scheduler on simulated time: results on fabricated cost
models, worked out by hand in each docstring (block size 16)."""

import math

import numpy as np
import pytest

from tidal.engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tidal.engine_core.advice.simulator import Simulator, simulate
from tidal.engine_core.advice.step_cost import StepCostModel
from tidal.engine_core.advice.trace import Trace, TraceRequest


def config(*, max_num_seqs=8, max_num_batched_tokens=2048, async_scheduling=False,
           caching=True, chunked=True, policy="fcfs") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig("unused-model-dir"),
        cache=CacheConfig(block_size=16, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=chunked, scheduling_policy=policy,
                                  async_scheduling=async_scheduling))


def trace(*requests) -> Trace:
    return Trace([TraceRequest(t, p, o) for t, p, o in requests])


def approx(values):
    return pytest.approx(values, abs=1e-9)


def test_the_simulator_runs_the_daemons_scheduler_class():
    from tidal.engine_core.daemon import Scheduler as DaemonScheduler

    sim = Simulator(config(), 100, 256, StepCostModel(0.01))
    assert type(sim.scheduler) is DaemonScheduler


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_request(async_scheduling):
    """t = 10 ms + 1 ms per prefill token + 2 ms per decode. A 100-token prompt arriving at
    1.0 s, 3 output tokens: prefill 110 ms (token 1 at 1.110), two decodes of 12 ms (1.122,
    1.134). Async scheduling plans each decode while the step before runs, and the worker
    runs them back to back: the same times."""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002)
    result = simulate(config(async_scheduling=async_scheduling), 100, 256, cost,
                      trace((1.0, 100, 3)))
    assert result.first_token.tolist() == approx([1.110])
    assert result.finish.tolist() == approx([1.134])
    assert result.itl.tolist() == approx([0.012, 0.012])
    s = result.summary()
    assert s["completed"] == 1 and s["total_output_tokens"] == 3
    assert s["mean_ttft_ms"] == pytest.approx(110.0) and s["mean_e2el_ms"] == pytest.approx(134.0)
    assert s["mean_tpot_ms"] == pytest.approx(12.0)
    assert s["num_preemptions"] == 0 and s["duration_s"] == pytest.approx(1.134)


def test_a_speculative_config_is_simulated_as_plain_decoding():
    """The simulated worker samples one token a step and the cost model prices plain decodes,
    so the simulator drops `--speculative-config` (its prompts of one repeated token would
    otherwise draft every step): the same times as test_one_request."""
    from dataclasses import replace

    spec = replace(config(), scheduler=replace(
        config().scheduler, speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'))
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002)
    result = simulate(spec, 100, 256, cost, trace((1.0, 100, 3)))
    assert result.finish.tolist() == approx([1.134])
    assert result.itl.tolist() == approx([0.012, 0.012])


def test_serving_terms_delay_arrivals_and_lengthen_each_step_by_what_it_streams():
    """The cost of test_one_request plus serving terms: 10 ms + 0.2 ms per prompt token from
    arrival to the scheduler (30 ms for 100 tokens), 1 ms per step and 0.5 ms per token
    sampled. Two 100-token prompts arriving at 1.0 s reach
    the scheduler at 1.030; their prefill step (200 tokens: 210 ms + 1 + 2 x 0.5) ends at
    1.242; each decode step (2 requests: 14 ms + 1 + 1) lasts 16 ms."""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002,
                         request_latency_s=0.010, per_prompt_token_latency_s=0.0002,
                         per_step_overhead_s=0.001,
                         per_streamed_token_s=0.0005)
    result = simulate(config(), 100, 256, cost, trace((1.0, 100, 3), (1.0, 100, 3)))
    assert result.first_token.tolist() == approx([1.242, 1.242])
    assert result.itl.tolist() == approx([0.016] * 4)
    assert result.summary()["mean_ttft_ms"] == pytest.approx(242.0)


def test_a_request_arriving_during_a_step_lengthens_it():
    """3 ms per arrival and 0.2 ms per prompt token arriving, otherwise test_one_request's
    cost. A (100-token prompt, 3 outputs) arrives at 0.0; B (10 tokens, 1 output) at 0.05,
    while A's prefill runs: that step takes 110 + 3 + 2 ms (A's token 1 at 0.115). Then A's decode with B's prefill, 10 + 10 + 2 ms (both
    at 0.137), A's last decode 12 ms (0.149). C arrives at 0.5 with nothing running: its own
    arrival slows nothing (its prefill 20 ms, token at 0.520)."""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002,
                         per_arrival_s=0.003, per_arrival_prompt_token_s=0.0002)
    result = simulate(config(), 100, 256, cost,
                      trace((0.0, 100, 3), (0.05, 10, 1), (0.5, 10, 1)))
    assert result.first_token.tolist() == approx([0.115, 0.137, 0.520])
    assert result.finish.tolist() == approx([0.149, 0.137, 0.520])


def test_a_short_prompt_overtakes_a_long_one_on_its_way_to_the_scheduler():
    """0.1 ms per prompt token on the way in: a 1000-token prompt arriving at 1.000 s reaches
    the scheduler at 1.100, a 10-token one arriving at 1.050 at 1.051 and is served first
    (its prefill: 10 ms + 10 x 1 ms, token 1 at 1.071)."""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.002,
                         per_prompt_token_latency_s=0.0001)
    result = simulate(config(), 200, 2048, cost, trace((1.0, 1000, 1), (1.05, 10, 1)))
    assert result.first_token[1] == pytest.approx(1.071)
    assert result.first_token[0] > 1.100 + 1.0  # its 1000-token prefill after 1.100


def test_two_requests_share_a_64_token_budget():
    """Budget 64, 10 ms + 1 ms per token (prefill or decode). A (100-token prompt) and B
    (50) arrive at 0, 2 output tokens each:
    step 1: A 64 of 100                              74 ms -> 0.074
    step 2: A the last 36 (token 1) + B 28 of 50     74 ms -> 0.148  A's first token
    step 3: A decode (token 2, done) + B last 22     33 ms -> 0.181  B's first token, A ends
    step 4: B decode (done)                          11 ms -> 0.192"""
    cost = StepCostModel(0.010, per_prefill_token_s=0.001, per_decode_req_s=0.001)
    result = simulate(config(max_num_seqs=4, max_num_batched_tokens=64), 100, 256, cost,
                      trace((0.0, 100, 2), (0.0, 50, 2)))
    assert result.first_token.tolist() == approx([0.148, 0.181])
    assert result.finish.tolist() == approx([0.181, 0.192])
    assert result.num_steps == 4
    assert result.timeline["num_running"][:2] == [1, 2]  # B waits out step 1


def test_preemption_recomputes_the_victim():
    """5 KV blocks (4 usable, 64 tokens), every step 10 ms. A and B: 16-token prompts, 30
    outputs each (46 tokens, 3 blocks apiece: 6 > 4). Step 1 admits both (1 block each) and
    samples their first tokens; step 2 gives each a second block. Step s computes position
    s + 14, so step 18 (position 32) needs a third block with none free: B, the last
    admitted, is preempted (its 17 outputs kept) and A runs alone to output 30 at step 30
    (0.30 s). B's 33 known tokens need 3 blocks, free only once A is gone: step 31 recomputes
    them in one chunk and samples output 18 at 0.31; outputs 19..30 follow, done at 0.43."""
    result = simulate(config(max_num_seqs=2, max_num_batched_tokens=64, caching=False), 5, 64,
                      StepCostModel(0.010), trace((0.0, 16, 30), (0.0, 16, 30)))
    assert result.num_preemptions == 1
    assert result.finish.tolist() == approx([0.30, 0.43])
    assert result.first_token.tolist() == approx([0.01, 0.01])
    assert max(result.itl) == pytest.approx(0.31 - 0.17)  # B's 17th output to its 18th
    assert result.summary()["total_output_tokens"] == 60


def test_arrivals_wait_for_the_step_in_progress():
    """B arrives at 0.05 while A's 100 ms prefill runs: B is planned when A's step ends."""
    cost = StepCostModel(0.0, per_prefill_token_s=0.001, per_decode_req_s=0.001)
    result = simulate(config(), 100, 256, cost, trace((0.0, 100, 1), (0.05, 50, 1)))
    assert result.first_token.tolist() == approx([0.100, 0.150])


def test_prefix_cache_shares_traced_blocks():
    """Two 64-token prompts with the same four block hashes: the second hits 48 tokens (the
    last token is always computed), so it prefills 16 tokens, not 64."""
    shared = ["%016x" % (i + 1) for i in range(4)]
    t = Trace([TraceRequest(0.0, 64, 1, shared), TraceRequest(1.0, 64, 1, shared)])
    cost = StepCostModel(0.0, per_prefill_token_s=0.001)
    result = simulate(config(), 100, 256, cost, t)
    assert (result.first_token - result.arrival).tolist() == approx([0.064, 0.016])
    assert result.prefix_cache_hit_rate == pytest.approx(48 / 128)


def test_requests_too_long_for_the_context_are_refused():
    result = simulate(config(), 100, 128, StepCostModel(0.01),
                      trace((0.0, 100, 28), (0.0, 100, 29)))
    s = result.summary()
    assert s["completed"] == 1 and s["refused"] == 1
    assert math.isnan(result.finish[1])


def test_ten_thousand_requests_simulate_in_seconds():
    import time

    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / 50.0, size=10_000))
    t = Trace([TraceRequest(float(a), int(p), int(o)) for a, p, o in
               zip(arrivals, rng.integers(50, 400, 10_000), rng.integers(10, 200, 10_000))])
    cost = StepCostModel(0.005, 2e-5, 1e-4, 1e-7)
    start = time.perf_counter()
    result = simulate(config(max_num_seqs=128, async_scheduling=True), 20_000, 1024, cost, t)
    elapsed = time.perf_counter() - start
    assert result.summary()["completed"] == 10_000
    assert elapsed < 30, elapsed
