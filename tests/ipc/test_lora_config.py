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
])
def test_what_tidal_cannot_run_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        read_adapter_config(_folder(tmp_path, **config), 16)


def test_a_folder_without_the_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        read_adapter_config(str(tmp_path), 16)


def test_lora_modules_take_name_path_and_json():
    from tidal.frontend.server.lora_routes import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"),
                                                                         ("b", "/y")]
    for bad, message in (("a", "expected name=path"), ("=x", "must not be empty"),
                         ('{"name": "b"}', "needs")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
