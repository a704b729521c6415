"""The HTTP layer alone: FastAPI app + fake engine (no engine core), via TestClient."""

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.protocol import ChatCompletionResponse, CompletionResponse


def make_client(engine, **settings) -> TestClient:
    async def factory():
        return engine

    return TestClient(build_app(factory, ServerSettings(**settings)))


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON objects (and the string '[DONE]')."""
    assert text.endswith("data: [DONE]\n\n")
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ------------------------------------------------------------------ completions


def test_completion_shape_usage_and_n(client, engine):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello world",
                                             "max_tokens": 5, "n": 2})
    assert r.status_code == 200, r.text
    body = CompletionResponse.model_validate(r.json())
    assert [c.index for c in body.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in body.choices)
    prompt_len = len(engine.tokenizer.encode("hello world", add_special_tokens=False))
    assert body.usage.prompt_tokens == prompt_len
    assert body.usage.completion_tokens == 10
    assert body.usage.total_tokens == prompt_len + 10
    assert body.id.startswith("cmpl-") and body.model == "fake-model"


def test_completion_prompt_list_and_token_ids(client, engine):
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3,
                                             "n": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["prompt_token_ids"] == [[5, 6, 7], [8, 9]]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    prompts = sorted(v[0] for v in engine.generated.values())
    assert prompts == [[5, 6, 7], [8, 9]]
    choice = body["choices"][2]  # prompt 1, completion 0
    assert engine.tokenizer.decode(choice["token_ids"]) == choice["text"]


def test_completion_sampling_params_reach_the_engine(tokenizer):
    engine = FakeEngine(tokenizer, scheduling_policy="priority")
    with make_client(engine) as client:
        r = client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
            "min_p": 0.1, "seed": 3, "stop": "xyz", "stop_token_ids": [1], "ignore_eos": True,
            "min_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "priority": -3, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "user": "u1", "some_unknown_field": 1})
    assert r.status_code == 200, r.text
    (_, params, priority), = engine.generated.values()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.1)
    assert params.seed == 3 and params.stop == ["xyz"] and params.stop_token_ids == [1]
    assert params.ignore_eos and params.min_tokens == 2 and params.repetition_penalty == 1.2
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert priority == -3


def test_completion_echo_with_logprobs_leads_with_the_prompt(client, engine):
    """OpenAI / vLLM: echo + logprobs gives the prompt's tokens and logprobs, then the
    completion's; the first prompt token has null logprob and top_logprobs; offsets run over
    the whole text. The engine is asked for prompt logprobs with the same top count."""
    prompt = [30, 31, 32]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                             "logprobs": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    (_, params, _), = engine.generated.values()
    assert params.prompt_logprobs == 1 and params.logprobs == 1
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    tok = engine.tokenizer
    assert lp["tokens"] == [tok.decode([t]) for t in prompt + choice["token_ids"]]
    assert lp["token_logprobs"][:3] == [None, -0.5, -0.5]  # the fake's prompt entries
    assert lp["token_logprobs"][3:] == [-0.25, -0.25]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert choice["text"] == "".join(lp["tokens"])
    assert len(choice["token_ids"]) == 2  # return_token_ids: the completion's own ids

    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                             "logprobs": 0, "stream": True})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    first, second = (c["choices"][0]["logprobs"] for c in chunks)
    assert first["token_logprobs"][:3] == [None, -0.5, -0.5] and len(first["tokens"]) == 4
    assert second["text_offset"][0] == sum(len(t) for t in first["tokens"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


@pytest.mark.parametrize("path,payload", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stream": True}),
])
def test_priority_under_fcfs_is_a_400(client, engine, path, payload):
    """As vLLM: a priority other than 0 needs --scheduling-policy priority; a 400 naming the
    field, before admission (a stream gets a real status too), and nothing reaches the
    engine. Priority 0 is everyone's default and passes."""
    r = client.post(path, json={**payload, "priority": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert not engine.generated
    assert client.app.state.serving.admission.num_ours() == 0
    assert client.post(path, json={**payload, "priority": 0}).status_code == 200


def test_completion_echo_and_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("hello")
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert lp["token_logprobs"] == [-0.25] * 3
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]


def test_completion_stream_with_usage(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "n": 2,
                                             "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    chunks = events[:-2]
    assert len(chunks) == 8 and all(c["usage"] is None for c in chunks)
    texts = {0: "", 1: ""}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        assert c["object"] == "text_completion"
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert texts[0] and texts[1] and texts[0] != texts[1]


def test_completion_stream_logprob_offsets_continue(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 0,
                                             "stream": True})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks]
    tokens = [c["choices"][0]["logprobs"]["tokens"][0] for c in chunks]
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


# ------------------------------------------------------------------ chat


def test_chat_uses_the_template_and_returns_shape(client, engine):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                             {"type": "text", "text": "there"}]}]
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages,
                                                  "max_completion_tokens": 3, "logprobs": True,
                                                  "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert body.object == "chat.completion" and body.id.startswith("chatcmpl-")
    assert body.choices[0].message.role == "assistant"
    content = body.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == body.choices[0].message.content
    (prompt_ids, params, _), = engine.generated.values()
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
        tokenize=False, add_generation_prompt=True)
    assert engine.tokenizer.decode(prompt_ids) == expected
    assert params.max_tokens == 3 and params.logprobs == 2


def test_chat_stream_role_first_then_content(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    chunks = events[:-2]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert events[-2]["usage"]["completion_tokens"] == 6
    finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1]


def test_chat_max_tokens_default_is_unbounded(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": "hi"}]})
    assert r.status_code == 200
    (_, params, _), = engine.generated.values()
    assert params.max_tokens is None


# ------------------------------------------------------------------ other endpoints


def test_models_health_version_tokenize(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == 64
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    tok = client.post("/tokenize", json={"prompt": "hello world",
                                         "return_token_strs": True}).json()
    assert tok["tokens"] == engine.tokenizer.encode("hello world")
    assert tok["count"] == len(tok["tokens"]) and len(tok["token_strs"]) == tok["count"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert engine.tokenizer.decode(chat.json()["tokens"]).startswith("<|user|>")
    detok = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "hello world"


def test_health_503_when_engine_dead(client, engine):
    engine.dead = True
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_served_model_name_override(engine):
    with make_client(engine, served_model_names=["alias"]) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "alias"
        assert c.post("/v1/completions", json={"model": "alias", "prompt": "x"}).json()[
            "model"] == "alias"
        assert c.post("/v1/completions", json={"model": "fake-model",
                                               "prompt": "x"}).status_code == 404


def test_engine_error_is_500_or_error_event(tokenizer):
    engine = FakeEngine(tokenizer, fail_with="worker died")
    with make_client(engine) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and "worker died" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "worker died" in events[-2]["error"]["message"]


def test_a_request_the_engine_refuses_is_a_400_naming_the_field(tokenizer):
    """The engine core refused the request (bad input it found): a client error, 400 with
    the field as param, or, once a stream has started, an error event with code 400."""
    engine = FakeEngine(tokenizer, refuse_with="stop_token_ids must be token ids in [0, 9]")
    with make_client(engine) as c:
        for path, body in [("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}]})]:
            r = c.post(path, json={**body, "max_tokens": 2})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "stop_token_ids", r.text
            assert error["type"] == "BadRequestError" and "[0, 9]" in error["message"]
            r = c.post(path, json={**body, "max_tokens": 2, "stream": True})
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 400
            assert events[-2]["error"]["param"] == "stop_token_ids"


# ------------------------------------------------------------------ auth, metrics


def test_api_key(engine):
    with make_client(engine, api_key="sekret") as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = c.post("/v1/completions", json={"prompt": "x"},
                   headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert c.get("/v1/models").status_code == 401
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        r = c.post("/v1/completions", json={"prompt": "x"},
                   headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_metrics_page_parses_and_moves(client, engine):
    def scrape():
        text = client.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples}

    engine.stats.generation_tokens = 11
    engine.stats.kv_cache_usage = 0.25
    before = scrape()
    assert before["tidal:generation_tokens_total"] == 11
    assert before["tidal:kv_cache_usage_perc"] == 0.25
    assert before.get("tidal:time_to_first_token_seconds_count", 0) == 0
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    after = scrape()
    assert after["tidal:time_to_first_token_seconds_count"] == 1
    assert after["tidal:e2e_request_latency_seconds_count"] == 1
    assert after["tidal:inter_token_latency_seconds_count"] == 2
    assert after["tidal:request_queue_time_seconds_count"] == 1
    assert after["tidal:request_success_total"] == 1
    for name in ["num_requests_running", "num_requests_waiting", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total"]:
        assert "tidal:" + name in after


def test_metrics_never_carry_the_model_path(tokenizer):
    """A model served without --served-model-name is served under its path (vLLM's
    default); the metrics label it with the path's last component, so a scrape does not tell
    where the server's files are. The API name is unchanged, and a plain served name
    ("org/model", not a path) is the label as it is."""
    engine = FakeEngine(tokenizer)
    engine.model_name = "/srv/models/llama-3-8b/"
    with make_client(engine) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "/srv/models/llama-3-8b/"
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code \
            == 200
        text = c.get("/metrics").text
    labels = {s.labels.get("model_name") for f in text_string_to_metric_families(text)
              for s in f.samples}
    assert labels == {"llama-3-8b"} and "/srv" not in text
    with make_client(FakeEngine(tokenizer), served_model_names=["org/model"]) as c:
        assert 'model_name="org/model"' in c.get("/metrics").text
