"""OpenAI response shapes, built as plain dicts (encoded by msgspec) on the hot path.

Shapes follow protocol.py's response models: completions (`text_completion`), chat
(`chat.completion` / `chat.completion.chunk`), legacy completion logprobs (parallel lists)
and chat logprobs (`{"content": [{token, logprob, bytes, top_logprobs}]}`). Log-probabilities
of -inf (or NaN) are sent as -9999.0, as vLLM does, since JSON has no infinity.

Server-sent events: each chunk is `data: <json>\\n\\n`, the stream ends with `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import math

import msgspec

from .errors import error_body, from_value_error

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


def clamp_logprob(value: float) -> float:
    """A JSON-safe log-probability (-inf and NaN become -9999.0)."""
    return value if math.isfinite(value) else -9999.0


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def _top(entry: dict, num_top: int) -> list:
    """The `num_top` most likely alternatives of one position, most likely first."""
    if num_top <= 0:
        return []
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)


def _sampled(entry: dict, token_id: int, tokenizer):
    """(text, logprob or None) of the sampled token at one position."""
    lp = entry.get(token_id)
    if lp is not None:
        return lp.decoded_token, clamp_logprob(lp.logprob)
    return tokenizer.decode([token_id]), None


def completion_logprobs(token_ids, logprobs, num_top: int, offset: int, tokenizer):
    """Legacy completions logprobs for these positions, text offsets from `offset`.

    Returns (the logprobs dict, the offset after the last token). `top_logprobs` holds the
    `num_top` most likely tokens plus the sampled one (so up to num_top + 1, as vLLM). An
    entry that is None (the first prompt token, with echo) gives null logprobs.
    """
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token_id, entry in zip(token_ids, logprobs or ()):
        if entry is None:
            text = tokenizer.decode([token_id])
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["text_offset"].append(offset)
            out["top_logprobs"].append(None)
            offset += len(text)
            continue
        text, value = _sampled(entry, token_id, tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["text_offset"].append(offset)
        offset += len(text)
        top = {lp.decoded_token: clamp_logprob(lp.logprob) for lp in _top(entry, num_top)}
        if text not in top and value is not None:
            top[text] = value
        out["top_logprobs"].append(top)
    return out, offset


def _chat_entry(text: str, value: float) -> dict:
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids, logprobs, num_top: int, tokenizer) -> dict:
    """Chat logprobs for these positions: `{"content": [...], "refusal": None}`."""
    content = []
    for token_id, entry in zip(token_ids, logprobs or ()):
        text, value = _sampled(entry, token_id, tokenizer)
        item = _chat_entry(text, -9999.0 if value is None else value)
        item["top_logprobs"] = [_chat_entry(lp.decoded_token, clamp_logprob(lp.logprob))
                                for lp in _top(entry, num_top)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_response(req_id: str, created: int, model: str, choices: list,
                        usage_info: dict) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_info}


def chat_response(req_id: str, created: int, model: str, choices: list,
                  usage_info: dict) -> dict:
    return {"id": req_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_info}


def completion_chunk(req_id: str, created: int, model: str, choice: dict) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_chunk(req_id: str, created: int, model: str, choice: dict) -> dict:
    return {"id": req_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(req_id: str, obj: str, created: int, model: str, usage_info: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices."""
    return {"id": req_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_info}


def error_event(message: str, status: int = 500, err_type: str = "InternalServerError") -> bytes:
    """An error inside a stream (the HTTP status is already 200): one event, then [DONE]."""
    return sse(error_body(status, message, None, err_type))


def exception_event(exc: Exception) -> bytes:
    """What ended a stream, as its error event: a ValueError (a request the engine core
    refused, naming the field) is the client's 400, anything else a 500."""
    if isinstance(exc, ValueError):
        return sse(from_value_error(exc).body())
    return error_event(f"{type(exc).__name__}: {exc}")
