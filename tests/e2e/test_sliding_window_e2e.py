"""A Mistral with a sliding window shorter than its prompts, through the whole process tree,
gives transformers' greedy tokens (issue 34): every layer attends within 20 positions
(tiny_models' "mistral"), the workers report the window, and the engine core frees the
blocks that fall out of it. One daemon, with every prompt chunked (16-token budget), a KV
cache of 9 usable blocks (preemptions: six requests outgrow it even at 3 blocks each), and
prefix caching (a second pass hits the blocks the first one left cached, freed ones
included). transformers' Mistral honours the window in its default (sdpa) attention, as in
eager: checked to 5e-6 on this model.
"""

from __future__ import annotations

import random

import pytest

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams
from test_llm import STARTUP_TIMEOUT_S, assert_greedy_equal, hf_greedy

WINDOW = 20
MAX_TOKENS = 25
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tiny_mistral(tiny_model_factory) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Six prompts, four longer than the window, two sharing a 40-token prefix."""
    rng = random.Random(34)
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 25, 40, 61)]
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    return out + [prefix + [rng.randrange(3, 512) for _ in range(k)] for k in (3, 9)]


@pytest.mark.timeout(300)
def test_mistral_window_greedy_chunked_preempted_and_prefix_hit(tiny_mistral, prompts):
    reference = hf_greedy(tiny_mistral, prompts, MAX_TOKENS)
    with LLM(tiny_mistral, max_model_len=128, num_kv_blocks_override=10,
             max_num_batched_tokens=16, max_num_seqs=8, async_scheduling=False,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(first, reference)
        mid = llm.get_stats()
        assert mid.num_preemptions > 0
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(second, reference)
        after = llm.get_stats()
        assert after.prefix_cache_hits > mid.prefix_cache_hits
        assert after.kv_cache_usage == 0.0  # every block back, freed ones included
