"""Issue 34: Granite 3, OLMo 2, Phi-3 (LongRoPE, partial rotary, fused checkpoint
projections), Gemma 2 and Gemma 3 text: tidal's logits equal transformers' on the tiny random
models (tests/tiny_models.py), float64, the prompt whole and in chunks of 5, and after a
prefix-cache hit; the worker's start-up words for the one-call C layers; refusals by name.

Prompts are 30 tokens: longer than the Gemmas' 8-key window (so the sliding layers drop keys),
shorter than the tiny Phi-3's original_max_position_embeddings=32 (a longer prompt in one
forward takes transformers' long factors at every position, tidal's at positions >= 32 only:
workers/layers.py LongRopeEmbedding; decode past 32 is compared in tests/e2e/).

float64 tolerance 1e-9 (we measure 0 to 1e-15), except Gemma 2: transformers runs its eager
attention (for the score cap) with a float32 softmax, 1.5e-7 away from float64's.
"""

import pytest
import torch

from tidal.workers.models import parse_model_args
from worker_test_utils import PlanScript, chunked_logits, hf_logits, loaded_worker, prompt_ids
from worker_test_utils import rel_err

ARCHS = ("granite", "olmo2", "phi3", "gemma2", "gemma3")
TOLERANCE = {"gemma2": 1e-6}
PROMPT_LEN = 30


@pytest.fixture(scope="module", params=ARCHS)
def arch_worker(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    return request.param, path, loaded_worker(path, "float64")


def test_logits_whole_chunked_and_after_a_prefix_cache_hit(arch_worker):
    arch, path, worker = arch_worker
    tolerance = TOLERANCE.get(arch, 1e-9)
    tokens = prompt_ids(0, PROMPT_LEN)
    ref = hf_logits(path, "float64", tokens)
    for chunk in (PROMPT_LEN, 5):
        ours = chunked_logits(worker, tokens, chunk, req_id=f"c{chunk}")
        assert rel_err(ours, ref) < tolerance, (arch, chunk, rel_err(ours, ref))
        worker.runner.batch.remove(f"c{chunk}")
    # B shares A's first 16 tokens (one full block): only its tail is computed, over A's K/V
    shared = prompt_ids(1, 16)
    a_tokens, b_tokens = shared + prompt_ids(2, 10), shared + prompt_ids(3, 12)
    script = PlanScript()
    script.add("a", a_tokens)
    worker.runner.compute_logits_all(script.plan())
    a_blocks = script.requests["a"].block_ids
    script.finish("a")
    script.add("b", b_tokens, num_computed=16, block_ids=a_blocks[:1])
    parts = []
    while script.requests["b"].num_computed < len(b_tokens):
        parts.append(worker.runner.compute_logits_all(script.plan(5)))
    ours = torch.cat(parts)
    ref = hf_logits(path, "float64", b_tokens)[16:]
    assert rel_err(ours, ref) < tolerance, (arch, rel_err(ours, ref))
    script.finish("b")


def test_start_up_line_names_what_the_one_call_layers_lack(tiny_model_factory):
    from tidal.kernels.cpu.ops import CpuOps
    from tidal.workers.distributed import PipelineParallel, TensorParallel
    from tidal.workers.loader import read_config
    from tidal.workers.models import build_model

    args = parse_model_args(read_config(tiny_model_factory("granite")))
    model = build_model(args, TensorParallel(), None, 64, PipelineParallel())
    taken = model.use_cpu_ops(CpuOps(fused=True))
    assert "module by module (Granite's residual multiplier" in taken
    assert "module by module" not in model.use_cpu_ops(CpuOps())  # torch's ops: no fusing


@pytest.mark.parametrize("config, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "architecture GPT2LMHeadModel is not supported"),
    (dict(architectures=["Gemma3ForConditionalGeneration"]),
     "architecture Gemma3ForConditionalGeneration is not supported"),
    (dict(architectures=["Phi3ForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
          num_hidden_layers=1, num_attention_heads=2,
          rope_scaling={"type": "dynamic", "factor": 2.0}),
     "Phi3ForCausalLM: rope_scaling type 'dynamic' is not supported"),
    (dict(architectures=["Gemma2ForCausalLM"], vocab_size=8, hidden_size=8,
          intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
          hidden_activation="relu"), "hidden_act 'relu' is not supported by Gemma2ForCausalLM"),
    (dict(architectures=["Gemma3ForCausalLM"], vocab_size=8, hidden_size=8,
          intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
          layer_types=["sliding_attention"]), "layer_types must name"),
])
def test_unsupported_configs_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_model_args(config)
