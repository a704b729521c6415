"""Which runner an engine is and its pooler, from the flags and the folder's JSON
(`engine_core/pooling.py`, vLLM's rules; docs/embeddings.md)."""

from __future__ import annotations

import json
import os

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig
from tidal.engine_core.pooling import pooler_info, resolve_runner


def folder(tmp_path, arch="Qwen3ForCausalLM", st_mode=None, normalize=True, **config):
    """A model folder's JSON files only (no weights): config.json, and with `st_mode` a
    sentence-transformers pooling config."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": [arch], "hidden_size": 64, **config}, f)
    if st_mode is not None:
        modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        with open(tmp_path / "modules.json", "w") as f:
            json.dump(modules, f)
        os.makedirs(tmp_path / "1_Pooling")
        with open(tmp_path / "1_Pooling" / "config.json", "w") as f:
            json.dump({f"pooling_mode_{st_mode}": True}, f)
    return str(tmp_path)


def config(path, **model):
    return EngineConfig(model=ModelConfig(path, **model))


def test_auto_runner_as_vllm(tmp_path_factory):
    causal = folder(tmp_path_factory.mktemp("causal"))
    assert resolve_runner(config(causal)) == "generate" and pooler_info(config(causal)) is None
    assert resolve_runner(config(causal, convert="embed")) == "pooling"
    assert resolve_runner(config(folder(tmp_path_factory.mktemp("bare"), "Qwen3Model"))) \
        == "pooling"
    gpt2 = folder(tmp_path_factory.mktemp("gpt2"), "GPT2LMHeadModel")
    assert resolve_runner(config(gpt2)) == "generate"  # *LMHeadModel is generative
    st = folder(tmp_path_factory.mktemp("st"), st_mode="lasttoken")
    assert resolve_runner(config(st)) == "pooling"
    with pytest.raises(ValueError, match="convert none"):
        resolve_runner(config(causal, runner="pooling", convert="none"))


def test_pooler_defaults_and_overrides(tmp_path_factory):
    causal = folder(tmp_path_factory.mktemp("causal"))
    assert pooler_info(config(causal, runner="pooling")).pooling_type == "LAST"
    st = folder(tmp_path_factory.mktemp("st"), st_mode="mean_tokens", normalize=False)
    info = pooler_info(config(st))
    assert (info.pooling_type, info.normalize, info.hidden_size) == ("MEAN", False, 64)
    info = pooler_info(config(st, pooler_config='{"pooling_type": "cls", "normalize": true}'))
    assert (info.pooling_type, info.normalize) == ("CLS", True)
    with pytest.raises(ValueError, match="max_tokens is not supported"):
        pooler_info(config(folder(tmp_path_factory.mktemp("max"), st_mode="max_tokens")))


def test_matryoshka_is_read_from_config_json(tmp_path_factory):
    listed = folder(tmp_path_factory.mktemp("listed"), matryoshka_dimensions=[16, 32])
    info = pooler_info(config(listed, runner="pooling"))
    assert info.is_matryoshka and info.matryoshka_dimensions == [16, 32]
    flagged = folder(tmp_path_factory.mktemp("flagged"), is_matryoshka=True)
    info = pooler_info(config(flagged, runner="pooling"))
    assert info.is_matryoshka and info.matryoshka_dimensions is None


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"), ('{"pooling_type": "MAX"}', "LAST, MEAN or CLS"),
    ('{"softmax": true}', "softmax is not supported"), ("[1]", "JSON object")])
def test_bad_pooler_config_names_the_flag(text, match):
    with pytest.raises(ValueError, match=f"pooler_config.*{match}|{match}"):
        ModelConfig("m", pooler_config=text)
    with pytest.raises(ValueError, match="pooler_config"):
        ModelConfig("m", pooler_config=text)
