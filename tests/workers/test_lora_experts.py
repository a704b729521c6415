"""LoRA on MoE experts in one process (workers/lora.py `LoRAExperts`, workers/moe.py
`FusedMoE._forward_lora`), against PEFT's own definition of the delta (peft/tuners/lora/
layer.py `ParamWrapper.get_delta_weight`: lora_A [r * E, in] as [E, r, in], lora_B
[out, r * E] as [out, r, E], W[e] + scaling * B_e A_e): a batch mixing two adapters (one on
both stacks, one on down_proj alone) and the base model, on the grouped path (masked and per
adapter) and on the few-token path, whole and cut over two tensor-parallel ranks (their
partial sums added). The process tree and transformers + PEFT's tokens:
tests/e2e/test_lora_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.workers.distributed import TensorParallel
from tidal.workers.lora import LoRAExperts, LoRAStep
from tidal.workers.moe import STACKED, FusedMoE

E, H, I, K, R = 4, 16, 8, 2, 4  # experts, hidden, intermediate, top-k, max_lora_rank


def _peft_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's delta of a 3-D parameter [E, out, in] (its einsum, transcribed)."""
    return torch.einsum("o r e, e r i -> e o i", b.reshape(b.shape[0], -1, E),
                        a.reshape(E, -1, a.shape[-1])) * scaling


def _factors(gen, r: int, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(r * E, inp, generator=gen) * 0.3,
            torch.randn(out, r * E, generator=gen) * 0.3)


# grouped with both adapters' rows of an expert masked together (10 tokens) or in a product
# per adapter (300: above DENSE_MAX_TOKENS adapter rows an expert); the few-token path (3)
@pytest.mark.parametrize("num_tokens", [10, 300, 3])
def test_experts_lora_equals_peft_merged_weights_mixed_slots_tp1_and_tp2(num_tokens):
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    both = dict(gate_up=_factors(gen, 2, 2 * I, H), down=_factors(gen, 2, H, I))  # slot 0
    down_only = _factors(gen, 4, H, I)  # slot 1, rank 4 = R
    scale0, scale1 = 8 / 2, 8 / 4 ** 0.5  # lora_alpha / r; rslora's / sqrt(r)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, K, generator=gen), -1)
    slots = [(-1, 0, 1)[t % 3] for t in range(num_tokens)]  # base, slot 0, slot 1, ...

    merged = {  # slot -> each token's experts' weights with its adapter merged, as PEFT does
        -1: (w13, w2),
        0: (w13 + _peft_delta(*both["gate_up"], scale0), w2 + _peft_delta(*both["down"], scale0)),
        1: (w13, w2 + _peft_delta(*down_only, scale1))}
    expected = torch.zeros_like(x)
    for t in range(num_tokens):
        g13, g2 = merged[slots[t]]
        for j in range(K):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], g13[e]).chunk(2)
            expected[t] += weights[t, j] * F.linear(F.silu(gate) * up, g2[e])

    step = LoRAStep(active=True, slots=torch.tensor(slots), host_slots=slots,
                    present=frozenset({0, 1}))
    for size in (1, 2):
        total = torch.zeros_like(x)
        for rank in range(size):
            moe = FusedMoE(E, H, I, TensorParallel(rank=rank, size=size))
            moe.load_w13(moe.w13, w13, STACKED)
            moe.load_w2(moe.w2, w2, STACKED)
            moe.lora = LoRAExperts(moe, step, 2, R, torch.float32, torch.device("cpu"))
            for a, b in both.values():  # PEFT's nested wrappers: told apart by shape
                moe.lora.put(0, a, b, lambda r: 8 / r)
            moe.lora.put(1, *down_only, lambda r: 8 / r ** 0.5)
            total += moe(x, weights, ids)  # this rank's partial sum (all-reduced in a model)
        torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-4, msg=f"TP={size}")


def test_experts_lora_of_another_models_shapes_or_rank_is_refused():
    moe = FusedMoE(E, H, I, TensorParallel())
    lora = LoRAExperts(moe, LoRAStep(), 1, R, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"fit neither gate_up_proj \[4, 16, 16\] nor "
                                         r"down_proj \[4, 16, 8\]"):
        lora.put(0, torch.zeros(2 * E, H + 1), torch.zeros(2 * I, 2 * E), lambda r: 1.0)
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        lora.put(0, torch.zeros(8 * E, H), torch.zeros(2 * I, 8 * E), lambda r: 1.0)
    with pytest.raises(ValueError, match="are not 4 experts' stacked factors"):
        lora.put(0, torch.zeros(7, H), torch.zeros(2 * I, 7), lambda r: 1.0)
    assert not lora.loaded
