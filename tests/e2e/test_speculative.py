"""Speculative decoding through the whole process tree (issue 36, section 1): greedy outputs
are identical with speculation on and off, token for token, for every method.

One engine without speculation gives the reference; one engine per method runs the same
prompts with chunked prefill (a 48-token budget), a KV cache so small that requests are
preempted, async scheduling on, and the adaptive policy off (every draft the proposer has is
verified, the hardest case for rollback). The prompts repeat themselves, so the n-gram and
suffix proposers find drafts and the tiny random model accepts some of them (its greedy
output loops), so both acceptance and rejection are exercised. The metrics count drafts.
"""

from __future__ import annotations

import json
import random

import pytest

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

STARTUP_TIMEOUT_S = 120.0
SMALL_KV = "64MiB"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """10 prompts that quote themselves (a phrase repeated with noise between)."""
    rng = random.Random(36)
    out = []
    for n in range(10):
        phrase = [rng.randrange(3, 500) for _ in range(6 + n)]
        noise = [rng.randrange(3, 500) for _ in range(3 + 2 * n)]
        out.append(phrase + noise + phrase[:4])
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    with LLM(tiny_llama, kv_cache_memory=SMALL_KV,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_same_tokens(outputs, reference, label: str = "") -> None:
    """Each output's token ids equal the reference's, prompt by prompt."""
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"{label}prompt {i}: {g} != {r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_identical_with_speculation_chunked_preempted_async(tiny_llama, prompts,
                                                                  reference, method):
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    with LLM(tiny_llama, speculative_config=json.dumps(spec), num_gpu_blocks_override=12,
             max_model_len=96, max_num_batched_tokens=48, max_num_seqs=8,
             async_scheduling=True, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert_same_tokens(outputs, reference)
    assert stats.num_preemptions > 0
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_identical_with_speculation_tp2_pp2(tiny_llama, prompts, reference):
    """Tensor and pipeline parallelism at once (4 workers): the drafts travel to every stage
    in the plan, every tensor-parallel rank verifies alike."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    with LLM(tiny_llama, speculative_config=spec, tensor_parallel_size=2,
             pipeline_parallel_size=2, kv_cache_memory=SMALL_KV, max_model_len=96,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert stats.spec_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_factory) -> str:
    """A smaller random Llama with the target's vocabulary (1 layer, half the width)."""
    return tiny_model_factory("llama", seed=1, num_hidden_layers=1, hidden_size=32,
                              num_attention_heads=2, num_key_value_heads=1,
                              intermediate_size=64)


@pytest.mark.timeout(300)
def test_greedy_identical_with_a_draft_model_chunked_preempted_async(
        tiny_llama, tiny_draft, prompts, reference):
    """draft_model: a smaller model's drafts (rarely accepted by the random target) and the
    target as its own draft (every draft accepted: the drafts do come from the draft model,
    its KV cache kept in step through chunks, preemptions and rejections)."""
    for draft, all_accepted in ((tiny_draft, False), (tiny_llama, True)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                "adaptive": False}
        with LLM(tiny_llama, speculative_config=spec, num_gpu_blocks_override=12,
                 max_model_len=96, max_num_batched_tokens=48, max_num_seqs=8,
                 async_scheduling=True, startup_timeout=STARTUP_TIMEOUT_S) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            stats = llm.get_stats()
        assert_same_tokens(outputs, reference, f"draft {draft}, ")
        assert stats.num_preemptions > 0
        assert stats.spec_num_draft_tokens > 0
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
        if all_accepted:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_draft_model_refusals_name_the_key(tiny_llama, tmp_path):
    """A missing folder or another vocabulary is refused before any process starts."""
    other = tmp_path / "other-vocab"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "vocab_size": 7}))
    for folder, match in ((str(tmp_path / "missing"), "not a model folder"),
                          (str(other), "vocab_size 7")):
        spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match=f"speculative_config.model .*{match}"):
            LLM(tiny_llama, speculative_config=spec, startup_timeout=STARTUP_TIMEOUT_S)
