"""Issue 34: each mixture-of-experts family through the whole process tree (frontend -> engine
core -> worker processes): the tiny Mixtral, Qwen2-MoE (8 experts top-2, a gated shared expert,
one dense layer), Qwen3-MoE (norm_topk_prob, per-head q/k norms), OLMoE (full-width q/k norms,
clip_qkv) and Granite-MoE (top-k then softmax, multipliers); Qwen2-MoE at TP=2 (every expert's
matrices split over two worker processes), the others at TP=1 (the four TP=1 cases took 125 s
where they had taken 195 s at TP=2, both runs on the same loaded 2-core machine; each family's
TP=2 split is asserted at the worker, float64 logits against transformers', in
tests/workers/test_tensor_parallel.py), every prompt chunked (max_num_batched_tokens=32),
prefix caching on. Greedy tokens equal transformers' generate() (up to its first near-tie, as
in test_llm.py); a second pass hits the prefix cache and gives the same tokens."""

from __future__ import annotations

import random

import pytest

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

MAX_TOKENS = 8
TIE_GAP = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _prompts() -> list[list[int]]:
    """5 of mixed length, then 3 sharing a 40-token prefix (2 full blocks of 16)."""
    rng = random.Random(34)
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 20, 33, 61)]
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    return out + [prefix + [rng.randrange(3, 512) for _ in range(k)] for k in (1, 5, 9)]


def _hf_greedy(path: str, prompts) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and each position's top-2 logit gap."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, output_logits=True,
                                 return_dict_in_generate=True)
            gaps = [float(torch.topk(logits[0].float(), 2).values.diff().abs())
                    for logits in gen.logits]
            result.append((gen.sequences[0, len(p):].tolist(), gaps))
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch, tp", [("mixtral", 1), ("qwen2_moe", 2), ("qwen3_moe", 1),
                                      ("olmoe", 1), ("granitemoe", 1)])
def test_moe_greedy_chunked_prefix_hits(tiny_model_factory, arch, tp):
    path = tiny_model_factory(arch)
    prompts = _prompts()
    reference = _hf_greedy(path, prompts)
    with LLM(path, kv_cache_memory="64MiB", tensor_parallel_size=tp,
             max_num_batched_tokens=32, max_num_seqs=16, startup_timeout=120) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        mid = llm.get_stats()
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        after = llm.get_stats()
    for i, (out, (tokens, gaps)) in enumerate(zip(first, reference)):
        tie = next((k for k, g in enumerate(gaps) if g < TIE_GAP), len(tokens))
        assert out.outputs[0].token_ids[:tie] == tokens[:tie], f"prompt {i}"
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert after.prefix_cache_hits > mid.prefix_cache_hits
    assert any(o.metrics.num_cached_tokens >= 32 for o in second[-3:])
