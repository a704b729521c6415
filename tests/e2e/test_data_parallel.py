"""Data parallelism through the whole process tree (issue 14, part 3): `LLM(...,
data_parallel_size=2)` → router → two engine cores → a worker each.

- Greedy tokens equal transformers' with DP=2, async scheduling on, and both cores serve; a
  second pass of prompts sharing a prefix goes where that prefix is cached.
- Two frontends at once each get their own outputs; a third, SIGKILLed, has its requests
  dropped (blocks freed) within the frontend timeout.
- The same with a tiny KV cache on each core (preemptions), async scheduling on and off.
- One core SIGKILLed mid-generation: its requests continue on the other core (the router moves
  them; the frontend never notices), a request sent meanwhile is served, the outputs equal a
  fault-free run's, and the router starts the core again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from process_tree import children, wait_for
from test_llm import (  # noqa: F401 - the shared prompts and transformers' reference
    _DOOMED_FRONTEND,
    FRONTEND_TIMEOUT_S,
    GREEDY,
    SMALL_KV,
    STARTUP_TIMEOUT_S,
    assert_greedy_equal,
    prompts,
    reference,
)

from tidal.engine_core.launcher import DaemonProcess
from tidal.frontend.llm import LLM, engine_config_from_kwargs
from tidal.ipc.messages import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def router(tiny_llama, reference):  # noqa: F811 - the fixture imported above
    """`tidal core -dp 2` (a router and two cores), with a short frontend timeout."""
    config = engine_config_from_kwargs(tiny_llama, kv_cache_memory=SMALL_KV,
                                       data_parallel_size=2, async_scheduling=True)
    d = DaemonProcess(config, echo=False,
                      extra_args=["--frontend-timeout", str(FRONTEND_TIMEOUT_S)])
    yield d
    code = d.stop(timeout=30)
    assert code == 0, d.failure_message("the router did not stop cleanly")


@pytest.fixture(scope="module")
def dp_llm(router):
    with LLM(engine=router.address, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        yield llm


@pytest.mark.timeout(240)
def test_dp2_greedy_equals_transformers_and_both_cores_serve(router, dp_llm, prompts,  # noqa: F811
                                                             reference):  # noqa: F811
    assert len(children(router.pid)) == 2  # the router's two engine cores
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


@pytest.mark.timeout(180)
def test_frontends_get_their_own_outputs_and_a_killed_ones_requests_are_dropped(
        router, dp_llm, prompts, reference, tmp_path):  # noqa: F811
    """Through the router as through one core: two frontends generating at once (the same
    request ids on purpose) each get exactly their own outputs, while a third, SIGKILLed
    mid-generation, has its requests aborted in the cores within the frontend timeout."""
    script = tmp_path / "doomed.py"
    script.write_text(_DOOMED_FRONTEND)
    doomed = subprocess.Popen([sys.executable, str(script), router.address],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    other = LLM(engine=router.address, startup_timeout=STARTUP_TIMEOUT_S)
    try:
        assert doomed.stdout.readline().strip() == "GENERATING"
        assert dp_llm.get_stats().num_running >= 4
        os.kill(doomed.pid, signal.SIGKILL)
        results = {}
        halves = {"a": list(range(0, 16, 2)), "b": list(range(1, 16, 2))}
        threads = [threading.Thread(target=lambda n=n, f=f: results.setdefault(
            n, f.generate([prompts[i] for i in halves[n]], GREEDY, use_tqdm=False)))
            for n, f in (("a", dp_llm), ("b", other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for name, frontend in (("a", dp_llm), ("b", other)):
            assert_greedy_equal(results[name], [reference[i] for i in halves[name]])
            assert frontend._llm._processor.num_unknown_outputs == 0

        def pool_free():
            s = dp_llm.get_stats()
            return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0

        wait_for(pool_free, FRONTEND_TIMEOUT_S + 10, "the killed frontend's blocks")
        wait_for(lambda: "silent for" in router.stderr_tail(400), 5,
                 "the router's log line about the silent frontend")
    finally:
        other.close()
        if doomed.poll() is None:
            doomed.kill()
        doomed.wait(timeout=10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_dp2_tiny_kv_cache_preempts(tiny_llama, prompts, reference,  # noqa: F811
                                    async_scheduling):
    """7 usable KV blocks per core for 8 requests of up to 71 tokens each: preemptions."""
    with LLM(tiny_llama, data_parallel_size=2, num_gpu_blocks_override=8, max_model_len=112,
             async_scheduling=async_scheduling, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        assert llm.engine_info.num_kv_blocks == 16
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0


@pytest.mark.timeout(240)
def test_a_killed_core_takes_down_only_itself(router, dp_llm):
    long = [SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=200, ignore_eos=True)]
    params = long * 2
    work = [[5, 6, 7], [9, 10, 11, 12], [13, 14], [15, 16, 17]]
    expected = dp_llm.generate(work, params, use_tqdm=False)
    cores = children(router.pid)
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
    restarted = wait_for(lambda: len(set(children(router.pid)) - {cores[0]}) == 2, 120,
                         "the router to start the core again")
    assert restarted
    served = dp_llm.generate(work[:2], long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in served] == \
        [o.outputs[0].token_ids for o in expected[:2]]
