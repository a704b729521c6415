"""Mixture-of-experts building blocks: the router's top-k choice (each model family's own
normalisation) and the experts of one layer, stacked and computed grouped by expert.

Routing (`Routing`, `route`), as transformers computes it for each family:

    softmax_topk   softmax over all experts (float32), the top k, renormalised to sum to one
                   where the model says so (Mixtral always; Qwen2/3-MoE and OLMoE by their
                   `norm_topk_prob`)
    topk_softmax   the top k logits (float32), softmax over those k (Granite-MoE)

`weights_float32` keeps the k weights in float32 for the combine (Mixtral) instead of casting
them to the activations' dtype first (the others); with float32 activations the two agree.

Experts (`FusedMoE`), per layer, for E experts of intermediate size I on P tensor-parallel
ranks (rank r):

    w13  [E, 2 * I/P, hidden]   rows [gate rows r*I/P.. | up rows r*I/P..] of every expert
    w2   [E, hidden, I/P]       columns r*I/P.. of every expert's down projection

so each rank computes every expert on its slice of the intermediate dimension and returns a
partial sum; the caller all-reduces once after the combine (and the shared expert, whose
down projection is split the same way). The router is replicated: every rank routes the same
tokens to the same experts. Expert parallelism (whole experts per rank) is not built:
docs/models.md says why.

The forward pass groups the (token, expert) pairs by expert: a stable sort of the T*k
chosen expert ids, one gather of the token rows in that order, then for each expert with
tokens one gate/up GEMM, silu * up and one down GEMM over its contiguous run of rows, and
one `index_add_` of the weighted rows back into their tokens. One host sync per layer (the
counts per expert); no Python loop over tokens. That sync cannot be captured in a CUDA graph:
a capture raises, `workers/cuda_graphs.py` logs it and the runner stays eager (untested: no
GPU was at hand when this was written).

LoRA (`lora`, workers/lora.py `LoRAExperts`): in a step where some token's adapter has
weights on these experts, `_forward_lora` sorts the pairs by expert and then by the token's
adapter slot (one bincount of the combined key: still one host sync), so each (expert,
adapter) pair is a contiguous run, and adds the adapters' products to each expert's gate/up
output (before silu) and to its down output. Other steps take the paths above unchanged.

Checkpoints name the experts one by one (`experts.3.w1.weight`, `experts.3.gate_proj.weight`)
or stacked (transformers 5's `experts.gate_up_proj` [E, 2I, hidden] / `experts.down_proj`
[E, hidden, I], Granite-MoE's `input_linear.weight` / `output_linear.weight`, the same
layout); `w13.weight_loader` takes shard ids `(expert, 0)` gate, `(expert, 1)` up and
`STACKED`; `w2`'s `(expert, None)` and `STACKED`. A stacked tensor fills every expert's
shards at once, and its loader says so (returns them) to the loader's completeness check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu.cpu_gemm import SmallBatchGemm
from ..kernels.cpu.ops import CpuOps
from .distributed import TensorParallel
from .layers import _check_shape, _copy, _take

FEW_TOKENS = 4
"""Steps of at most this many tokens take `FusedMoE._few_tokens` (no grouping): measured by
benchmarks/moe_step.py (docs/performance.md)."""

STACKED = "stacked"
"""Shard id of a checkpoint tensor holding every expert ([E, ...])."""

SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class Routing:
    """How a family's router turns logits into k experts and their weights."""

    top_k: int
    scoring: str = "softmax_topk"
    """`softmax_topk` or `topk_softmax` (module docstring)."""
    renormalize: bool = True
    """softmax_topk: divide the k probabilities by their sum."""
    weights_float32: bool = False
    """Combine with float32 weights (Mixtral) rather than weights cast to the activations'
    dtype (Qwen2/3-MoE, OLMoE, Granite-MoE)."""


def route(logits: torch.Tensor, routing: Routing, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k] int64), in the order
    torch.topk gives (largest first); weights in float32 or `dtype` per `routing`."""
    if routing.scoring == "topk_softmax":
        top, ids = logits.float().topk(routing.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if routing.weights_float32 else top.to(dtype)), ids


class FusedMoE(nn.Module):
    """The experts of one layer, stacked; `forward(x, weights, ids)` -> this rank's partial
    sum of the k weighted expert outputs per token (all-reduce it over the TP group)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.local_size = tp.split(intermediate_size, "moe intermediate size")
        i = self.local_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size),
                                requires_grad=False)
        self.w13.weight_loader = self.load_w13
        self.w13.shard_ids = tuple((e, j) for e in range(num_experts) for j in (0, 1))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.w2.weight_loader = self.load_w2
        self.w2.shard_ids = tuple((e, None) for e in range(num_experts))
        self.gemms: list[tuple[SmallBatchGemm, SmallBatchGemm, SmallBatchGemm]] | None = None
        """Per expert (gate, up, down) GEMMs from the CPU op seam (`use_cpu_ops`)."""

    lora = None
    """The LoRA slots of these experts (`workers/lora.py` LoRAExperts) when the engine serves
    adapters; steps where no token's adapter has expert weights here take the plain path."""

    # -- loading -----------------------------------------------------------------------------

    def load_w13(self, param: nn.Parameter, loaded: Any, shard_id) -> tuple | None:
        """One expert's gate (`(e, 0)`) or up (`(e, 1)`) [I, hidden], or every expert's gate
        and up stacked (`STACKED`, [E, 2I, hidden]): this rank's rows of each."""
        i, big = self.local_size, self.intermediate_size
        start = self.tp.rank * i
        if shard_id == STACKED:
            _check_shape(param, loaded, (self.num_experts, 2 * big, self.hidden_size))
            _copy(param[:, :i], loaded[:, start:start + i])
            _copy(param[:, i:], loaded[:, big + start:big + start + i])
            return self.w13.shard_ids
        expert, half = shard_id
        _check_shape(param, loaded, (big, self.hidden_size))
        _copy(param[expert, half * i:(half + 1) * i], _take(loaded, 0, start, i))
        return None

    def load_w2(self, param: nn.Parameter, loaded: Any, shard_id) -> tuple | None:
        """One expert's down projection (`(e, None)`, [hidden, I]) or every expert's
        (`STACKED`, [E, hidden, I]): this rank's columns."""
        i = self.local_size
        start = self.tp.rank * i
        if shard_id == STACKED:
            _check_shape(param, loaded, (self.num_experts, self.hidden_size,
                                         self.intermediate_size))
            _copy(param, loaded[:, :, start:start + i])
            return self.w2.shard_ids
        expert = shard_id[0]
        _check_shape(param, loaded, (self.hidden_size, self.intermediate_size))
        _copy(param[expert], _take(loaded, 1, start, i))
        return None

    # -- the CPU op seam ---------------------------------------------------------------------

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        """Take the seam's small-batch GEMM for every expert's gate, up and down weight
        (an expert sees few rows a step: the decode regime those GEMMs are for); False where
        the seam has none (torch's ops, not float32) and `F.linear` stays."""
        i = self.local_size
        gemms = [(ops.gemm(self.w13[e, :i]), ops.gemm(self.w13[e, i:]), ops.gemm(self.w2[e]))
                 for e in range(self.num_experts)]
        self.gemms = None if any(None in g for g in gemms) else gemms
        return self.gemms is not None

    # -- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, hidden], weights / ids [T, k] -> [T, hidden] in x's dtype: sum over k of
        weight * expert(x) for this rank's slice of the intermediate dimension."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE layers are not captured in CUDA graphs: the grouped "
                               "experts read each expert's row count on the host")
        num_tokens, top_k = ids.shape
        if self.lora is not None and self.lora.used():
            return self._forward_lora(x, weights, ids)
        if num_tokens <= FEW_TOKENS:
            return self._few_tokens(x, weights, ids)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
        token_of = order // top_k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        rows = x[token_of]
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start:start + n] = self._expert(expert, rows[start:start + n])
                start += n
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1)
        result = torch.zeros_like(x)
        return result.index_add_(0, token_of, weighted.to(x.dtype))

    def _few_tokens(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    expert=None) -> torch.Tensor:
        """The grouped path's result for a decode step of a few tokens, without its sort,
        gather, scatter and per-expert loop: each token's k experts on its one row, each
        weighted term cast to the activations' dtype and summed by expert id from zero in
        float32, as the CPU's index_add_ does, so one token's result is the grouped path's
        bit for bit on the CPU (its k experts are distinct: each sees one row there too;
        tests/workers/test_moe_models.py). On CUDA, whose index_add_ adds in the activations'
        dtype, the sum here is the more exact one. Same one host sync (the ids). `expert(e,
        row, t)`: expert e on token t's row (default `_expert`; the LoRA path's adds the
        token's adapter)."""
        rows = []
        for t, token_ids in enumerate(ids.tolist()):
            xt = x[t:t + 1]
            acc = torch.zeros_like(xt, dtype=torch.float32)  # index_add_'s CPU accumulator
            for j in sorted(range(len(token_ids)), key=token_ids.__getitem__):
                out = self._expert(token_ids[j], xt) if expert is None else \
                    expert(token_ids[j], xt, t)
                acc += (out * weights[t:t + 1, j:j + 1]).to(x.dtype)
            rows.append(acc.to(x.dtype))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _forward_lora(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                      ) -> torch.Tensor:
        """`forward` in a step where some token's adapter has weights on these experts: the
        (token, expert) pairs sorted by expert and, within an expert, by the token's slot
        (base rows first), so each (expert, slot) pair present is one contiguous run and one
        adapter product (`LoRAExperts`); still one host sync (the counts per (expert, slot)).
        A token's k terms are summed in expert order, as in the plain path."""
        lora, step = self.lora, self.lora.step
        num_tokens, top_k = ids.shape
        width = lora.max_loras + 1  # runs per expert: the base rows, then each slot's
        if num_tokens <= FEW_TOKENS:  # the few-token path, each token its own run
            def expert(e: int, xt: torch.Tensor, t: int) -> torch.Tensor:
                runs = [0] * width
                runs[step.host_slots[t] + 1] = 1
                return self._expert_lora(e, xt, runs, None)

            return self._few_tokens(x, weights, ids, expert)
        key = ids.reshape(-1) * width + (step.slots + 1).repeat_interleave(top_k)
        order = torch.argsort(key, stable=True)
        token_of = order // top_k
        counts = torch.bincount(key, minlength=self.num_experts * width).tolist()
        mask = lora.row_mask(key[order] % width - 1, x.dtype)  # each sorted row's slot
        rows = x[token_of]
        out = torch.empty_like(rows)
        start = 0
        for expert in range(self.num_experts):
            runs = counts[expert * width:(expert + 1) * width]
            n = sum(runs)
            if n:
                out[start:start + n] = self._expert_lora(expert, rows[start:start + n], runs,
                                                         mask[start:start + n])
                start += n
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1)
        result = torch.zeros_like(x)
        return result.index_add_(0, token_of, weighted.to(x.dtype))

    def _expert_lora(self, e: int, x: torch.Tensor, runs: list[int],
                     mask: torch.Tensor | None) -> torch.Tensor:
        """`_expert` plus the adapters' products on gate/up (before silu) and down; x's rows:
        runs[0] base rows, then runs[s + 1] rows of slot s; mask: their slots
        (`LoRAExperts.row_mask`; None: a single run)."""
        lora = self.lora
        if self.gemms is not None:
            gate, up, down = self.gemms[e]
            h = torch.cat((gate(x), up(x)), dim=-1)
        else:
            h = F.linear(x, self.w13[e])
        lora.add13(e, x, h, runs, mask)
        gate_out, up_out = h.chunk(2, dim=-1)
        act = F.silu(gate_out) * up_out
        y = down(act) if self.gemms is not None else F.linear(act, self.w2[e])
        lora.add2(e, act, y, runs, mask)
        return y

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) of expert e, on this rank's slice."""
        if self.gemms is not None:
            gate, up, down = self.gemms[e]
            return down(up.mul(x, F.silu(gate(x), inplace=True)))
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[e])

