"""Offline-benchmark parts that need no engine: batching, result math, configs, models."""

import json
import os

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, SchedulerConfig
from tidal.frontend.bench.cli import random_weights_model
from tidal.frontend.bench.datasets import BenchRequest
from tidal.frontend.bench.hf_baselines import static_batches, throughput_result
from tidal.frontend.bench.offline import (
    compare_to_baselines, count_parameters, format_throughput, llm_kwargs,
)


def _requests(n):
    return [BenchRequest("p", 10 + i, 5, [1] * (10 + i)) for i in range(n)]


def test_static_batches_keep_order_and_size():
    batches = static_batches(_requests(7), 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [r.prompt_len for b in batches for r in b] == list(range(10, 17))


def test_throughput_result_and_ratio():
    requests = _requests(4)  # 10+11+12+13 = 46 prompt tokens
    tidal = throughput_result("tidal", requests, 20, 2.0)
    hf = throughput_result("transformers-static", requests, 20, 8.0)
    assert tidal["requests_per_s"] == 2.0 and tidal["output_tokens_per_s"] == 10.0
    assert tidal["total_tokens_per_s"] == pytest.approx(33.0)
    ratios = compare_to_baselines(tidal, [hf])
    assert ratios == {"transformers-static": pytest.approx(4.0)}
    assert "tidal / transformers-static: 4.00x" in format_throughput([tidal, hf], ratios)


def test_llm_kwargs_rebuild_the_same_config(tiny_llama):
    from tidal.frontend.llm import engine_config_from_kwargs

    config = EngineConfig(model=ModelConfig(model=tiny_llama),
                          scheduler=SchedulerConfig(max_num_seqs=7, async_scheduling=False))
    model, flags = llm_kwargs(config)
    assert model == tiny_llama and flags["async_scheduling"] is False
    assert engine_config_from_kwargs(model, **flags) == config


def test_random_weights_model_shape_and_reuse(tiny_llama, tmp_path):
    path = random_weights_model("64,1", tiny_llama, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 1)
    assert config["vocab_size"] == 512 and os.path.exists(os.path.join(path, "tokenizer.json"))
    # embeddings and LM head 2 * 512 * 64, attention 4 * 64 * 64, MLP 3 * 64 * 256, 3 norms
    assert count_parameters(path) == 2 * 512 * 64 + 4 * 64 * 64 + 3 * 64 * 256 + 3 * 64
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert random_weights_model("64,1", tiny_llama, str(tmp_path)) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime


@pytest.mark.parametrize("spec", ["64", "a,b", "0,1"])
def test_random_weights_bad_spec(spec, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="random_weights"):
        random_weights_model(spec, tiny_llama, str(tmp_path))
