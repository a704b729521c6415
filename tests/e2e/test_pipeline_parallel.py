"""Pipeline parallelism through the whole process tree (issue 14, part 2): greedy tokens equal
transformers' with the layers split over two stages, alone and with two tensor-parallel ranks
per stage (4 worker processes), each under a 7-block KV cache that forces preemptions, with
async scheduling on and off (a start-up setting: one engine start each):
- PP=2, fcfs, prefix caching (a second pass hits the cache);
- PP=2 × TP=2, chunked prefill (32-token budget), priority policy.
The batch queue itself (both stages busy, in-flight requests held back) is unit-tested on
the fake executor in tests/engine_core/test_engine_core.py.
"""

from __future__ import annotations

import random

import pytest
from test_llm import GREEDY, STARTUP_TIMEOUT_S, assert_greedy_equal, hf_greedy

from tidal.frontend.llm import LLM

TINY_KV = dict(num_gpu_blocks_override=8, max_model_len=112)  # 7 usable blocks of 16 tokens


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """10 token-id prompts of 3-61 tokens, 3 of them sharing a 40-token prefix."""
    rng = random.Random(14)
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 17, 25, 33, 50, 61)]
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    return out + [prefix + [rng.randrange(3, 512) for _ in range(k)] for k in (1, 5, 9)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_pp2_greedy_equals_transformers_under_preemption(tiny_llama, prompts, reference,
                                                         async_scheduling):
    with LLM(tiny_llama, pipeline_parallel_size=2, async_scheduling=async_scheduling, **TINY_KV,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        for _ in range(2):  # the second pass reads the prefix cache
            assert_greedy_equal(llm.generate(prompts, GREEDY, use_tqdm=False), reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
        assert stats.kv_cache_usage == 0.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_pp2_tp2_chunked_priority_greedy_equals_transformers(tiny_llama, prompts, reference,
                                                             async_scheduling):
    with LLM(tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=2,
             async_scheduling=async_scheduling, max_num_batched_tokens=32, max_num_seqs=16,
             scheduling_policy="priority",
             **TINY_KV, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                               priority=[i % 3 for i in range(len(prompts))])
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0
