"""Issue 38 items 4 and 5 at the HTTP layer (fake engine): what tidal does not serve is
answered with a 4xx that says "not supported" (unknown endpoints, image / audio content
parts, legacy `functions=`, audio output) instead of a bare `Not Found`, a pydantic dump or
silence; the loading state answers 503; JSON constraints are compact by default."""

import pytest
from fastapi.testclient import TestClient

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.serving import compact_json
from tidal.frontend.server.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def client(tokenizer):
    engine = FakeEngine(tokenizer)
    if not hasattr(engine.engine_info, "max_lora_rank"):
        engine.engine_info.max_lora_rank = 0

    async def factory():
        return engine

    with TestClient(build_app(factory, ServerSettings())) as c:
        yield c


def _chat(client, **fields):
    body = {"model": "/models/fake", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/images/generations",
                                  "/v1/no-such-thing"])
def test_an_endpoint_tidal_lacks_says_not_supported(client, path):
    r = client.post(path, json={})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert f"POST {path} is not supported by tidal" in message
    assert "/v1/chat/completions" in message


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_content_part_other_than_text_says_not_supported(client, part):
    r = _chat(client, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}])
    assert r.status_code == 400
    error = r.json()["error"]
    assert f"content part type {part['type']!r} is not supported" in error["message"]
    assert "text-only" in error["message"]


@pytest.mark.parametrize("fields, what", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions is not supported"),
    ({"function_call": "auto"}, "function_call is not supported"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     "audio output is not supported"),
])
def test_legacy_functions_and_audio_output_say_not_supported(client, fields, what):
    r = _chat(client, **fields)
    assert r.status_code == 400 and what in r.json()["error"]["message"]


def test_loading_answers_503_until_the_engine_is_there(tokenizer):
    import asyncio

    gate = asyncio.Event()

    async def factory():
        await gate.wait()  # never set: the engine core is still loading

    app = build_app(factory, ServerSettings(attach_in_background=True))
    with TestClient(app) as c:
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == \
            "Loading model"
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert r.headers["retry-after"]


def _json_params(**fields):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                **fields)
    params = req.to_sampling_params()
    return req, params


def test_json_constraints_are_compact_unless_asked():
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    req, params = _json_params(response_format=schema)
    compact_json(params, req, any_whitespace=False)
    assert params.structured_outputs.disable_any_whitespace  # compact, as OpenAI writes
    req, params = _json_params(response_format=schema)
    compact_json(params, req, any_whitespace=True)  # --structured-outputs-any-whitespace
    assert not params.structured_outputs.disable_any_whitespace
    # the per-request knob combines with response_format
    req, params = _json_params(response_format=schema,
                               structured_outputs={"disable_any_whitespace": False})
    compact_json(params, req, any_whitespace=False)
    assert params.structured_outputs.kind == "json"
    assert not params.structured_outputs.disable_any_whitespace
    req, params = _json_params(structured_outputs={"regex": "a+"})
    compact_json(params, req, any_whitespace=False)
    assert not params.structured_outputs.disable_any_whitespace  # not JSON: untouched
