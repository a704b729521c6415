"""LoRA on mixture-of-experts layers (docs/lora.md): PEFT 0.21 puts it on transformers 5's
stacked experts with `target_parameters` (`experts.gate_up_proj` [E, 2I, hidden],
`experts.down_proj` [E, hidden, I]: one lora_A [r * E, in] and lora_B [out, r * E] each), and
`target_modules` reach Qwen2-MoE's shared expert and its dense layers' MLP. Two adapters (rank
8 on attention, shared expert, dense MLP and both expert stacks; rank 4 with rslora on q_proj
and the experts' down_proj alone) and the base model in one batch on the tiny Qwen2-MoE (8
experts top-2, a gated shared expert, one dense layer), TP=2 (every expert's LoRA B of
gate_up and A of down split as the weights are), 2 slots: every request's greedy tokens equal
transformers + PEFT with its adapter applied. A lone request then takes the experts'
few-token decode path with its adapter."""

from __future__ import annotations

import pytest

from tidal.ipc.messages import LoRARequest, SamplingParams
from test_lora import MAX_TOKENS, PROMPTS

pytest.importorskip("peft")

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "moe8": dict(r=8, lora_alpha=16, target_modules=ALL, target_parameters=EXPERTS),
    "down4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj"],
                  target_parameters=["experts.down_proj"]),
}


def _load(base: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                experts_implementation="eager").eval()


def make_moe_adapter(base: str, path: str, seed: int, **config) -> str:
    """A PEFT adapter with random A and B everywhere it targets (init_lora_weights=False)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(_load(base), LoraConfig(lora_dropout=0.0, init_lora_weights=False,
                                                  **config))
    peft.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from peft import PeftModel

    model = _load(base)
    if adapter is not None:  # merged: W + scaling * B A per expert, as PEFT's forward adds
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()  # (faster)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS)
            out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.mark.timeout(300)
def test_qwen2_moe_adapters_on_experts_mixed_with_the_base_model_tp2(tiny_model_factory,
                                                                      tmp_path):
    from tidal.frontend import LLM

    base = tiny_model_factory("qwen2_moe")
    adapters = {name: make_moe_adapter(base, str(tmp_path / name), seed, **config)
                for seed, (name, config) in enumerate(ADAPTERS.items(), start=7)}
    names = [None, *adapters]
    expected = {name: peft_greedy(base, adapters.get(name), PROMPTS) for name in names}
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in
             enumerate(adapters.items())}
    jobs = [(name, i) for name in names for i in range(len(PROMPTS))]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
             tensor_parallel_size=2, max_model_len=64, startup_timeout=120) as llm:
        outs = llm.generate([PROMPTS[i] for _, i in jobs], greedy, use_tqdm=False,
                            lora_request=[loras[name] if name else None for name, _ in jobs])
        alone = llm.generate([PROMPTS[2]], greedy, use_tqdm=False,
                             lora_request=loras["moe8"])
    for (name, i), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == expected[name][i], (name, i)
    assert list(alone[0].outputs[0].token_ids) == expected["moe8"][2]
    assert expected[None][0] != expected["moe8"][0] != expected["down4"][0]
