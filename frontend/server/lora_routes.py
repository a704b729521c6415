"""LoRA adapters over HTTP, as vLLM serves them: each adapter is a model name.

- `--lora-modules name=path ...` (or vLLM's JSON form `{"name": ..., "path": ...}`) names
  adapters at start-up; `/v1/models` lists the base model, then one card per adapter (`root`
  its folder, `parent` the base model's name); a request whose `model` is an adapter's name
  runs with it (`LoRARequest` in its AddRequest), in the same batches as every other.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
  {"lora_name"}` change the names at run time. As in vLLM they exist only when the
  environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (tidal takes vLLM's variable, so a
  deployment script carries over; otherwise they answer 404), and like every route but
  /health, /metrics, /version and /ping they need the API key when one is set. Loading
  checks the folder (`ipc/lora.py`: a PEFT LoRA tidal can run, rank within the engine's
  --max-lora-rank) and answers 400 naming what is wrong; the workers read the weights when a
  request first uses it. Unloading takes the name away: requests already running with the
  adapter finish with it (their AddRequest carries it), new ones get 404.

Ids: adapters get ids 1, 2, ... in the order they are named, never reused, so one id always
means one folder for the engine core's slots and the prefix cache. The names live in each HTTP
process; with --api-server-count above 1 a runtime load would reach one process only, so it
is refused (400) there, and adapters are named with --lora-modules.
"""

from __future__ import annotations

import itertools
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from ...ipc.lora import read_adapter_config
from ...ipc.messages import LoRARequest
from .errors import APIError, bad_request

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    """Whether the load / unload routes exist (vLLM's environment variable)."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


class LoRARegistry:
    """The adapter names this HTTP process serves (see the module docstring)."""

    def __init__(self, modules: list[tuple[str, str]], max_lora_rank: int,
                 base_names: list[str], runtime_loads: bool = True):
        self.max_lora_rank = max_lora_rank
        self.base_names = base_names
        self.runtime_loads = runtime_loads
        self._ids = itertools.count(1)
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        """Name an adapter; ValueError when the engine has no LoRA, the name is taken or the
        folder is not one the engine can run."""
        if not self.max_lora_rank:
            raise ValueError(f"lora_name {name!r}: the engine core was started without "
                             "--enable-lora")
        if name in self.adapters or name in self.base_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter_config(path, self.max_lora_rank)
        lora = LoRARequest(name, next(self._ids), path)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)

    def get(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model is not None else None


def add_lora_routes(app: FastAPI) -> None:
    """The runtime load / unload routes (only when `runtime_updates_allowed()`)."""
    if not runtime_updates_allowed():
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """Serve a PEFT adapter folder under a new model name."""
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("lora_name and lora_path must be non-empty strings", "lora_name")
        registry = request.app.state.serving.loras
        if not registry.runtime_loads:
            raise bad_request("runtime LoRA loading needs --api-server-count 1 (each HTTP "
                              "process has its own names); use --lora-modules", "lora_name")
        try:
            registry.add(name, path)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path" if "lora_path" in str(exc)
                              else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """Stop serving an adapter name (requests running with it finish with it)."""
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        try:
            request.app.state.serving.loras.remove(name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise bad_request("the body must be a JSON object", None) from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    return body


def model_cards(loras: LoRARegistry, base: str, created: int) -> list[dict]:
    """/v1/models cards of the adapters (vLLM's shape: root = folder, parent = base)."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "tidal",
             "root": lora.lora_path, "parent": base, "permission": []}
            for name, lora in loras.adapters.items()]
