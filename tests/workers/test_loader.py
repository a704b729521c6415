"""Issue 3, item 5: bad model folders fail at start-up with one clear error each; sharded
checkpoints (index file) load to the same weights."""

import json
import os
import shutil

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.workers.worker import Worker
from worker_test_utils import worker_config


@pytest.fixture
def folder(tiny_llama, tmp_path):
    """A private copy of the tiny Llama folder to break."""
    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    return path


def _load(path) -> Worker:
    worker = Worker(worker_config(str(path)))
    worker.load()
    return worker


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        _load(tmp_path / "nope")


def test_missing_config(folder):
    os.remove(folder / "config.json")
    with pytest.raises(ValueError, match="has no config.json"):
        _load(folder)


def test_unknown_architecture(folder):
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel is not supported by "
                                         "tidal; supported: LlamaForCausalLM"):
        _load(folder)


def test_missing_weights_file(folder):
    os.remove(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        _load(folder)


def test_missing_tensor(folder):
    _edit_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj"
                                         r"\.weight$"):
        _load(folder)


def test_shape_mismatch(folder):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    _edit_weights(folder, shrink)
    with pytest.raises(ValueError, match=r"shape mismatch for model\.layers\.0\.mlp\.up_proj"
                                         r"\.weight: the checkpoint has \[100, 64\], the model "
                                         r"config expects \[128, 64\]"):
        _load(folder)


def test_unexpected_tensor(folder):
    _edit_weights(folder, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"does not use: model\.extra\.weight"):
        _load(folder)


def test_unsupported_rope_type(folder):
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                          "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        _load(folder)


def test_bad_dtype_names_the_field(tiny_llama):
    # EngineConfig refuses it first; a worker decoding its argv checks again
    bad = msgspec.structs.replace(worker_config(tiny_llama), dtype="int8")
    with pytest.raises(ValueError, match="dtype must be"):
        Worker(bad)


def test_sharded_checkpoint_with_index(tiny_llama, folder):
    tensors = load_file(str(folder / "model.safetensors"))
    os.remove(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / file))
        weight_map.update({n: file for n in shard_names})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = dict(_load(folder).runner.model.named_parameters())
    whole = dict(_load(tiny_llama).runner.model.named_parameters())
    assert sharded.keys() == whole.keys()
    for name, param in whole.items():
        assert torch.equal(param, sharded[name]), name


def test_sliding_window_beyond_max_model_len(folder):
    """A Mistral v0.1 style window (no use_sliding_window key) shorter than max_model_len
    loads: every layer attends within it, and the worker reports it to the engine core."""
    _edit_config(folder, sliding_window=128)
    worker = _load(folder)  # max_model_len 256
    assert worker.args.sliding_window == 128
    windows = {m.sliding_window for m in worker.runner.model.modules()
               if type(m).__name__ == "PagedAttention"}
    assert windows == {128}
    worker.num_kv_blocks = 10
    assert worker.ready_message().sliding_window == 128


def test_qwen2_window_switched_off_is_ignored(tiny_qwen2):
    assert Worker(worker_config(tiny_qwen2)).args.sliding_window is None
    worker = _load(tiny_qwen2)
    worker.num_kv_blocks = 10
    assert worker.ready_message().sliding_window == 0


def test_onednn_copies_wait_for_idle_chores(tiny_llama):
    """Loading leaves each weight's oneDNN copy to `idle_chore` (one a call, while the worker
    process has no plan) or to the first product that needs it."""
    worker = _load(tiny_llama)
    gemms = [m.cpu_gemm for m in worker.runner.model.modules()
             if getattr(m, "cpu_gemm", None) is not None]
    if not any(g.uses_onednn for g in gemms):
        pytest.skip("no weight takes oneDNN here (the panel kernel takes every product)")
    assert worker.deferred and not any(g.prepared for g in worker.deferred)
    left = len(worker.deferred)
    while worker.idle_chore():
        assert len(worker.deferred) < left
        left = len(worker.deferred)
    assert all(g.prepared for g in gemms)
