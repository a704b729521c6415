"""tidal: a continuous-batching LLM inference engine.

The import package maps onto the repository's top-level folders (see pyproject.toml):
`tidal.ipc`, `tidal.engine_core`, `tidal.workers`, `tidal.kernels`, `tidal.frontend`.

As in vLLM, the frontends' names are at the top: `from tidal import LLM, SamplingParams`
(`AsyncLLM`, `RequestOutput`, ... too). They are loaded on first use, so a process that
imports only the engine core (which never imports torch) does not load the frontends.
"""

from __future__ import annotations

__version__ = "0.1.0"

_FRONTEND = ("LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
             "CompletionOutput", "RequestMetrics", "Logprob", "LoRARequest")

__all__ = ["__version__", *_FRONTEND]


def __getattr__(name: str):
    if name not in _FRONTEND:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    from . import frontend

    value = getattr(frontend, name)
    globals()[name] = value
    return value
