"""/v1/responses on a live `tidal serve` of a tiny random model, driven by real clients: the
`openai` package (`client.responses.create`, plain, streamed, continued with
previous_response_id, with function tools) and the OpenAI Agents SDK running a one-tool agent.

One server for the module. Random weights never choose to call a tool, so the tests that need
a call force it (tool_choice "required" or named), where the grammar makes the call parse.
"""

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest

from live_server import ENGINE_FLAGS, LiveServer

pytestmark = pytest.mark.slow  # a live server subprocess (still run by CI)

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = LiveServer([tiny_llama, *ENGINE_FLAGS, "--max-model-len", "512",
                      "--served-model-name", MODEL, "--responses-store-size", "8",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def chat_greedy(client, messages, max_tokens=12) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content


def test_plain_greedy_equals_chat_completions(client):
    r = client.responses.create(model=MODEL, input="Hello world! How are you",
                                instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.status == "incomplete"
    assert r.output_text == chat_greedy(client, [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello world! How are you"}])
    assert r.usage.output_tokens == 12
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_stream_events_equal_the_plain_answer(client):
    plain = client.responses.create(model=MODEL, input="The quick brown fox",
                                    max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=MODEL, input="The quick brown fox",
                                          max_output_tokens=10, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Once upon a time",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input="Tell me more",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_greedy(client, [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Tell me more"}], max_tokens=6)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_required_tool_call_parses_and_validates(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris, and the time?",
                                tools=[WEATHER, TIME], tool_choice="required",
                                max_output_tokens=200, temperature=0)
    assert r.status == "completed" and r.output
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for item in r.output:
        assert item.type == "function_call" and item.call_id
        jsonschema.validate(json.loads(item.arguments), schemas[item.name])
    # the call and its output, fed back: the next answer is text
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER, TIME], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
               for item in r.output], max_output_tokens=4, temperature=0)
    assert follow.output[0].type == "message" and follow.output_text


def test_auto_streams_text_through_the_tool_parser(client):
    """Under "auto" the hermes parser reads the text (random weights write no call): the
    streamed message equals the plain one."""
    kwargs = dict(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=8,
                  temperature=0)
    plain = client.responses.create(**kwargs)
    assert [item.type for item in plain.output] == ["message"]
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].response.output_text == plain.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text


def test_named_tool_call_streams_its_arguments(client):
    events = list(client.responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER, TIME], max_output_tokens=160,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].arguments == done.arguments


def test_openai_agents_sdk_runs_a_one_tool_agent(server):
    from agents import (
        Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
        set_default_openai_client, set_tracing_disabled,
    )

    cities = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none",
                                    max_retries=0, timeout=60)
        set_default_openai_client(client, use_for_tracing=False)
        set_default_openai_api("responses")
        set_tracing_disabled(True)
        agent = Agent(name="weather", instructions="Answer with the weather.",
                      tools=[get_weather], model=MODEL, tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=160))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=2)

    result = asyncio.run(run())
    assert len(cities) == 1 and result.final_output == f"It is sunny in {cities[0]}."
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem",
                                                                  "ToolCallOutputItem"]
