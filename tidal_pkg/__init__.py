"""tidal: a continuous-batching LLM inference engine.

The import package maps onto the repository's top-level folders (see pyproject.toml):
`tidal.ipc`, `tidal.engine_core`, `tidal.workers`, `tidal.kernels`, `tidal.frontend`.
"""

__version__ = "0.1.0"
