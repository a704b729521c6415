"""Frontends: `LLM` (blocking), `AsyncLLM` (asyncio, streaming), the HTTP server, the CLI.

Exports are loaded on first use, so `python -m tidal.frontend.cli core` (the engine-core
daemon) does not import the tokenizer stack.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "tidal.frontend.llm",
    "AsyncLLM": "tidal.frontend.async_llm",
    "RequestOutput": "tidal.frontend.outputs",
    "CompletionOutput": "tidal.frontend.outputs",
    "RequestMetrics": "tidal.frontend.outputs",
    "Logprob": "tidal.frontend.outputs",
    "SamplingParams": "tidal.ipc.messages",
    "StructuredOutputsParams": "tidal.ipc.messages",
    "LoRARequest": "tidal.ipc.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.frontend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
