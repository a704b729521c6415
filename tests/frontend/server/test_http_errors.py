"""Bad requests: every one gets a 4xx with the OpenAI error body naming the problem."""

import pytest
from fastapi.testclient import TestClient

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.errors import from_value_error, json_response

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, body or raw bytes, expected status, expected param or None, words in the message)
CASES = [
    (CMPL, b"{not json", 400, None, "Invalid JSON"),
    (CMPL, b"[1, 2]", 400, None, "JSON object"),
    (CMPL, b"", 400, None, ""),
    (CMPL, {}, 400, "prompt", "required"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    (CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than"),
    (CMPL, {"prompt": "x", "top_p": 2}, 400, "top_p", "less than"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ""),
    (CMPL, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", ""),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n", ""),
    (CMPL, {"prompt": "x", "logprobs": 99}, 400, "logprobs", ""),
    (CMPL, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty", "2"),
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "greater"),
    (CMPL, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids.0", ""),
    (CMPL, {"prompt": "x", "stop": ["s"] * 65}, 400, "stop", "at most 64 stop strings"),
    (CHAT, {"messages": MSG, "stop": "s" * 1025}, 400, "stop", "at most 1024 characters"),
    (CMPL, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", ""),
    (CMPL, {"prompt": "x", "model": "gpt-17"}, 404, "model", "gpt-17"),
    (CMPL, {"prompt": "", "max_tokens": 2}, 400, "prompt", "empty"),
    (CMPL, {"prompt": []}, 400, "prompt", "empty"),
    (CMPL, {"prompt": [1, "a"]}, 400, "prompt.1", ""),  # a token-id list: its element 1
    (CMPL, {"prompt": [100000]}, 400, "prompt", "100000"),
    (CMPL, {"prompt": "word " * 80}, 400, "prompt", "64"),
    (CMPL, {"prompt": "x", "max_tokens": 100}, 400, "max_tokens", "64"),
    (CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed", ""),
    (CMPL, {"prompt": "x", "max_tokens": None, "min_tokens": 10**30}, 400, "min_tokens", ""),
    (CMPL, {"prompt": "x", "suffix": "y"}, 400, "suffix", ""),
    (CMPL, {"prompt": "x", "stream": True, "top_k": -5}, 400, "top_k", ""),
    (CHAT, {"messages": []}, 400, "messages", ""),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", ""),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function",
     "must be an object"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     "'g' has not been passed"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice", "--enable-auto-tool-choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
     "tool_choice": "required"}, 400, "tools[0].function.parameters", "does not compile"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 1000}, 400, "max_completion_tokens",
     "64"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content", ""),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", ""),
    ("/tokenize", {}, 400, "prompt", "exactly one"),
    ("/v1/nothing", {}, 404, None, ""),
    # lone surrogates, as JSON escapes (valid JSON, not valid Unicode)
    (CMPL, rb'{"prompt": "\ud800"}', 400, "prompt", "surrogate"),
    (CMPL, rb'{"prompt": ["ok", "\udfff"]}', 400, "prompt.1", "surrogate"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "\ud800"}]}', 400,
     "messages.0.content", "surrogate"),
    (CMPL, rb'{"prompt": "x", "stop": ["\ud800"]}', 400, "stop.0", "surrogate"),
    ("/tokenize", rb'{"prompt": "\ud800"}', 400, "prompt", "surrogate"),
    # issue 13: a lone surrogate in `model` was a 500 (the 404 quoting it could not be encoded)
    (CMPL, rb'{"prompt": "x", "model": "\ud800"}', 400, "model", "surrogate"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "x"}], "model": "\udfff"}', 400,
     "model", "surrogate"),
    ("/tokenize", rb'{"prompt": "x", "model": "\ud800"}', 400, "model", "surrogate"),
    ("/detokenize", rb'{"tokens": [5], "model": "\ud800"}', 400, "model", "surrogate"),
    (CMPL, b'{"prompt": "x", "model": "\xed\xa0\x80"}', 400, "model", "surrogate"),  # raw
    (CHAT, rb'{"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}', 400,
     "messages.0.name", "surrogate"),
    (CHAT, rb'{"messages": [{"role": "\ud800", "content": "x"}]}', 400, "messages.0.role",
     ""),
    # odd but meaningful unicode is accepted; an unused field's surrogate is ignored
    (CMPL, rb'{"prompt": "x\u0000y\uffff", "stop": ["\u0000"], "max_tokens": 2}', 200, None,
     ""),
    (CMPL, rb'{"prompt": "x", "user": "\ud800", "max_tokens": 2}', 200, None, ""),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True, "x": 1},
            "max_tokens": 2}, 200, None, ""),
]


@pytest.fixture(scope="module")
def client(tokenizer):
    engine = FakeEngine(tokenizer)

    async def factory():
        return engine

    with TestClient(build_app(factory, ServerSettings())) as c:
        yield c


@pytest.mark.parametrize("path,body,status,param,words", CASES)
def test_bad_request_gets_openai_error(client, path, body, status, param, words):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    if status == 200:
        return
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param, error
    assert words in error["message"]


def test_wrong_method_and_nan(client):
    r = client.get(CMPL)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = client.post(CMPL, content=b'{"prompt": "x", "temperature": NaN}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_server_still_answers_after_bad_requests(client):
    for path, body, *_ in CASES:
        client.post(path, json=body) if not isinstance(body, bytes) else None
    assert client.post(CMPL, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_error_quoting_a_lone_surrogate_can_still_be_answered():
    """The last line of defence: whatever input an error message quotes, it encodes."""
    err = from_value_error(ValueError("stop_token_ids bad near '\ud800'"))
    body = json_response(err.body(), status=err.status).body
    assert b"\\ud800" in body and err.param == "stop_token_ids"


def test_value_error_param_mapping():
    err = from_value_error(ValueError("logprobs must be in [0, 20], got 30"),
                           {"logprobs": "top_logprobs"})
    assert err.status == 400 and err.param == "top_logprobs"
    assert err.message.startswith("top_logprobs must be")
    assert from_value_error(ValueError("Something odd")).param is None
