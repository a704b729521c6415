"""Tiny Hugging Face model folders for tests: random weights from a fixed seed, and a
byte-level BPE tokenizer trained offline on a built-in corpus. Nothing is downloaded.

    make_tiny_model(path, arch="llama" | "qwen2" | "qwen3" | "granite" | "olmo2" | "phi3" |
                    "gemma2" | "gemma3" | ..., dtype="float32",
                    **config_overrides) -> path
    make_tiny_gguf(model_dir, path, qtype="F32" | "Q8_0" | ..., arch=None) -> path

Each folder is a normal HF folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) that transformers' Auto classes load.
"""

from __future__ import annotations

import json
import os

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

HERMES_TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
    "{% elif messages[0].role == 'system' %}<|system|>\n{{ messages[0].content }}\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}"
    "{% set f = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% elif m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n"
    "</tool_response>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A chat template that renders `tools` and tool calls the way Qwen 2.5 / 3's does (the tools'
JSON in the system turn, calls as <tool_call> blocks, results as <tool_response>), with the
tiny tokenizer's role markers; for `--chat-template` in the tool-calling tests."""

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A continuous batching engine admits requests as
soon as there is room and retires them the step they finish. Tokens flow from the prompt into
the key value cache, one block at a time. def add(a, b):\n    return a + b\n
class Scheduler:\n    def schedule(self):\n        return self.plan\n
for i in range(10):\n    print(i * i)\n
Once upon a time there was a small model that learned to count: one, two, three, four, five,
six, seven, eight, nine, ten. Hello world! How are you today? I am fine, thank you.
"""


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines()
    # Repeat with variations so BPE has enough pairs to merge into a 512-token vocabulary.
    return [f"{line} {i}" for i in range(40) for line in lines]


def make_tokenizer(path: str) -> None:
    """Train a byte-level BPE tokenizer (deterministic) and save it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


_ARCH_DEFAULTS = {
    "llama": dict(),
    "qwen2": dict(),
    "qwen3": dict(head_dim=16),
    # Mistral v0.1: every layer windowed, 20 keys (not a block multiple), under test prompts
    "mistral": dict(sliding_window=20),
    # mixture-of-experts: 8 experts (Granite-MoE 4), top-2 (workers/models/moe_decoder.py)
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, mlp_only_layers=[1]),  # 1 dense
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=1.5),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                       embedding_multiplier=2.0, residual_multiplier=0.5,
                       attention_multiplier=0.2, logits_scaling=2.0),
    # dense families beyond Llama (workers/models/granite.py, olmo2.py, phi3.py, gemma.py).
    # Granite: multipliers away from 1 so each one matters, mild enough for peaked logits
    "granite": dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
                    logits_scaling=2.0),
    "olmo2": dict(),
    # LongRoPE: short factors below position 40, long ones from there on; 3/4 of each head
    # rotates (Phi-4-mini's partial rotary factor)
    "phi3": dict(max_position_embeddings=160, original_max_position_embeddings=40,
                 partial_rotary_factor=0.75, rope_scaling={
                     "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
    # windows of 8 keys on the sliding layers, shorter than the tests' prompts
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=32, sliding_window=8,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   tie_word_embeddings=True),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=32, sliding_window=8,
                   num_hidden_layers=3, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1000000.0}}),
}
_RANDOM_NORMS = {"olmo2": 1.0, "gemma2": 0.0, "gemma3": 0.0}
"""Norm weights drawn around transformers' initial value (OLMo's 1, Gemma's offset 0), so a
norm applied wrongly shows."""


def make_tiny_model(path: str, arch: str = "llama", seed: int = 0, dtype: str = "float32",
                    **overrides) -> str:
    """Build a random-weight model folder at `path` (created) and return the path. The
    weights are drawn in float32 and saved in `dtype` (config.json says which)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    make_tokenizer(path)
    eos_id = _token_id(path, "<|endoftext|>")
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.2,  # peaked logits: fewer near-ties in greedy comparisons
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    common.update(_ARCH_DEFAULTS[arch])
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    if "rope_parameters" in common:
        common.pop("rope_theta")  # each layer type's rope carries its own
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(torch.float32)
    if arch in ("qwen2", "qwen2_moe"):  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.2)
    if arch in _RANDOM_NORMS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(_RANDOM_NORMS[arch], 0.2)
    model.generation_config.do_sample = False
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


def _token_id(path: str, token: str) -> int:
    with open(os.path.join(path, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    return vocab[token]


_GGUF_LAYOUTS = {  # config.json model_type -> (GGUF architecture, the gguf package's tensor map)
    "llama": ("llama", "LLAMA"),
    "phi3": ("phi3", "PHI3"),
    "gemma2": ("gemma2", "GEMMA2"),
    "gemma3_text": ("gemma3", "GEMMA3"),
}


def make_tiny_gguf(model_dir: str, path: str, qtype: str = "F32", arch: str | None = None) -> str:
    """Write the tiny folder `model_dir` (Llama, Phi-3, Gemma 2 or Gemma 3) as a GGUF file at
    `path` and return the path.

    The layout is llama.cpp's (its converter is not a package; the `gguf` package writes the
    file): metadata under `<arch>.`, the byte-level BPE tokenizer as `tokenizer.ggml.*` (model
    "gpt2") with the chat template, a Llama's q/k rows permuted into llama.cpp's rotary order,
    a Gemma's norm weights stored as 1 + w (as llama.cpp's converter writes them), and every
    2-D weight quantized by the `gguf` package to `qtype` (F32 keeps float32; Q8_0,
    Q4_1...). `arch` only renames the architecture, to test refusals. Only what transformers'
    GGUF reader maps is written: no LongRoPE factors, partial rotary factor, soft caps or
    Gemma 3 local rope base (a folder with other values converts to transformers' defaults).
    """
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    gguf_arch, tensor_map = _GGUF_LAYOUTS[config.get("model_type", "llama")]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, arch or gguf_arch)
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if gguf_arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config["sliding_window"])
    _add_gguf_tokenizer(writer, model_dir, config["eos_token_id"])
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, tensor_map), layers)
    quantized = getattr(gguf.GGMLQuantizationType, qtype)
    for name, weight in load_file(os.path.join(model_dir, "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        weight = weight.astype("float32")
        if gguf_arch == "llama" and base.endswith(("q_proj", "k_proj")):
            n = heads if base.endswith("q_proj") else kv_heads
            weight = weight.reshape(n, 2, weight.shape[0] // n // 2, *weight.shape[1:]) \
                .swapaxes(1, 2).reshape(weight.shape)
        if gguf_arch.startswith("gemma") and base.endswith("norm"):
            weight = weight + 1
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if weight.ndim == 2 and qtype != "F32":
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, quantized),
                              raw_dtype=quantized)
        else:
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_tokenizer(writer, model_dir: str, eos_id: int) -> None:
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(eos_id)  # else transformers takes Phi-3's 32000, past the vocab
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def make_tiny_embedding_model(path: str, seed: int = 0, pooling: str = "lasttoken",
                              architecture: str = "Qwen3ForCausalLM") -> str:
    """A random-weight Qwen3 embedding model laid out as Qwen3-Embedding's folder is: the bare
    decoder's weights (transformers' Qwen3Model: no `lm_head`, tensor names without the
    `model.` prefix), config.json naming `architecture`, and a sentence-transformers pooling
    config (modules.json, 1_Pooling/config.json with `pooling`, a Normalize module)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    make_tokenizer(path)
    eos_id = _token_id(path, "<|endoftext|>")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id)
    torch.manual_seed(seed)
    transformers.Qwen3Model(config).to(torch.float32).save_pretrained(
        path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["architectures"] = [architecture]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64,
                   **{f"pooling_mode_{m}": m == pooling for m in modes}}, f)
    return path


def make_tiny_moe_gguf(model_dir: str, path: str) -> str:
    """Write the tiny Qwen3-MoE folder `model_dir` as a float32 GGUF file at `path` in
    llama.cpp's layout (`qwen3moe`): each layer's experts stacked as `ffn_gate_exps` /
    `ffn_up_exps` [E, I, hidden] and `ffn_down_exps` [E, hidden, I], the router as
    `ffn_gate_inp`, q/k rows as they are (neox rotary: llama.cpp permutes only Llama's).
    transformers reads no expert width from a GGUF (it keeps Qwen3MoeConfig's default
    moe_intermediate_size, 768), so the folder must use that width."""
    import re

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    num_experts = config.get("num_experts") or config["num_local_experts"]
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _add_gguf_tokenizer(writer, model_dir, config["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, weight in load_file(os.path.join(model_dir, "model.safetensors")).items():
        weight = weight.astype("float32")
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:  # stacked below, one tensor per layer and projection
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = weight
            continue
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", weight)
    for base, by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(num_experts)])
        writer.add_tensor(f"{names.get_name(base)}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
