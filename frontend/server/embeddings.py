"""POST /v1/embeddings: OpenAI's embeddings API on an engine started with --runner pooling.

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64",
     "dimensions": N, "user": ...}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request (a prefill, batched with the others by the scheduler) and
may fill the whole context. The 400s are vLLM's: an input of more than max_model_len tokens,
`dimensions` on a model whose config.json declares no Matryoshka dimensions, embeddings on a
server that generates (and, in `completions.py` / `chat.py`, generation on one that embeds).
`base64` is the float32 vector's little-endian bytes, as OpenAI's and vLLM's answers, which
the `openai` client decodes itself. Admission (503) counts every input as one request.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError, bad_request, from_value_error, json_response
from .protocol import TokenId
from .serving import OpenAIServing, _ClientGone, _until_disconnect, now
from ...ipc.pooling import PoolingParams

MAX_INPUTS = 2048
"""Most inputs one request may carry (OpenAI's limit)."""


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (unknown fields ignored, as the other routes do)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


def _inputs(value) -> list[str | list[int]]:
    """The request's inputs as a list of texts or token-id lists (400 when empty)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    if isinstance(value[0], int):
        return [list(value)]
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input may hold at most {MAX_INPUTS} items, got {len(value)}",
                          "input")
    return list(value)


def _encode_vector(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(serving: OpenAIServing, req: EmbeddingRequest,
                           request: Request) -> Response:
    """Validate, admit, embed every input, answer (one JSON body)."""
    model = serving.check_model(req.model)
    engine = serving.engine
    pooler = engine.engine_info.pooler
    if pooler is None:
        raise bad_request("The model does not support Embeddings API: this server generates "
                          "text; start one with --runner pooling for embeddings.", "model")
    try:
        params = pooler.resolve(PoolingParams(dimensions=req.dimensions))
    except ValueError as exc:
        raise from_value_error(exc) from None
    inputs = _inputs(req.input)
    params_of = (lambda i: "input") if len(inputs) == 1 else (lambda i: f"input[{i}]")
    prompt_ids = [await _encode(serving, request, item, params_of(i))
                  for i, item in enumerate(inputs)]
    serving.check_alive()
    ticket = serving.admission.admit(len(prompt_ids), sum(map(len, prompt_ids)),
                                     serving.waited(request))
    results: list = []

    async def embed_all() -> None:
        results.extend(await asyncio.gather(*(
            engine.embed(ids, params, prompt_token_ids=ids) for ids in prompt_ids)))

    try:
        await _until_disconnect(request, embed_all())
    except _ClientGone:
        return Response(status_code=499)
    except ValueError as exc:  # the engine core refused an input: bad input, a 400
        raise from_value_error(exc) from None
    finally:
        ticket.release()
    data = []
    for index, out in enumerate(results):
        if out.outputs is None:
            raise serving.engine_error(out)
        data.append({"object": "embedding", "index": index,
                     "embedding": _encode_vector(out.outputs.embedding, req.encoding_format)})
    num_tokens = sum(map(len, prompt_ids))
    return json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": now(),
                          "model": model, "data": data,
                          "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def _encode(serving: OpenAIServing, request: Request, prompt: str | list[int],
                  param: str) -> list[int]:
    """Token ids of one input, off the event loop; 400 when empty or over max_model_len."""
    max_len = serving.max_model_len
    if isinstance(prompt, list):
        if len(prompt) > max_len:
            raise _too_long(max_len, len(prompt), param)
        serving.check_token_ids(prompt, param)
    elif len(prompt) > serving.max_prompt_chars:
        raise bad_request(f"This model's maximum context length is {max_len} tokens, but "
                          f"the {param} has {len(prompt)} characters, more than that many "
                          f"tokens can hold. Please reduce the length of the input.", param)
    try:
        ids = await serving.tokenizing(request, serving.engine.encode_embedding_prompt, prompt,
                                       chars=len(prompt))
    except ValueError as exc:
        message = str(exc)
        if "too long" in message:
            raise bad_request(f"This model's maximum context length is {max_len} tokens. "
                              f"However, you requested more tokens in the {param}: "
                              f"{message}. Please reduce the length of the input.",
                              param) from None
        raise bad_request(f"{param}: {message}", param) from None
    return ids


def _too_long(max_len: int, num_tokens: int, param: str) -> APIError:
    return bad_request(f"This model's maximum context length is {max_len} tokens. However, "
                       f"you requested {num_tokens} tokens in the {param}. Please reduce the "
                       "length of the input.", param)

