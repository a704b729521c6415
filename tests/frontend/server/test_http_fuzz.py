"""Property: whatever JSON arrives, the server answers 200 or a 4xx with the OpenAI error
body; never a 5xx (fake engine, so this runs in seconds)."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed",
          "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "echo",
          "priority", "include_stop_str_in_output", "skip_special_tokens", "user",
          "return_token_ids", "tokens", "logit_bias", "chat_template_kwargs"]

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
           | st.sampled_from(["fake-model", "\ud800", "user", "text"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(["role", "content", "type", "text",
                                                         "include_usage"]), inner, max_size=3),
                      max_leaves=8)
small_ints = st.integers(0, 40)
good_values = {"max_tokens": st.integers(1, 6), "n": st.integers(1, 3),
               "prompt": st.text(min_size=1, max_size=10) | st.lists(small_ints, min_size=1,
                                                                     max_size=5),
               "messages": st.just([{"role": "user", "content": "hi"}])}
bodies = st.fixed_dictionaries({}, optional={name: good_values.get(name, values) | values
                                             for name in FIELDS})


@pytest.fixture(scope="module")
def client(tokenizer):
    engine = FakeEngine(tokenizer)

    async def factory():
        return engine

    with TestClient(build_app(factory, ServerSettings(max_num_queued_reqs=8))) as c:
        yield c


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                          "/tokenize", "/detokenize"]))
def test_no_body_gets_a_server_error(client, body, path):
    payload = json.dumps(body, ensure_ascii=True).encode()  # surrogates travel as escapes
    r = client.post(path, content=payload, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]
