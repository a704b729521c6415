"""Weight loading from a Hugging Face model folder (or a hub id, when online).

A folder holds config.json and either one `model.safetensors`, several `*.safetensors`, or
shards listed in `model.safetensors.index.json`. Each checkpoint tensor is opened lazily and
handed to its parameter's `weight_loader`, which reads only this rank's slice. Every failure
is a ValueError that names the folder and the offending file or tensor.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Callable, Iterator

from torch import nn

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def resolve_model_path(model: str) -> str:
    """The model folder, which is local by now: a Hub id was fetched by the process the user
    started, before any worker (`engine_core/model_files.prepare_model`)."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file; expected a model folder")
    raise ValueError(f"model folder {model!r} does not exist")


def read_config(path: str) -> dict:
    """config.json of a model folder as a dict."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model folder {path!r} has no config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return config


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a folder: those the index names, else every *.safetensors."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise ValueError(f"{index_path} names shard files that are missing: "
                             f"{', '.join(missing)}")
        return [os.path.join(path, name) for name in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {path!r} has no *.safetensors weights "
                         "(.bin / .pt checkpoints are not supported)")
    return files


def iterate_checkpoint(path: str) -> Iterator[tuple[str, object]]:
    """(tensor name, lazy safetensors slice) for every tensor of the folder's checkpoint."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, path: str,
                 rename: Callable[[str], str | None] | None = None) -> None:
    """Fill every parameter of `model` from the folder's checkpoint (this rank's slices).

    Checkpoint names go through the model's `param_for(name)` where it has one (a family's
    own names, e.g. one MoE expert's tensor -> the stacked experts' parameter and shard), else
    `model.packed_modules_mapping` (q_proj -> qkv_proj shard q, ...). A weight loader may
    return the shard ids it filled (a stacked tensor fills many); None means its own. A
    tensor the model has no place for, or a parameter no tensor fills, is an error.
    `rename` comes first where given (an embedding model's: `model.` added to a bare
    decoder's names, the LM head's dropped: `workers/pooling.py`); None skips the tensor.
    """
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    param_for = getattr(model, "param_for", lambda name: None)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    on_this_stage = getattr(model, "checkpoint_name", lambda name: name)  # pipeline stages
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for name, tensor in iterate_checkpoint(path):
        if rename is not None and (name := rename(name)) is None:
            continue
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            continue
        name = on_this_stage(name)
        if name is None:
            continue  # another pipeline stage's tensor
        param_name, shard_id = param_for(name) or _map_name(name, mapping)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        param.checkpoint_name = name
        filled = param.weight_loader(param, tensor, shard_id)
        loaded.update((param_name, shard) for shard in (filled or (shard_id,)))
    if unexpected:
        raise ValueError(f"checkpoint in {path!r} has tensors this model does not use: "
                         f"{_short_list(unexpected)}")
    _check_all_loaded(params, loaded, mapping, path)


def _map_name(name: str, mapping: dict) -> tuple[str, object]:
    """Checkpoint tensor name -> (parameter name, shard id)."""
    for ckpt_part, (param_part, shard_id) in mapping.items():
        token = f".{ckpt_part}."
        if token in name:
            return name.replace(token, f".{param_part}."), shard_id
    return name, None


def _check_all_loaded(params: dict, loaded: set, mapping: dict, path: str) -> None:
    inverse = {(param_part, shard): ckpt_part for ckpt_part, (param_part, shard)
               in mapping.items()}
    missing = []
    for param_name, param in params.items():
        for shard_id in getattr(param, "shard_ids", (None,)):
            if (param_name, shard_id) in loaded:
                continue
            missing.append(_checkpoint_name(param_name, shard_id, inverse))
    if missing:
        raise ValueError(f"checkpoint in {path!r} is missing tensors: {_short_list(missing)}")


def _checkpoint_name(param_name: str, shard_id, inverse: dict) -> str:
    if shard_id is None:
        return param_name
    for (param_part, shard), ckpt_part in inverse.items():
        token = f".{param_part}."
        if shard == shard_id and token in param_name:
            return param_name.replace(token, f".{ckpt_part}.")
    return f"{param_name}[{shard_id}]"


def _short_list(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
