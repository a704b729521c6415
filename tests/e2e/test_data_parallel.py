"""Data parallelism through the whole process tree (issue 14, part 3): `LLM(...,
data_parallel_size=2)` → router → two engine cores → a worker each.

- Greedy tokens equal transformers' with DP=2, async scheduling on, and both cores serve; a
  second pass of prompts sharing a prefix goes where that prefix is cached.
- The same with a tiny KV cache on each core (preemptions) and async scheduling off.
- One core SIGKILLed mid-generation: its requests continue on the other core (the router moves
  them; the frontend never notices), a request sent meanwhile is served, the outputs equal a
  fault-free run's, and the router starts the core again.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from process_tree import children, wait_for
from test_llm import (  # noqa: F401 - the shared prompts and transformers' reference
    GREEDY,
    SMALL_KV,
    STARTUP_TIMEOUT_S,
    assert_greedy_equal,
    prompts,
    reference,
)

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def dp_llm(tiny_llama, reference):  # noqa: F811 - the fixture imported above
    with LLM(tiny_llama, data_parallel_size=2, kv_cache_memory=SMALL_KV,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        yield llm


@pytest.mark.timeout(240)
def test_dp2_greedy_equals_transformers_and_both_cores_serve(dp_llm, prompts, reference):  # noqa: F811
    assert len(children(dp_llm.daemon_pid)) == 2  # the router's two engine cores
    outputs = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_equal(outputs, reference)
    stats = dp_llm.get_stats()
    assert len(stats.cores) == 2 and all(c.generation_tokens > 0 for c in stats.cores)
    assert stats.generation_tokens == sum(c.generation_tokens for c in stats.cores)
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0

    shared = prompts[-4:]  # a 40-token prefix: two full blocks each
    again = dp_llm.generate(shared, GREEDY, use_tqdm=False)
    assert_greedy_equal(again, reference[-4:])
    after = dp_llm.get_stats()
    assert after.prefix_cache_hits - stats.prefix_cache_hits >= len(shared) * 2 * BLOCK


@pytest.mark.timeout(300)
def test_dp2_tiny_kv_cache_preempts_async_off(tiny_llama, prompts, reference):  # noqa: F811
    """7 usable KV blocks per core for 8 requests of up to 71 tokens each: preemptions."""
    with LLM(tiny_llama, data_parallel_size=2, num_gpu_blocks_override=8, max_model_len=112,
             async_scheduling=False, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        assert llm.engine_info.num_kv_blocks == 16
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0


@pytest.mark.timeout(240)
def test_a_killed_core_takes_down_only_itself(dp_llm):
    long = [SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=200, ignore_eos=True)]
    params = long * 2
    work = [[5, 6, 7], [9, 10, 11, 12], [13, 14], [15, 16, 17]]
    expected = dp_llm.generate(work, params, use_tqdm=False)
    cores = children(dp_llm.daemon_pid)
    result = {}
    before = dp_llm._llm.num_generated_tokens
    runner = threading.Thread(
        target=lambda: result.setdefault("out", dp_llm.generate(work, params, use_tqdm=False)))
    runner.start()
    wait_for(lambda: dp_llm._llm.num_generated_tokens > before, 30, "the first tokens")
    os.kill(cores[0], signal.SIGKILL)
    meanwhile = dp_llm.generate([[5, 6, 7]], long[:1], use_tqdm=False)  # the other core
    runner.join(timeout=150)
    assert not runner.is_alive(), "generate() did not return after a core died"
    assert meanwhile[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    for got, want in zip(result["out"], expected):
        assert got.outputs[0].finish_reason == "length"
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert dp_llm._llm.num_engine_restarts == 0 and dp_llm._llm.num_resubmitted == 0
    restarted = wait_for(lambda: len(set(children(dp_llm.daemon_pid)) - {cores[0]}) == 2, 120,
                         "the router to start the core again")
    assert restarted
    served = dp_llm.generate(work[:2], long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in served] == \
        [o.outputs[0].token_ids for o in expected[:2]]
