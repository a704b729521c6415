"""Issue 34: Granite 3, OLMo 2, Phi-3 (LongRoPE, partial rotary, fused checkpoint
projections), Gemma 2 and Gemma 3 (text, and the multimodal checkpoint's text model): tidal's logits equal transformers' on the tiny random
models (tests/tiny_models.py), float64, the prompt whole and in chunks of 5, and after a
prefix-cache hit; the worker's start-up words for the one-call C layers; refusals by name.

Prompts are 30 tokens: longer than the Gemmas' 8-key window (so the sliding layers drop keys),
shorter than the tiny Phi-3's original_max_position_embeddings=40. Past 40, tidal rotates each
position by its own factors (workers/layers.py LongRopeEmbedding), as transformers' forward
with a KV cache does, step by step; that is what the LongRoPE test compares. (transformers'
generate() instead drops the cache at position 40 and recomputes the sequence with the long
factors: docs/models.md.)

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


def test_phi3_long_factors_past_the_original_context(tiny_model_factory):
    """Prompt of 36 tokens, then 8 single-token steps to position 43 with transformers' KV
    cache: its forward takes the long factors from the step whose sequence passes 40."""
    import transformers

    path = tiny_model_factory("phi3")
    tokens = prompt_ids(5, 44)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        out = model(torch.tensor([tokens[:36]]), use_cache=True)
        refs = [out.logits[0]]
        for token in tokens[36:]:
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
            refs.append(out.logits[0])
    ours = chunked_logits(loaded_worker(path, "float64"), tokens, 36, "long")
    assert rel_err(ours, torch.cat(refs)) < 1e-9


def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration: the text model of a tiny random multimodal folder (a
    one-layer vision tower beside it, skipped) gives transformers' logits for a text prompt;
    the checkpoint's `language_model.model.*` names load, and its sparse text_config takes
    Gemma3TextConfig's defaults for what it does not give (here: rope thetas, eps)."""
    import transformers

    from tiny_models import make_tokenizer

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                sliding_window=8, query_pre_attn_scalar=32, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=5,
                                       boi_token_index=3, eoi_token_index=4, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.language_model"):
                p.normal_(0.0, 0.2)  # norms away from their offset 0, peaked logits
    model.save_pretrained(str(tmp_path))
    make_tokenizer(str(tmp_path))
    tokens = prompt_ids(0, PROMPT_LEN)
    with torch.no_grad():
        ref = model.to(torch.float64)(torch.tensor([tokens])).logits[0]
    ours = chunked_logits(loaded_worker(str(tmp_path), "float64"), tokens, 5, "mm")
    assert rel_err(ours, ref) < 1e-9


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
     "Gemma3ForConditionalGeneration: config.json has no text_config"),
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


# the GGUF files transformers' reader takes: their weights (F32) come back, and tidal on the
# converted folder equals transformers on it. The tiny Phi-3 without LongRoPE and partial
# rotary, the Gemmas with transformers' GGUF defaults for what the file cannot say
GGUF_MODELS = {  # (Gemma 2 converts as Gemma 3 does: transformers' same tensor processor)
    "phi3": dict(rope_scaling=None, partial_rotary_factor=1.0),
    "gemma3": dict(query_pre_attn_scalar=256, layer_types=None, rope_parameters=None),
}


@pytest.mark.parametrize("arch", list(GGUF_MODELS))
def test_gguf_file_converts_and_runs(tiny_model_factory, tmp_path, arch):
    from safetensors.torch import load_file

    from tidal.workers.gguf import gguf_folder
    from tidal.workers.loader import read_config
    from tiny_models import make_tiny_gguf

    original = tiny_model_factory(arch, **GGUF_MODELS[arch])
    folder = gguf_folder(make_tiny_gguf(original, str(tmp_path / f"{arch}.gguf")),
                         str(tmp_path / "cache"))
    assert read_config(folder)["architectures"] == read_config(original)["architectures"]
    ours, theirs = (load_file(f"{f}/model.safetensors") for f in (folder, original))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():  # a Gemma's norms went through 1 + w and back
        assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-6), name
    tokens = prompt_ids(0, PROMPT_LEN)
    logits = chunked_logits(loaded_worker(folder, "float64"), tokens, 7, "g")
    assert rel_err(logits, hf_logits(folder, "float64", tokens)) < TOLERANCE.get(arch, 1e-9)
