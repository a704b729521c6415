"""The demo model bundled with tidal: the default when no model is given.

The folder ``demo_model/`` next to this file is a normal Hugging Face model folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json, README.md). It is package data of ``tidal.frontend``, so it is present
in editable and wheel installs alike. It is a ~4M-parameter Llama (grouped-query attention)
trained on the Python standard library's source by ``tools/train_demo_model.py``.
"""

from __future__ import annotations

import os

DEMO_MODEL_DIR: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
"""Absolute path of the bundled demo model folder inside the installed package."""

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path() -> str:
    """Return the bundled demo model folder, checking that its files are installed.

    Raises FileNotFoundError naming the missing file when the package was installed without
    its package data (for example from a source tree where the model was never committed).
    """
    for name in _REQUIRED_FILES:
        path = os.path.join(DEMO_MODEL_DIR, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tidal's bundled demo model is incomplete: {path} is missing; "
                "rebuild it with tools/train_demo_model.py or pass a model explicitly"
            )
    return DEMO_MODEL_DIR


DEMO_SERVED_MODEL_NAME: str = "tidal-demo"
"""The demo model's name in the OpenAI API when no --served-model-name is given (rather than
the long path of the installed folder)."""


def apply_demo_model_default(ns) -> bool:
    """Point parsed engine flags at the demo model when neither MODEL nor --model is given.

    Sets ``ns.model`` to the bundled folder and, unless --served-model-name was given,
    ``ns.served_model_name`` to DEMO_SERVED_MODEL_NAME. Returns whether the default was
    applied. Raises ValueError (naming the missing file) when the demo model is not installed.
    """
    if getattr(ns, "model_tag", None) or getattr(ns, "model", None):
        return False
    try:
        ns.model = demo_model_path()
    except FileNotFoundError as e:
        raise ValueError(f"model is required: {e}") from None
    if getattr(ns, "served_model_name", None) is None:
        ns.served_model_name = DEMO_SERVED_MODEL_NAME
    return True
