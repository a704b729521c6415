"""A PEFT LoRA adapter folder's config, read and checked the same way by a frontend (before
it sends a request or registers an adapter, so a bad folder is an HTTP 400 / ValueError) and
by every worker (which reads the weights itself; `workers/lora.py`). Standard library only.

A folder is `adapter_config.json` plus `adapter_model.safetensors`. tidal takes plain LoRA
(`peft_type` LORA) on the attention and MLP projections of the decoder layers
(`TARGET_MODULES`, Qwen2-MoE's shared expert's included) and on MoE layers' stacked experts
(`target_parameters` naming `EXPERT_PARAMETERS`), any rank up to --max-lora-rank (per module
too: `rank_pattern` is read from the tensors' shapes), scaling lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). What it does not take is refused by name: DoRA,
biases, `modules_to_save`, `alpha_pattern`, embeddings or the LM head as targets, other
`target_parameters` (a router's weight, ...) and other tensors under an MoE block (the
router, the shared expert's gate: `workers/lora.py`), `.bin` weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj")
"""The projections an adapter may target: PEFT's names in Llama-family checkpoints, and the
fused ones of checkpoints that fuse them (Phi-3's qkv_proj and gate_up_proj)."""

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The `target_parameters` an adapter may name: transformers' stacked MoE experts
(`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj` [E, hidden, I]; every
MoE family tidal serves stacks them so), as `experts.gate_up_proj`, `mlp.experts.down_proj`,
or the bare parameter name."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterConfig:
    """What tidal uses of a PEFT adapter_config.json."""

    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    target_parameters: tuple[str, ...] = ()
    """The MoE experts' stacked parameters the adapter adapts (`EXPERT_PARAMETERS`)."""

    def scaling(self, rank: int) -> float:
        """The factor on B·A of a module of this rank (PEFT's `scaling`)."""
        return self.lora_alpha / (math.sqrt(rank) if self.use_rslora else rank)


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """The adapter folder's config, checked; ValueError naming lora_path otherwise."""
    def bad(message: str) -> ValueError:
        return ValueError(f"lora_path {path!r}: {message}")

    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise bad(f"not a PEFT adapter folder (no {CONFIG_FILE})")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise bad(f"has no {WEIGHTS_FILE} (only safetensors weights are read)")
    try:
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(f"{CONFIG_FILE} does not read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise bad(f"{CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                      ("alpha_pattern", "alpha_pattern"), ("layers_to_transform",
                                                          "layers_to_transform")):
        if raw.get(key):
            raise bad(f"{what} is not supported")
    if raw.get("bias", "none") != "none":
        raise bad(f"bias {raw.get('bias')!r} is not supported (only 'none')")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    ranks = [rank] + [r for r in (raw.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        raise bad(f"rank {max(ranks)} exceeds --max-lora-rank {max_lora_rank}")
    parameters = raw.get("target_parameters") or []
    if isinstance(parameters, str) or not all(isinstance(p, str) for p in parameters):
        raise bad(f"target_parameters must be a list of names, got {parameters!r}")
    unsupported = [p for p in parameters if not _is_expert_stack(p)]
    if unsupported:
        raise bad(f"target_parameters {unsupported} are not supported (supported: the MoE "
                  f"experts' stacked {' and '.join(EXPERT_PARAMETERS)}, e.g. "
                  f"'experts.gate_up_proj'; not routers or other parameters)")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):  # a regex in PEFT: the weights' names say which modules
        targets = list(TARGET_MODULES)
    unsupported = [t for t in targets if t not in TARGET_MODULES]
    if unsupported:
        raise bad(f"target_modules {unsupported} are not supported (supported: "
                  f"{', '.join(TARGET_MODULES)})")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(path, rank, float(alpha), bool(raw.get("use_rslora", False)),
                         tuple(targets), tuple(parameters))


def _is_expert_stack(name: str) -> bool:
    """`name` (a PEFT target_parameters entry: a suffix of a parameter's dotted name) names
    an MoE layer's stacked gate_up_proj or down_proj: `experts.<p>` or its tail `<p>`."""
    *parents, last = name.split(".")
    return last in EXPERT_PARAMETERS and (not parents or parents[-1] == "experts")
