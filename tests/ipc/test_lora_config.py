"""The PEFT adapter config check shared by frontends and workers (ipc/lora.py), and
--lora-modules' two forms (frontend/server/lora_routes.py)."""

from __future__ import annotations

import json

import pytest

from tidal.ipc.lora import read_adapter_config


def _folder(tmp_path, **config) -> str:
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(base | config))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    return str(tmp_path)


def test_a_plain_lora_reads_with_peft_scaling(tmp_path):
    config = read_adapter_config(_folder(tmp_path), 16)
    assert config.scaling(8) == 2.0 and config.target_modules == ("q_proj",)
    rs = read_adapter_config(_folder(tmp_path, use_rslora=True), 16)
    assert rs.scaling(16) == 4.0


@pytest.mark.parametrize("config, message", [
    (dict(use_dora=True), "DoRA is not supported"),
    (dict(bias="all"), "bias 'all' is not supported"),
    (dict(target_modules=["q_proj", "lm_head"]), r"target_modules \['lm_head'\]"),
    (dict(r=32), "rank 32 exceeds --max-lora-rank 16"),
    (dict(rank_pattern={"q_proj": 64}), "rank 64 exceeds"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    (dict(peft_type="IA3"), "peft_type 'IA3' is not supported"),
    # PEFT 0.21's target_parameters on an MoE router's weight, or a dense weight
    (dict(target_parameters=["experts.down_proj", "mlp.gate.weight"]),
     r"target_parameters \['mlp.gate.weight'\] are not supported \(supported: the MoE "
     r"experts' stacked gate_up_proj and down_proj"),
    (dict(target_parameters=["self_attn.q_proj.weight"]), r"\['self_attn.q_proj.weight'\]"),
    (dict(target_parameters="experts.down_proj"), "target_parameters must be a list"),
])
def test_what_tidal_cannot_run_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        read_adapter_config(_folder(tmp_path, **config), 16)


def test_lora_on_the_moe_experts_stacked_parameters_is_taken(tmp_path):
    """PEFT 0.21's LoRA on transformers 5's stacked experts (every MoE family tidal serves:
    `mlp.experts.gate_up_proj` / `down_proj`), named as PEFT users write it."""
    for names in (["experts.gate_up_proj", "experts.down_proj"], ["mlp.experts.down_proj"],
                  ["gate_up_proj"]):
        config = read_adapter_config(_folder(tmp_path, target_parameters=names), 16)
        assert config.target_parameters == tuple(names)


def test_a_folder_without_the_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        read_adapter_config(str(tmp_path), 16)


def test_lora_modules_take_name_path_and_json():
    from tidal.frontend.server.serve import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"),
                                                                         ("b", "/y")]
    for bad, message in (("a", "expected name=path"), ("=x", "must not be empty"),
                         ('{"name": "b"}', "needs")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_an_adapter_on_moe_blocks_is_refused_naming_the_module(tmp_path):
    """Tensors of a PEFT adapter on an MoE block's router, the shared expert's gate, or
    experts as modules (older transformers) are refused by the worker's reader, naming the
    tensor and the block's module; its requests fail alone (docs/lora.md). The stacked
    experts and the shared expert's projections read (tests/e2e/test_lora_moe.py runs them)."""
    import torch
    from safetensors.torch import save_file

    from tidal.ipc.messages import LoRARequest
    from tidal.workers.lora import read_adapter

    def folder_with(module: str):
        folder = tmp_path / module.replace(".", "_")
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        name = f"base_model.model.model.layers.0.{module}"
        save_file({f"{name}.lora_A.weight": torch.zeros(4, 8),
                   f"{name}.lora_B.weight": torch.zeros(8, 4)},
                  str(folder / "adapter_model.safetensors"))
        return LoRARequest("moe", 1, str(folder)), name

    for module, block in (("mlp.gate", "gate"), ("mlp.shared_expert_gate", "shared_expert_gate"),
                          ("block_sparse_moe.experts.0.w1", "experts")):
        lora, name = folder_with(module)
        with pytest.raises(ValueError, match=rf"tensor {name}.lora_A.weight is not on a "
                           rf".*MoE block's {block}"):
            read_adapter(lora, 16)
    adapter = read_adapter(folder_with("mlp.shared_expert.gate_proj")[0], 16)
    assert list(adapter.weights) == [(0, "shared_expert.gate_proj")]
    adapter = read_adapter(folder_with("mlp.experts.base_layer")[0], 16)
    assert list(adapter.experts) == [(0, "experts.base_layer")] and not adapter.weights
