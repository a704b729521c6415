"""Issue 16, item 1, offline: `LLM("model.gguf")` and `tidal serve model.gguf` on the tiny
Llama written as a Q8_0 GGUF (`tiny_models.make_tiny_gguf`).

The engine core converts the file into a folder under $TIDAL_CACHE_DIR (a temporary one here)
and names that folder to the frontends, which read the tokenizer and chat template from it;
the served model name stays the file given. Greedy tokens equal transformers' on the
converted folder (float32), compared up to transformers' first top-2 logit gap under 1e-4,
as in test_llm.py.
"""

import os

import pytest

from live_server import ENGINE_FLAGS, LiveServer
from tidal.frontend.engine_client import load_tokenizer
from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

MAX_TOKENS = 8
TIE_GAP = 1e-4
TEXTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was"]


@pytest.fixture(scope="module")
def gguf_file(tiny_gguf_factory, gguf_cache_dir):
    return tiny_gguf_factory("Q8_0")


@pytest.mark.timeout(180)
def test_llm_on_a_gguf_file(gguf_file, gguf_cache_dir, tiny_llama):
    with LLM(gguf_file, kv_cache_memory="8MiB") as llm:
        folder = llm.engine_info.model
        assert folder.startswith(os.path.join(gguf_cache_dir, "gguf-v1", "tiny-Q8_0-"))
        assert llm.engine_info.tokenizer == folder
        assert llm.engine_info.served_model_name == gguf_file
        outputs = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                               use_tqdm=False)
    import torch
    import transformers

    original_tokenizer = load_tokenizer(tiny_llama)  # the file's tokenizer is the same BPE
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for text, out in zip(TEXTS, outputs):
        assert out.prompt_token_ids == original_tokenizer.encode(text)
        tokens, gaps = _hf_greedy(model, out.prompt_token_ids)
        tie = next((k for k, g in enumerate(gaps) if g < TIE_GAP), len(tokens))
        assert out.outputs[0].token_ids[:tie] == tokens[:tie], text


@pytest.mark.timeout(180)
def test_tidal_serve_on_a_gguf_file_uses_its_chat_template(gguf_file, gguf_cache_dir):
    server = LiveServer([gguf_file, *ENGINE_FLAGS]).start()
    try:
        with server.client(timeout=60) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [gguf_file]
            messages = [{"role": "user", "content": "Hello world! How are you today?"}]
            resp = client.post("/v1/chat/completions", json={
                "model": gguf_file, "messages": messages, "max_tokens": 4,
                "temperature": 0})
            assert resp.status_code == 200, resp.text
            folder = _converted_folder(gguf_cache_dir)
            tokenizer = load_tokenizer(folder)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            assert text.endswith("<|assistant|>\n")  # the file's template
            expected = tokenizer.encode(text, add_special_tokens=False)
            assert resp.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        assert server.stop() == 0


def _converted_folder(cache_dir: str) -> str:
    root = os.path.join(cache_dir, "gguf-v1")
    (name,) = [n for n in os.listdir(root) if n.startswith("tiny-Q8_0-")]
    return os.path.join(root, name)


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and per-position top-2 logit gaps."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, output_logits=True,
                             return_dict_in_generate=True)
    gaps = [float(v[0] - v[1]) for v in (torch.topk(lg[0], 2).values for lg in gen.logits)]
    return gen.sequences[0, len(prompt):].tolist(), gaps
