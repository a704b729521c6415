"""Issue 34: mixture-of-experts models (workers/moe.py, workers/models/moe_decoder.py).

For each of Mixtral, Qwen2-MoE (shared expert, one dense layer), Qwen3-MoE (norm_topk_prob),
OLMoE (full-width q/k norms, clip_qkv) and Granite-MoE (top-k then softmax, multipliers), on a
tiny random float32 model (8 experts, Granite 4, top-2): prompt logits equal transformers' to
float32 rounding, and greedy tokens equal transformers' generate() in one batch of mixed
lengths prefilled in chunks of 16 tokens, one request arriving with a prefix-cache hit (3
blocks another request wrote). TP=2 (two gloo processes) for every family, OLMoE with one KV
head (its q norm's sum of squares all-reduced, its k norm's counted on both ranks): float64
logits equal transformers' to float32 rounding, in tests/workers/test_tensor_parallel.py (one
spawn of two ranks for every TP=2 test); tests/e2e/test_moe_llm.py runs Qwen2-MoE at TP=2
through the whole engine. A checkpoint in
transformers 5's stacked layout (what a GGUF conversion writes)
loads to the same logits, and so does a qwen3moe GGUF file through the GGUF conversion; a bad
expert count is a ValueError naming the field.

transformers is run with experts_implementation="eager" (its default grouped_mm takes no
float64).
"""

import json
import os

import pytest
import torch
import transformers

from tidal.ipc.messages import SamplingParams
from tidal.workers.models import parse_model_args
from worker_test_utils import PlanScript, chunked_logits, loaded_worker, prompt_ids, rel_err

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
NUM_NEW = 5
LENGTHS = (1, 40)
SHARED = 48  # the prefix-cache hit: 3 full blocks of 16


def hf_model(path: str, dtype: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), experts_implementation="eager").eval()


def hf_logits(path: str, dtype: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path, dtype)(torch.tensor([tokens])).logits[0]


def _prompts() -> dict[str, list[int]]:
    prompts = {f"p{n}": prompt_ids(n, n) for n in LENGTHS}
    prompts["hit"] = prompt_ids(1, SHARED) + prompt_ids(3, 20)
    return prompts


def _hf_greedy(path: str) -> dict[str, list[int]]:
    model = hf_model(path, "float32")
    out = {}
    for name, prompt in _prompts().items():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, do_sample=False)
        out[name] = gen[0, len(prompt):].tolist()
    return out


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    return path, loaded_worker(path, "float32")


def test_logits_match_transformers_chunked(moe):
    path, worker = moe
    tokens = prompt_ids(5, 60)
    ours = chunked_logits(worker, tokens, 7, "logits")
    worker.runner.batch.remove("logits")
    assert rel_err(ours, hf_logits(path, "float32", tokens)) < 1e-5


def test_greedy_batch_chunked_with_prefix_hit(moe):
    path, worker = moe
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    script = PlanScript(first_block=20)
    script.add("writer", prompt_ids(1, SHARED) + prompt_ids(2, 10),
               SamplingParams(temperature=0.0, max_tokens=1))
    script.run(worker)
    writer_blocks = script.done["writer"].block_ids
    for name, prompt in _prompts().items():
        if name == "hit":  # its first 48 tokens' K/V are the writer's blocks
            script.add(name, prompt, greedy, num_computed=SHARED,
                       block_ids=writer_blocks[:SHARED // 16])
        else:
            script.add(name, prompt, greedy)
    outputs = script.run(worker, chunk=16)
    expected = _hf_greedy(path)
    for name in expected:
        assert outputs[name] == expected[name], name


def test_stacked_checkpoint_loads(tiny_model_factory, tmp_path):
    """transformers 5's own parameter names (experts.gate_up_proj [E, 2I, hidden],
    experts.down_proj [E, hidden, I]), as workers/gguf.py saves a converted GGUF."""
    from safetensors.torch import save_file

    source = tiny_model_factory("qwen2_moe")
    folder = tmp_path / "stacked"
    folder.mkdir()
    for name in os.listdir(source):
        if name != "model.safetensors":
            (folder / name).write_bytes(open(os.path.join(source, name), "rb").read())
    state = {k: v.contiguous() for k, v in hf_model(source, "float32").state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(folder / "model.safetensors"))
    tokens = prompt_ids(6, 30)
    ours = chunked_logits(loaded_worker(str(folder), "float64"), tokens, 30, "s")
    assert rel_err(ours, hf_logits(source, "float64", tokens)) < 1e-9


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
    ("num_local_experts", 0, "num_local_experts"),
])
def test_bad_expert_config_names_the_field(tiny_model_factory, field, value, message):
    with open(os.path.join(tiny_model_factory("mixtral"), "config.json")) as f:
        config = json.load(f)
    config[field] = value
    with pytest.raises(ValueError, match=message):
        parse_model_args(config)


def test_qwen3_moe_gguf_converts_to_the_same_logits(tiny_model_factory, tmp_path):
    """A qwen3moe GGUF (llama.cpp's stacked expert tensors) through workers/gguf.py's
    conversion (transformers' reader): the folder it writes gives the source folder's
    logits. The width is transformers' default (it reads no expert width from a GGUF)."""
    from tiny_models import make_tiny_moe_gguf

    from tidal.workers.gguf import convert

    source = tiny_model_factory("qwen3_moe", moe_intermediate_size=768)
    gguf_file = make_tiny_moe_gguf(source, str(tmp_path / "tiny-qwen3moe.gguf"))
    folder = tmp_path / "converted"
    folder.mkdir()
    convert(gguf_file, str(folder))
    tokens = prompt_ids(8, 40)
    ours = chunked_logits(loaded_worker(str(folder), "float32"), tokens, 16, "g")
    assert rel_err(ours, hf_logits(source, "float32", tokens)) < 1e-5


def test_pipeline_stages_load_their_own_experts(tiny_model_factory):
    """PP=2 of the tiny Qwen2-MoE, both stages built here: each loads exactly its layers'
    tensors (the loader refuses a missing or a foreign one), stage 0 the sparse layer with
    its experts, stage 1 the dense one. (Generation at PP=2 is not tested.)"""
    from tidal.kernels.attention import select_attention_backend
    from tidal.workers.distributed import PipelineParallel, TensorParallel
    from tidal.workers.loader import load_weights, read_config
    from tidal.workers.models import build_model

    model_dir = tiny_model_factory("qwen2_moe")
    args = parse_model_args(read_config(model_dir))
    backend = select_attention_backend("auto", "cpu", torch.float32)
    stages = []
    for stage in (0, 1):
        with torch.device("cpu"):
            stages.append(build_model(args, TensorParallel(), backend, 64,
                                      PipelineParallel(stage, 2)))
        load_weights(stages[-1], model_dir)
    first, last = (s.model.layers for s in stages)
    assert list(first) == ["0"] and first["0"].mlp.experts.w13.shape[0] == 8
    assert list(last) == ["1"] and hasattr(last["1"].mlp, "gate_up_proj")


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_few_token_path_equals_the_grouped_one(monkeypatch, weights_dtype):
    """workers/moe.py: steps of up to FEW_TOKENS tokens skip the sort and grouping; one token
    gives the grouped path's result bit for bit (each of its k experts sees its one row in
    both), a few tokens to float32 rounding (the grouped path may give an expert several
    rows in one GEMM). Routing weights in float32 (Mixtral's combine) or in the activations'
    dtype (bfloat16 here: the cast before the sum is the grouped path's)."""
    from tidal.workers import moe
    from tidal.workers.distributed import TensorParallel

    torch.manual_seed(0)
    layer = moe.FusedMoE(8, 32, 16, TensorParallel())
    with torch.no_grad():
        layer.w13.normal_(0, 0.3)
        layer.w2.normal_(0, 0.3)
    dtype = torch.float32 if weights_dtype == torch.float32 else torch.bfloat16
    layer.to(dtype)
    for tokens in (1, 3, moe.FEW_TOKENS):
        x = torch.randn(tokens, 32).to(dtype)
        ids = torch.stack([torch.randperm(8)[:3] for _ in range(tokens)])  # top-3, distinct
        weights = torch.rand(tokens, 3).to(weights_dtype)
        few = layer(x, weights, ids)
        monkeypatch.setattr(moe, "FEW_TOKENS", 0)
        grouped = layer(x, weights, ids)
        monkeypatch.undo()
        assert few.dtype == grouped.dtype == dtype
        if tokens == 1:
            assert torch.equal(few, grouped)
        else:
            torch.testing.assert_close(few, grouped, rtol=1e-6 if dtype == torch.float32
                                       else 1e-2, atol=1e-6 if dtype == torch.float32 else 1e-2)
