"""/v1/responses on the HTTP layer alone (FastAPI app + fake engine, via TestClient): the
shapes parse as the `openai` package's types, the typed event stream, the store (LRU, GET,
DELETE, previous_response_id, 404s) and the 400s that name what is not supported."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.response_store import ResponseStore, StoredResponse

EVENTS = TypeAdapter(ResponseStreamEvent)


def make_client(engine, **settings) -> TestClient:
    async def factory():
        return engine

    return TestClient(build_app(factory, ServerSettings(**settings)))


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_model_len=256)


@pytest.fixture(scope="module")
def client(engine):
    with make_client(engine, responses_store_size=3) as c:
        yield c


def create(client, **body) -> dict:
    r = client.post("/v1/responses", json={"max_output_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events_of(text: str) -> list:
    """The typed events of a stream body (`event: T` then `data: {...}` per event)."""
    events = []
    for block in filter(None, text.split("\n\n")):
        head, data = block.split("\n", 1)
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        events.append(event)
    return events


def test_plain_response_parses_as_the_openai_type(client):
    body = create(client, input="hello world", instructions="Be brief", metadata={"k": "v"})
    resp = OpenAIResponse.model_validate(body)
    assert resp.object == "response" and resp.model == "fake-model"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert resp.output_text and resp.usage.output_tokens == 4
    assert resp.usage.total_tokens == resp.usage.input_tokens + 4
    assert resp.instructions == "Be brief" and resp.metadata == {"k": "v"}


def test_prompt_is_the_chat_template_of_instructions_and_input(client, engine, tokenizer):
    before = set(engine.generated)
    create(client, input=[{"role": "developer", "content": "sys"},
                          {"type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": "hi"},
                                       {"type": "input_text", "text": " there"}]}],
           instructions="rules")
    (new,) = set(engine.generated) - before
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "rules"}, {"role": "system", "content": "sys"},
         {"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True)
    assert engine.generated[new][0] == tokenizer.encode(expected, add_special_tokens=False)


def test_stream_is_typed_events_numbered_in_order(client):
    r = client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 5,
                                           "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    assert final.usage.output_tokens == 5
    # the streamed response was stored as it ended
    stored = client.get(f"/v1/responses/{final.id}").json()
    assert OpenAIResponse.model_validate(stored).output_text == deltas


def test_previous_response_id_continues_the_conversation(client, engine, tokenizer):
    first = create(client, input="one", instructions="not inherited")
    before = set(engine.generated)
    second = create(client, input="two", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    (new,) = set(engine.generated) - before
    text = first["output"][0]["content"][0]["text"]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "one"}, {"role": "assistant", "content": text},
         {"role": "user", "content": "two"}], tokenize=False, add_generation_prompt=True)
    assert engine.generated[new][0] == tokenizer.encode(expected, add_special_tokens=False)


def test_function_call_items_feed_the_template(client, engine, tokenizer):
    before = set(engine.generated)
    create(client, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    (new,) = set(engine.generated) - before
    # the tiny template writes role and content: the call's message is empty, the output's
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
         {"role": "tool", "content": "sunny"}], tokenize=False, add_generation_prompt=True)
    assert engine.generated[new][0] == tokenizer.encode(expected, add_special_tokens=False)


def test_get_delete_store_false_and_lru(client):
    ids = [create(client, input=f"n{i}")["id"] for i in range(3)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 200  # now the most recent
    ids.append(create(client, input="n3")["id"])  # the store holds 3: drops ids[1]
    assert client.get(f"/v1/responses/{ids[1]}").status_code == 404
    assert [client.get(f"/v1/responses/{i}").status_code for i in ids[2:]] == [200, 200]
    r = client.delete(f"/v1/responses/{ids[0]}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert client.delete(f"/v1/responses/{ids[0]}").status_code == 404
    unstored = create(client, input="x", store=False)["id"]
    assert client.get(f"/v1/responses/{unstored}").status_code == 404
    r = client.post("/v1/responses", json={"input": "y", "previous_response_id": unstored})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_an_id_of_another_http_process_is_a_404_that_says_so(client):
    r = client.get("/v1/responses/resp_3_0123abcd")
    assert r.status_code == 404
    assert "made by HTTP process 3 and this is process 0" in r.json()["error"]["message"]


def test_store_unit_lru_and_size_zero():
    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}"}))
    assert store.get("r0") is None and len(store) == 2
    assert store.get("r1") is not None
    store.put(StoredResponse({"id": "r3"}))  # r2 is now the least recently used
    assert store.get("r2") is None and store.get("r1") is not None
    empty = ResponseStore(0)
    empty.put(StoredResponse({"id": "r"}))
    assert empty.get("r") is None
    with pytest.raises(ValueError, match="--responses-store-size"):
        ResponseStore(-1)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search' is not supported"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type",
     "function tools only"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "not supported"),
    ({"background": True}, "background", "background mode is not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning items"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type",
     "'reasoning' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "not supported"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role", "must be one of"),
    ({"input": []}, "input", "must not be empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice",
     "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "name": "a b"}], "tool_choice": "none"}, "tools.0.name",
     "tools[0].name must be"),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "'g'"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format", "cannot be combined"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "got 'xml'"),
    ({"text": {"format": {"type": "json_schema", "name": "s",
                          "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "text.format", "text.format"),
    ({"truncation": "auto"}, "truncation", "'auto' is not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"max_output_tokens": 10_000}, "max_output_tokens", "maximum context length"),
    ({"model": "other"}, "model", "does not exist"),
])
def test_unsupported_or_bad_input_is_a_400_naming_it(client, body, param, words):
    r = client.post("/v1/responses", json={"input": "hi", **body})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_text_format_json_schema_is_echoed_and_reaches_the_engine(client, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    before = set(engine.generated)
    body = create(client, input="hi", text={"format": {"type": "json_schema", "name": "s",
                                                       "schema": schema}})
    (new,) = set(engine.generated) - before
    assert json.loads(engine.generated[new][1].structured_outputs.json) == schema
    assert OpenAIResponse.model_validate(body).text.format.type == "json_schema"


# ------------------------------------------------------------------ fuzz: never a 5xx

_scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=6)
            | st.sampled_from(["tiny", "\ud800", "user", "function", "message", "required",
                               "input_text", "function_call", "json_schema", "c1"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "name", "call_id", "arguments",
                     "output", "parameters", "format", "schema", "effort"]), inner,
    max_size=4), max_leaves=10)
_FIELDS = ["input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
           "tool_choice", "parallel_tool_calls", "text", "store", "previous_response_id",
           "metadata", "truncation", "reasoning", "include", "seed", "stream"]
_good = {"input": st.just("hi"), "max_output_tokens": st.integers(1, 4)}
_bodies = st.fixed_dictionaries({}, optional={name: _good.get(name, _values) | _values
                                              for name in _FIELDS})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies)
def test_no_body_gets_a_server_error(client, body):
    payload = json.dumps(body, ensure_ascii=True).encode()  # surrogates travel as escapes
    r = client.post("/v1/responses", content=payload,
                    headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]
