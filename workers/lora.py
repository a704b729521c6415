"""LoRA on the worker: slots of stacked adapter weights per projection and the batched
(segmented) product that adds each request's adapter to the base layers' output.

Layout, per LoRA-capable projection of this rank (qkv_proj, o_proj, gate_up_proj,
down_proj) and `max_loras` slots, punica style:

    A  [max_loras, n_sub * R, in_local]     the sub-projections' A stacked along the rank
    B  [out_local, max_loras * n_sub * R]   slot s in columns s*n_sub*R ..; block-diagonal
                                            within it: sub-projection i's rows of the local
                                            output take its columns i*R .. (i+1)*R
    R = max_lora_rank; an adapter of a smaller rank is zero-padded, B holds scaling · B.

so one adapter on a packed projection (q, k, v in qkv_proj; gate, up in gate_up_proj) is two
matmuls. A slot that an adapter does not target for a module stays zero there.

Tensor parallelism shards the adapter as the base layer is sharded: a column-parallel
projection keeps A whole and takes its rank's rows of B (the same heads / rows as the base
weight, replicated KV heads included); a row-parallel one takes its rank's columns of A and
B whole, and its partial product joins the base's partial sums before the all-reduce (x A^T
summed over ranks is the whole x A^T, and B is linear).

One step (`LoRAStep`, shared by every projection): each token's slot (-1: the base model),
grouped by slot once per step: for each adapter in the batch (at most max_loras) the rows of
its tokens, a slice when they are contiguous (requests sit in the batch one after another),
else an index tensor. Two ways to the product, never a loop over tokens:

- grouped (steps of more than DENSE_MAX_TOKENS tokens, prefill): per group,
  y[rows] += (x[rows] A_s^T) B_s^T, so each token pays for its own adapter only;
- masked (smaller steps, decode): every slot at once, y += ((x A^T) * M) B^T with A and B
  over all slots and M [tokens, slots * n_sub * R] the 0/1 mask of each token's slot (built
  once per step per width): two matmuls and a multiply whatever the number of adapters, where
  a per-group loop paid a dozen small kernel launches per projection (measured on the CPU: a
  4-adapter decode step of 16 tokens took as long in the loop as in the base GEMM). A step with no adapter costs one attribute test
per projection (`active` is False), and keeps the CUDA graphs and the CPU's one-call decoder
layers; a step with one takes the per-module path, eagerly.

MoE layers: Qwen2-MoE's shared expert is an MLP of these projections (`shared_expert.*`);
the routed experts' stacked weights have their own slots (`LoRAExperts`: PEFT's
`target_parameters` layout, TP-cut as the experts are), which `workers/moe.py` adds per run
of an expert's rows that share an adapter.

Adapters come from PEFT folders the worker reads itself (`ipc/lora.py` checks the config),
kept in host memory in an LRU of max_cpu_loras (full tensors, this rank's shards cut when
one goes into a slot).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..ipc.lora import WEIGHTS_FILE, read_adapter_config
from ..ipc.messages import LoRARequest
from ..ipc.worker_messages import LoRASlot

logger = logging.getLogger(__name__)

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)"
                  r"\.lora_([AB])\.weight$")
"""A PEFT tensor name: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, or
on Qwen2-MoE's shared expert ...layers.{i}.mlp.shared_expert.gate_proj.lora_A.weight."""

_EXPERTS_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts"
                          r"((?:\.base_layer)*)\.lora_([AB])\.weight$")
"""PEFT's LoRA on an MoE layer's stacked experts (`target_parameters` experts.gate_up_proj /
experts.down_proj: a `ParamWrapper` per parameter, nested when both are targeted, so the
names say `experts.lora_A` / `experts.base_layer.lora_A`, not which parameter: the shapes do,
`LoRAExperts.put`)."""

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
          "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}
"""PEFT's module name -> (this model's projection, its index among the packed ones; None: the
whole fused projection, as PEFT adapts Phi-3's qkv_proj and gate_up_proj: one A for all of
it, B's rows q | k | v (gate | up). `LoRAProjection.put_fused` gives each sub-projection A
and its rows of B, so the product is the same and tensor parallelism cuts B as it cuts the
separate ones)."""


_MOE_PARTS = ("experts", "shared_expert", "shared_expert_gate", "router", "gate")
"""Module names inside an MoE block, which a refused adapter tensor is named by."""

DENSE_MAX_TOKENS = 64
"""Steps of at most this many tokens take the masked product (see the module docstring)."""


@dataclass
class LoRAStep:
    """One step's tokens by adapter slot, shared by every LoRA projection."""

    active: bool = False
    """Some token of this step uses an adapter."""
    groups: list = field(default_factory=list)
    """(slot, rows): rows a slice or an int64 index tensor of the step's tokens."""
    token_slots: torch.Tensor | None = None
    """[tokens] each token's slot (-1: none), on the device, for a masked step; else None."""
    masks: dict = field(default_factory=dict)
    """width per slot -> the step's mask [tokens, max_loras * width] (made on first use)."""
    slots: torch.Tensor | None = None
    """[tokens] each token's slot (-1: none), on the device, in every active step: the MoE
    experts group their (token, expert) pairs by it (`workers/moe.py`)."""
    host_slots: list[int] = field(default_factory=list)
    """The same on the host (the MoE few-token path's per-token loop reads it)."""
    present: frozenset = frozenset()
    """The slots some token of the step uses."""

    def mask(self, width: int, max_loras: int, dtype: torch.dtype) -> torch.Tensor:
        m = self.masks.get(width)
        if m is None:
            slots = self.token_slots
            cols = torch.arange(max_loras * width, device=slots.device) // width
            m = self.masks[width] = (cols[None, :] == slots[:, None]).to(dtype)
        return m


@dataclass
class Adapter:
    """An adapter read from its folder, in host memory: per (layer, PEFT module) the full
    A [r, in] and scaling · B [out, r] in float32 (module: `q_proj`, ...,
    `shared_expert.gate_proj`); per (layer, PEFT wrapper) the experts' stacked A
    [r * E, in] and B [out, r * E] unscaled (the rank is r * E / E: the model knows E)."""

    lora: LoRARequest
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)
    scaling: object = None
    """rank -> the factor on B·A (`AdapterConfig.scaling`), for the experts' B at `put`."""


def read_adapter(lora: LoRARequest, max_lora_rank: int) -> Adapter:
    """Read a PEFT folder (ValueError naming lora_path when tidal cannot run it)."""
    from safetensors import safe_open

    config = read_adapter_config(lora.lora_path, max_lora_rank)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    stacked: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(f"{lora.lora_path}/{WEIGHTS_FILE}", framework="pt") as f:
        for name in f.keys():
            e = _EXPERTS_KEY.search(name)
            if e is not None:
                stacked.setdefault((int(e.group(1)), "experts" + e.group(2)), {})[
                    e.group(3)] = f.get_tensor(name).to(torch.float32)
                continue
            m = _KEY.search(name)
            if m is None or m.group(2).removeprefix("shared_expert.") not in PACKED:
                moe = next((p for p in _MOE_PARTS if p in name.split(".")), None)
                what = f" (LoRA on an MoE block's {moe} is not supported)" if moe else ""
                raise ValueError(f"lora_path {lora.lora_path!r}: tensor {name} is not on a "
                                 f"supported projection ({', '.join(PACKED)}){what}")
            halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = \
                f.get_tensor(name).to(torch.float32)
    for key, pair in [*halves.items(), *stacked.items()]:
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_path {lora.lora_path!r}: layer {key[0]} {key[1]} lacks "
                             f"lora_{'B' if 'A' in pair else 'A'}")
    weights = {}
    for key, pair in halves.items():
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if rank > max_lora_rank or b.shape[1] != rank:
            raise ValueError(f"lora_path {lora.lora_path!r}: layer {key[0]} {key[1]} has rank "
                             f"{rank} (B {list(b.shape)}), above --max-lora-rank "
                             f"{max_lora_rank} or inconsistent")
        weights[key] = (a, b * config.scaling(rank))
    experts = {key: (pair["A"], pair["B"]) for key, pair in stacked.items()}
    return Adapter(lora, weights, experts, config.scaling)


class LoRAProjection:
    """The slots of one projection of this rank, and its share of the product."""

    def __init__(self, layer: nn.Module, kind: str, step: LoRAStep, max_loras: int,
                 rank: int, dtype: torch.dtype, device: torch.device):
        self.layer, self.kind, self.step, self.rank = layer, kind, step, rank
        self.row_parallel = kind in ("o_proj", "down_proj")
        self.num_sub = {"qkv_proj": 3, "gate_up_proj": 2}.get(kind, 1)
        w = layer.weight
        out_local, in_local = w.shape[0], w.shape[1]
        self.A = torch.zeros(max_loras, self.num_sub * rank, in_local, dtype=dtype,
                             device=device)
        self.width = self.num_sub * rank  # columns of B per slot
        self.max_loras = max_loras
        self.B = torch.zeros(out_local, max_loras * self.width, dtype=dtype, device=device)

    def _b(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s B [out_local, n_sub * R] (a view)."""
        return self.B[:, slot * self.width:(slot + 1) * self.width]

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self._b(slot).zero_()

    def put(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection `sub` of an adapter (full A [r, in], scaled B [out, r]) into
        `slot`, cut to this rank's shard."""
        layer, r, R = self.layer, a.shape[0], self.rank
        tp_rank, tp_size = layer.tp.rank, layer.tp.size
        if self.row_parallel:
            cols = a.shape[1] // tp_size
            a = a[:, tp_rank * cols:(tp_rank + 1) * cols]
            rows, offset = slice(None), 0
        else:
            b, offset = self._rows_of(sub, b, tp_rank, tp_size)
            rows = slice(offset, offset + b.shape[0])
        self.A[slot, sub * R:sub * R + r].copy_(a)
        self._b(slot)[rows, sub * R:sub * R + r].copy_(b)

    def put_fused(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """An adapter on the whole fused projection (Phi-3's qkv_proj: B [q + 2 kv rows, r];
        gate_up_proj: B [2 I, r]): every sub-projection takes A and its own rows of B."""
        layer = self.layer
        if self.kind == "qkv_proj":
            d = layer.head_dim
            sizes = [layer.total_num_heads * d] + [layer.total_num_kv_heads * d] * 2
        else:
            sizes = [b.shape[0] // self.num_sub] * self.num_sub
        if sum(sizes) != b.shape[0]:
            raise ValueError(f"LoRA B of {self.kind} has {b.shape[0]} rows, the projection "
                             f"{sum(sizes)}")
        for sub, rows in enumerate(b.split(sizes)):
            self.put(slot, sub, a, rows)

    def _rows_of(self, sub: int, b: torch.Tensor, tp_rank: int,
                 tp_size: int) -> tuple[torch.Tensor, int]:
        """This rank's rows of sub-projection `sub`'s B and where they sit in the local
        output (the base layer's loader's rule)."""
        layer = self.layer
        if self.kind == "qkv_proj":
            d = layer.head_dim
            if sub == 0:
                n = layer.num_heads
                return b[tp_rank * n * d:(tp_rank + 1) * n * d], 0
            n, start = layer.num_kv_heads, layer.kv_head_start
            offset = layer.num_heads + (0 if sub == 1 else n)
            return b[start * d:(start + n) * d], offset * d
        rows = b.shape[0] // tp_size
        return b[tp_rank * rows:(tp_rank + 1) * rows], sub * rows

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each token's adapter product (y [tokens, out_local], written in place)."""
        step = self.step
        if step.token_slots is not None:  # masked: every slot in two matmuls
            xa = x @ self.A.view(-1, self.A.shape[-1]).t()
            xa *= step.mask(self.width, self.max_loras, xa.dtype)
            return y.addmm_(xa, self.B.t())
        for slot, rows in step.groups:
            xs = x[rows]
            delta = (xs @ self.A[slot].t()) @ self._b(slot).t()
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y


class LoRAExperts:
    """The slots of one MoE layer's stacked experts (`FusedMoE`) on this rank, as PEFT's
    `target_parameters` adapts them (peft/tuners/lora/layer.py `ParamWrapper`): per stacked
    parameter W [E, out, in] one lora_A [r * E, in] (expert e's rows e*r ..) and one lora_B
    [out, r * E] (expert e's columns e, E + e, 2E + e, ..: PEFT reshapes B to [out, r, E]),
    delta W[e] = scaling · B_e A_e, scaling lora_alpha / r (rslora: / sqrt(r)). Layout here,
    expert-major so that an expert's slots are one matrix, R = max_lora_rank, S = max_loras,
    B scaled and zero-padded past the adapter's rank:

        A13 [E, S, R, hidden]   gate_up_proj's A_e per slot, whole (column-parallel)
        B13 [E, 2 I/P, S, R]    its B_e's rows of this rank: gate rows r*I/P.. | up rows
                                I + r*I/P.. (w13's local layout)
        A2  [E, S, R, I/P]      down_proj's A_e, this rank's columns (row-parallel)
        B2  [E, hidden, S, R]   its B_e, whole: the partial products join the experts'
                                partial sums before the all-reduce

    `FusedMoE` adds the adapters' products to an expert's gate/up product (before silu) and to
    its down product (`add13`, `add2`), its rows sorted by slot: (x[run] A_s^T) B_s^T per run
    of one adapter's rows, except where several adapters share an expert's at most
    DENSE_MAX_TOKENS adapter rows (decode): every slot at once, ((x A_e^T) * M) B_e^T with M
    each row's slot as a 0/1 mask, as the masked projections do: two matmuls whatever the
    number of adapters, where the per-run products paid 2 small matmuls per adapter
    (measured: docs/lora.md)."""

    def __init__(self, experts: nn.Module, step: LoRAStep, max_loras: int, rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.experts, self.step, self.rank, self.max_loras = experts, step, rank, max_loras
        e, h, i = experts.num_experts, experts.hidden_size, experts.local_size
        zeros = dict(dtype=dtype, device=device)
        self.A13 = torch.zeros(e, max_loras, rank, h, **zeros)
        self.B13 = torch.zeros(e, 2 * i, max_loras, rank, **zeros)
        self.A2 = torch.zeros(e, max_loras, rank, i, **zeros)
        self.B2 = torch.zeros(e, h, max_loras, rank, **zeros)
        self.loaded: set[int] = set()
        """Slots whose adapter has expert weights in this layer."""

    def clear(self, slot: int) -> None:
        for a, b in ((self.A13, self.B13), (self.A2, self.B2)):
            a[:, slot].zero_()
            b[:, :, slot].zero_()
        self.loaded.discard(slot)

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling) -> None:
        """One PEFT `ParamWrapper`'s lora_A [r * E, in] and lora_B [out, r * E] (unscaled)
        into `slot`, cut to this rank's shard; which stacked parameter it adapts is read from
        the shapes (gate_up_proj: in = hidden, out = 2 I; down_proj: in = I, out = hidden)."""
        ex = self.experts
        num, h, big, i = ex.num_experts, ex.hidden_size, ex.intermediate_size, ex.local_size
        if a.shape[0] % num or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA on the experts: A {list(a.shape)} and B {list(b.shape)} "
                             f"are not {num} experts' stacked factors")
        r = a.shape[0] // num
        if r > self.rank:
            raise ValueError(f"LoRA on the experts has rank {r}, above --max-lora-rank "
                             f"{self.rank}")
        a_e = a.view(num, r, a.shape[1])  # [E, r, in]
        b_e = (b * scaling(r)).view(b.shape[0], r, num).permute(2, 0, 1)  # [E, out, r]
        start = ex.tp.rank * i
        if (a.shape[1], b.shape[0]) == (h, 2 * big):  # gate_up_proj
            rows = torch.cat((b_e[:, start:start + i], b_e[:, big + start:big + start + i]), 1)
            self.A13[:, slot, :r].copy_(a_e)
            self.B13[:, :, slot, :r].copy_(rows)
        elif (a.shape[1], b.shape[0]) == (big, h):  # down_proj
            self.A2[:, slot, :r].copy_(a_e[:, :, start:start + i])
            self.B2[:, :, slot, :r].copy_(b_e)
        else:
            raise ValueError(f"LoRA on the experts: A {list(a.shape)} and B {list(b.shape)} "
                             f"fit neither gate_up_proj [{num}, {2 * big}, {h}] nor down_proj "
                             f"[{num}, {h}, {big}]")
        self.loaded.add(slot)

    def used(self) -> bool:
        """Some token of this step has an adapter with expert weights in this layer."""
        return self.step.active and not self.loaded.isdisjoint(self.step.present)

    def row_mask(self, row_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, S * R] the 0/1 mask of each row's slot (-1: none) over the slots' ranks."""
        cols = torch.arange(self.max_loras * self.rank, device=row_slots.device) // self.rank
        return (cols[None, :] == row_slots[:, None]).to(dtype)

    def add13(self, expert: int, x: torch.Tensor, y: torch.Tensor, runs: list[int],
              mask: torch.Tensor | None) -> None:
        """y [rows, 2 I/P] += the adapters' products of x [rows, hidden]: runs[0] base rows,
        then runs[s + 1] rows of slot s; mask: the rows' `row_mask` (None: one run)."""
        self._add(self.A13, self.B13, expert, x, y, runs, mask)

    def add2(self, expert: int, x: torch.Tensor, y: torch.Tensor, runs: list[int],
             mask: torch.Tensor | None) -> None:
        """y [rows, hidden] += the adapters' products of x [rows, I/P] (a partial sum)."""
        self._add(self.A2, self.B2, expert, x, y, runs, mask)

    def _add(self, A: torch.Tensor, B: torch.Tensor, expert: int, x: torch.Tensor,
             y: torch.Tensor, runs: list[int], mask: torch.Tensor | None) -> None:
        used, start = [], runs[0]
        for slot, n in enumerate(runs[1:]):
            if n and slot in self.loaded:
                used.append((slot, start, n))
            start += n
        if not used:
            return
        adapter_rows = used[-1][1] + used[-1][2] - used[0][1]
        if len(used) == 1 or mask is None or adapter_rows > DENSE_MAX_TOKENS:
            for slot, start, n in used:  # one adapter, or rows enough to fill each product
                rows = slice(start, start + n)
                y[rows] += (x[rows] @ A[expert, slot].t()) @ B[expert, :, slot].t()
            return
        rows = slice(used[0][1], used[-1][1] + used[-1][2])  # every adapter row, base excluded
        xa = x[rows] @ A[expert].view(-1, A.shape[-1]).t()  # [rows, S * R]
        xa *= mask[rows]
        y[rows] += xa @ B[expert].view(B.shape[1], -1).t()


class LoRAModel:
    """Every LoRA projection of this rank's model, its slots and the host-memory LRU."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.step = LoRAStep()
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        """(layer, projection) -> its slots; projection `qkv_proj`, .., `down_proj`, or
        `shared_expert.gate_up_proj` / `shared_expert.down_proj` (Qwen2-MoE)."""
        self.experts: dict[int, LoRAExperts] = {}
        """layer -> its MoE experts' slots."""
        for name, module in model.named_modules():
            e = re.search(r"layers\.(\d+)\.\w+\.experts$", name)
            if e is not None and hasattr(module, "w13"):  # workers/moe.py FusedMoE
                module.lora = self.experts[int(e.group(1))] = LoRAExperts(
                    module, self.step, max_loras, max_lora_rank, dtype, device)
                continue
            m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)$",
                          name)
            if m is None or m.group(2).removeprefix("shared_expert.") not in (
                    "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                continue
            kind = m.group(2).removeprefix("shared_expert.")
            proj = LoRAProjection(module, kind, self.step, max_loras, max_lora_rank,
                                  dtype, device)
            module.lora = proj
            self.projections[(int(m.group(1)), m.group(2))] = proj
        for module in model.modules():  # the decoder: no one-call C layers in LoRA steps
            if hasattr(type(module), "lora_step"):
                module.lora_step = self.step
        self.slot_of: dict[int, int] = {}
        """lora_int_id -> slot, as the engine core's plans set them."""
        self.cpu: OrderedDict[tuple[int, str], Adapter] = OrderedDict()
        """(lora_int_id, path) -> the adapter read, least recently used first."""
        self.failed: dict[int, str] = {}
        """lora_int_id -> why its folder could not be read into a slot (its requests fail
        alone, `check`: the frontend checked the config, but the weights can still be bad)."""

    def load(self, loads: list[LoRASlot]) -> None:
        """Put adapters into slots (a plan's `lora_slots`, before the step runs)."""
        for load in loads:
            slot = load.slot
            for lora_id, s in list(self.slot_of.items()):
                if s == slot:
                    del self.slot_of[lora_id]
            self._clear(slot)
            try:
                adapter = self._read(load.lora)
            except (ValueError, OSError) as e:  # the slot stays empty, its requests fail
                self.failed[load.lora.lora_int_id] = str(e)
                logger.warning("LoRA adapter %r (id %d) not loaded: %s", load.lora.lora_name,
                               load.lora.lora_int_id, e)
                continue
            try:
                self._put(slot, adapter)
            except (ValueError, RuntimeError) as e:  # shapes not this model's: as above
                self._clear(slot)
                self.failed[load.lora.lora_int_id] = f"lora_path {load.lora.lora_path!r}: {e}"
                logger.warning("LoRA adapter %r (id %d) not loaded: %s", load.lora.lora_name,
                               load.lora.lora_int_id, e)
                continue
            self.failed.pop(load.lora.lora_int_id, None)
            self.slot_of[load.lora.lora_int_id] = slot
            logger.info("LoRA adapter %r (id %d) in slot %d", load.lora.lora_name,
                        load.lora.lora_int_id, slot)

    def _clear(self, slot: int) -> None:
        for part in [*self.projections.values(), *self.experts.values()]:
            part.clear(slot)

    def _put(self, slot: int, adapter: Adapter) -> None:
        for (layer, module), (a, b) in adapter.weights.items():
            prefix, _, name = module.rpartition(".")  # "shared_expert" or ""
            kind, sub = PACKED[name]
            proj = self.projections.get((layer, f"{prefix}.{kind}" if prefix else kind))
            if proj is None:
                if (layer, "qkv_proj") in self.projections:  # this stage has the layer
                    raise ValueError(f"layer {layer} has no {module} in this model")
                continue  # another pipeline stage's layer
            if sub is None:
                proj.put_fused(slot, a, b)
            else:
                proj.put(slot, sub, a, b)
        for (layer, wrapper), (a, b) in adapter.experts.items():
            experts = self.experts.get(layer)
            if experts is None:
                if (layer, "qkv_proj") in self.projections:
                    raise ValueError(f"layer {layer} has no MoE experts (a dense layer)")
                continue
            experts.put(slot, a, b, adapter.scaling)

    def _read(self, lora: LoRARequest) -> Adapter:
        key = (lora.lora_int_id, lora.lora_path)
        adapter = self.cpu.get(key)
        if adapter is None:
            adapter = read_adapter(lora, self.max_lora_rank)
            self.cpu[key] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(key)
        return adapter

    def check(self, lora_id: int) -> None:
        """ValueError naming lora_request when adapter `lora_id` is not in a slot."""
        if lora_id and lora_id not in self.slot_of:
            raise ValueError("lora_request: " + self.failed.get(
                lora_id, f"adapter id {lora_id} is not loaded on this worker"))

    def prepare_step(self, lora_ids: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Group the step's tokens by slot from each request's adapter id (0: none) and its
        token count, in batch order."""
        step = self.step
        step.groups, step.token_slots, step.masks = [], None, {}
        step.slots, step.host_slots, step.present = None, [], frozenset()
        step.active = bool(lora_ids.any())
        if not step.active:
            return
        slots = np.array([self.slot_of[i] if i else -1 for i in lora_ids.tolist()], np.int64)
        token_slots = np.repeat(slots, num_scheduled)
        step.present = frozenset(slots[slots >= 0].tolist())
        if self.experts:
            step.host_slots = token_slots.tolist()
            step.slots = torch.from_numpy(token_slots).to(self.device)
        if len(token_slots) <= DENSE_MAX_TOKENS:
            step.token_slots = torch.from_numpy(token_slots).to(self.device)
            return
        for slot in np.unique(slots[slots >= 0]).tolist():
            rows = np.nonzero(token_slots == slot)[0]
            if rows[-1] - rows[0] + 1 == len(rows):
                step.groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                step.groups.append((slot, torch.from_numpy(rows).to(self.device)))
