"""A LoRA adapter trained with PEFT on the real SmolLM2-135M-Instruct changes what the model
says, and tidal says the same as transformers + PEFT.

The fixture trains a rank-8 adapter (q, v, o, down) for a few steps on one sentence, from the
folder tidal converted the tests' GGUF file into (float32), and caches it in the real-model
cache keyed by the training settings, so later runs only load it. Marked `real_model`."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from real_models import real_model_cache, smollm2_gguf
from tidal.ipc.messages import LoRARequest, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
pytest.importorskip("peft")

PROMPT = "The secret word is"
TARGET = " tidal, and the tide is always rising."
TRAIN = dict(rank=8, alpha=16, steps=12, lr=3e-3, seed=0,
             targets=["q_proj", "v_proj", "o_proj", "down_proj"])
MAX_TOKENS = 12


def _folder() -> str:
    """The converted folder the other real-model tests use: in the real-model cache, whatever
    $TIDAL_CACHE_DIR a session fixture set (a temporary one converted the file again, 35 s)."""
    from tidal.engine_core.model_files import model_folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", real_model_cache())
        return model_folder(smollm2_gguf())


def train_adapter(base: str, path: str) -> str:
    """A few Adam steps of PEFT LoRA on PROMPT + TARGET (seconds on a CPU)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(TRAIN["seed"])
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=TRAIN["rank"], lora_alpha=TRAIN["alpha"],
                                            target_modules=TRAIN["targets"],
                                            lora_dropout=0.0))
    ids = torch.tensor([tok(PROMPT + TARGET)["input_ids"]])
    optim = torch.optim.Adam([p for p in peft.parameters() if p.requires_grad], lr=TRAIN["lr"])
    peft.train()
    for _ in range(TRAIN["steps"]):
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    peft.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base() -> str:
    return _folder()


@pytest.fixture(scope="module")
def adapter(base) -> str:
    key = hashlib.sha256(json.dumps([TRAIN, PROMPT, TARGET, os.path.basename(base)])
                         .encode()).hexdigest()[:12]
    path = os.path.join(real_model_cache(), f"lora-smollm2-{key}")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        train_adapter(base, path + ".partial")
        os.replace(path + ".partial", path)
    return path


def _hf_greedy(base: str, adapter: str | None, prompt_ids: list[int]) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS,
                         do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_a_trained_adapter_changes_the_answer_and_tidal_says_the_same(base, adapter):
    from transformers import AutoTokenizer

    from tidal.frontend import LLM

    prompt_ids = AutoTokenizer.from_pretrained(base)(PROMPT)["input_ids"]
    want_base = _hf_greedy(base, None, prompt_ids)
    want_lora = _hf_greedy(base, adapter, prompt_ids)
    assert want_lora != want_base  # training changed what the model says
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(base, enable_lora=True, max_lora_rank=8, dtype="float32",
             kv_cache_memory="64MiB", max_model_len=256) as llm:
        outs = llm.generate([prompt_ids, prompt_ids], params, use_tqdm=False,
                            lora_request=[None, LoRARequest("secret", 1, adapter)])
        text = outs[1].outputs[0].text
    assert list(outs[0].outputs[0].token_ids) == want_base
    assert list(outs[1].outputs[0].token_ids) == want_lora
    assert "tidal" in text, text
