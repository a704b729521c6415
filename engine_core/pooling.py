"""Which runner an engine is (generate or pooling) and its pooler, from the config and the
model folder's JSON files (no torch): decided once by the engine core at start-up, sent to
the workers (`WorkerConfig.runner`) and the frontends (`EngineInfo.pooler`).

vLLM's rules, as tidal follows them:
- `--runner auto` is pooling for a folder with a sentence-transformers pooling config
  (`modules.json` naming a `sentence_transformers.models.Pooling` module: Qwen3-Embedding
  ships one while its config.json says Qwen3ForCausalLM) or an architecture named `*Model`
  (Qwen3Model), else generate;
- the pooler's defaults: `--pooler-config` first, then the sentence-transformers config
  (its Pooling module's `pooling_mode_*`, and normalize when modules.json has a Normalize
  module), then LAST and normalize (vLLM's for a decoder converted to embeddings);
- Matryoshka: config.json's `matryoshka_dimensions` (a list) or `is_matryoshka: true`.
"""

from __future__ import annotations

import json
import os

from .config import EngineConfig, parse_pooler_config
from ..ipc.pooling import PoolerInfo

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))
"""The sentence-transformers pooling modes tidal runs, by their Pooling config's key."""


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_dir: str) -> dict | None:
    """{"pooling_type": ..., "normalize": ...} from a sentence-transformers folder's
    modules.json and its Pooling module's config.json (only the keys found); None when the
    folder has no Pooling module. A pooling mode tidal lacks (max, weighted mean) is a
    ValueError naming the file."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING),
                   None)
    if pooling is None:
        return None
    found: dict = {"normalize": _ST_NORMALIZE in types}
    path = os.path.join(model_dir, pooling.get("path") or "1_Pooling", "config.json")
    st_config = _read_json(path)
    if isinstance(st_config, dict):
        modes = [kind for key, kind in _ST_MODES if st_config.get(key)]
        others = [k for k, v in st_config.items() if k.startswith("pooling_mode_") and v
                  and k not in dict(_ST_MODES)]
        if others and not modes:
            raise ValueError(f"{path}: pooling mode {', '.join(others)} is not supported "
                             "(LAST, MEAN and CLS are); pass --pooler-config")
        if modes:
            found["pooling_type"] = modes[0]
    return found


def resolve_runner(config: EngineConfig, model_dir: str | None = None) -> str:
    """generate or pooling for `config` over the folder `model_dir` (default: the config's
    model); ValueError naming `convert` for a pooling runner told not to convert a
    generative checkpoint."""
    model = config.model
    model_dir = model_dir or model.model
    runner = model.runner
    if runner == "auto":
        runner = "pooling" if model.convert == "embed" or _looks_like_embedding(model_dir) \
            else "generate"
    if runner == "pooling" and model.convert == "none" and _generative(model_dir):
        raise ValueError("convert none: the checkpoint is a *ForCausalLM one; the pooling "
                         "runner needs --convert embed (or auto) to drop its LM head")
    return runner


def _architectures(model_dir: str) -> list[str]:
    hf_config = _read_json(os.path.join(model_dir, "config.json"))
    names = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    return [n for n in names or () if isinstance(n, str)]


def _generative(model_dir: str) -> bool:
    return any(a.endswith("ForCausalLM") for a in _architectures(model_dir))


_GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")
"""Architecture names vLLM takes as generative before it reads `*Model` as an embedding one."""


def _looks_like_embedding(model_dir: str) -> bool:
    if sentence_transformers_pooling(model_dir) is not None:
        return True
    return any(a.endswith("Model") and not a.endswith(_GENERATIVE_SUFFIXES)
               for a in _architectures(model_dir))


def pooler_info(config: EngineConfig, model_dir: str | None = None) -> PoolerInfo | None:
    """The engine's pooler (None for a generate runner); ValueError naming the field of a
    configuration that cannot work."""
    model_dir = model_dir or config.model.model
    if resolve_runner(config, model_dir) != "pooling":
        return None
    chosen = {"pooling_type": "LAST", "normalize": True}
    chosen.update(sentence_transformers_pooling(model_dir) or {})
    chosen.update(parse_pooler_config(config.model.pooler_config))
    hf_config = _read_json(os.path.join(model_dir, "config.json")) or {}
    hidden_size = hf_config.get("hidden_size")
    if not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"model {model_dir!r}: config.json names no hidden_size")
    dims = hf_config.get("matryoshka_dimensions")
    dims = [int(d) for d in dims] if isinstance(dims, list) and dims else None
    return PoolerInfo(chosen["pooling_type"], bool(chosen["normalize"]), hidden_size,
                      is_matryoshka=bool(dims) or bool(hf_config.get("is_matryoshka")),
                      matryoshka_dimensions=dims, model_name=config.model.name)
