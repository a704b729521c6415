"""Issue 34: Phi-3 (its fused checkpoint projections split over the ranks, LongRoPE's short
factors, partial rotary), OLMo 2 (q/k norms over the whole projection, all-reduced across
ranks) and Gemma 2 (sliding windows, score caps), each at TP=2 through the whole process tree
(`LLM`: frontend, engine-core daemon, two worker processes): greedy tokens equal
transformers' `generate()` on the tiny random float32 models, with every prompt chunked
(16-token steps) and a second pass hitting the prefix cache. Compared up to transformers'
first top-2 logit gap under 1e-4, as in test_llm.py; and Gemma 3 in two pipeline stages.
Four engine starts only: Granite differs from these in model code alone, which
tests/workers/test_dense_families.py compares logit by logit (chunked, after a prefix-cache
hit) on the worker the engine runs.

The prompts (up to 24 tokens, 10 generated) stay inside the tiny Phi-3's original 40
positions (past them transformers' generate() recomputes the sequence: docs/models.md) and
are longer than the Gemmas' 8-key windows.
"""

from __future__ import annotations

import random

import pytest

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams
from test_llm import assert_greedy_equal, hf_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _prompts() -> list[list[int]]:
    """5 prompts of mixed length, then 2 sharing an 18-token prefix (one full block)."""
    rng = random.Random(34)
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 14, 20, 24)]
    prefix = [rng.randrange(3, 512) for _ in range(18)]
    return out + [prefix + [rng.randrange(3, 512) for _ in range(k)] for k in (2, 5)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch, tp, pp", [("phi3", 2, 1), ("olmo2", 2, 1), ("gemma2", 2, 1),
                                          ("gemma3", 1, 2)])
def test_greedy_chunked_prefix_cached(tiny_model_factory, arch, tp, pp):
    """TP=2, or for Gemma 3 two pipeline stages (its own forward, the tied LM head on the
    last stage)."""
    path = tiny_model_factory(arch)
    prompts = _prompts()
    reference = hf_greedy(path, prompts, MAX_TOKENS)
    with LLM(path, kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=8,
             tensor_parallel_size=tp, pipeline_parallel_size=pp, startup_timeout=120) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(first, reference)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids
                                                            for o in first]
        assert all(o.metrics.num_cached_tokens >= 16 for o in second[-2:])
