"""LoRA on Phi-3's fused projections (docs/lora.md): PEFT adapts the modules the checkpoint
has, `qkv_proj` (one A, B's rows q | k | v) and `gate_up_proj` (B's rows gate | up), and tidal
gives each sub-projection A and its rows of B (`workers/lora.py` put_fused), so tensor
parallelism cuts the adapter as it cuts the base weight. Two adapters (every projection at
rank 8; qkv_proj alone at rank 4) and the base model in one batch on the tiny Phi-3, TP=2, a
KV pool small enough to preempt, 2 slots for 2 adapters: every request's greedy tokens equal
transformers + PEFT with its adapter applied (prompts inside the tiny Phi-3's original 40
positions: docs/models.md "LongRoPE")."""

from __future__ import annotations

import pytest

from tidal.ipc.messages import LoRARequest, SamplingParams
from test_lora import MAX_TOKENS, PROMPTS, make_adapter, peft_greedy

pytest.importorskip("peft")

EOS = 0  # the tiny models' <|endoftext|>
ADAPTERS = {  # name -> (rank, target modules, lora_alpha, seed)
    "fused8": (8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 16, 4),
    "qkv4": (4, ["qkv_proj"], 8, 5),
}


@pytest.mark.timeout(300)
def test_phi3_fused_adapters_mixed_with_the_base_model_tp2_preempted(tiny_model_factory,
                                                                      tmp_path):
    from tidal.frontend import LLM

    base = tiny_model_factory("phi3")
    adapters = {name: make_adapter(base, str(tmp_path / name), *spec)
                for name, spec in ADAPTERS.items()}
    names = [None, *adapters]
    jobs = [(name, i) for name in names for i in range(len(PROMPTS))]
    expected = {job: peft_greedy(base, adapters[job[0]] if job[0] else None, PROMPTS[job[1]])
                for job in jobs}
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in
             enumerate(adapters.items())}
    # 8 blocks (7 usable) for 9 requests of 1-3 blocks: preemption
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
             tensor_parallel_size=2, num_gpu_blocks_override=8, max_model_len=48,
             startup_timeout=120) as llm:
        outs = llm.generate([PROMPTS[i] for _, i in jobs],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True),
                            use_tqdm=False,
                            lora_request=[loras[name] if name else None for name, _ in jobs])
        assert llm.get_stats().num_preemptions > 0
    for job, out in zip(jobs, outs):  # transformers stops at EOS, tidal ignores it
        ref = expected[job]
        assert len(ref) == MAX_TOKENS or ref[-1] == EOS, job
        assert list(out.outputs[0].token_ids)[:len(ref)] == ref, job
    assert expected[(None, 0)] != expected[("fused8", 0)] != expected[("qkv4", 0)]
