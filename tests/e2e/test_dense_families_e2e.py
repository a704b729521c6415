"""Issue 34: each dense family beyond Llama through the whole process tree (`LLM`: frontend,
engine-core daemon, worker processes): Granite 3 (its multipliers), Phi-3 (its fused
checkpoint projections, LongRoPE's short factors, partial rotary), OLMo 2 (q/k norms over the
whole projection), Gemma 2 (sliding windows, score caps) and Gemma 3 (sliding / full / sliding
layers, per-head q/k norms). Gemma 3 at TP=2 and again in two pipeline stages, the others at
TP=1: a TP=2 engine starts two workers that all-reduce every layer (the four TP=1 cases took
80 s where they had taken 179 s at TP=2, both runs on the same loaded 2-core machine). Each
family's TP=2 split (Phi-3's fused projections split over the ranks, OLMo 2's q/k norms
all-reduced) is asserted at the worker, float64 logits against transformers', in
tests/workers/test_tensor_parallel.py.

Greedy tokens equal transformers' `generate()` on the tiny random float32 models, with every
prompt chunked (16-token steps) in a KV pool of 7 usable blocks for 7 requests of up to 3
blocks (preemptions: the counter must move), then the two prompts sharing a full block again,
hitting the prefix cache. Compared up to
transformers' first top-2 logit gap under 1e-4, as in test_llm.py. One engine start per case
(~8 s each on an idle 2-core machine; the rest is transformers' reference).

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
@pytest.mark.parametrize("arch, tp, pp", [("granite", 1, 1), ("phi3", 1, 1), ("olmo2", 1, 1),
                                          ("gemma2", 1, 1), ("gemma3", 2, 1),
                                          ("gemma3", 1, 2)])
def test_greedy_chunked_preempted_prefix_cached(tiny_model_factory, arch, tp, pp):
    """TP=1; Gemma 3 at TP=2 and in two pipeline stages (its own forward, the tied LM head on
    the last stage)."""
    path = tiny_model_factory(arch)
    prompts = _prompts()
    reference = hf_greedy(path, prompts, MAX_TOKENS)
    # 8 blocks of 16 (block 0 reserved): 7 requests of 1-3 blocks each outgrow them
    with LLM(path, num_gpu_blocks_override=8, max_model_len=48, max_num_batched_tokens=16,
             max_num_seqs=8, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             startup_timeout=120) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(first, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0
        # the shared block was freed last: still cached for the two prompts that share it
        second = llm.generate(prompts[-2:], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids
                                                            for o in first[-2:]]
        assert all(o.metrics.num_cached_tokens >= 16 for o in second)
