"""Tool calling against a live `tidal serve` (issue 35 section 1), through real clients: the
`openai` package, LangChain's ChatOpenAI.bind_tools and LiteLLM.

One server for the module: a tiny random Qwen3 with a Qwen-style tools template
(`tiny_models.HERMES_TOOLS_TEMPLATE`, given with --chat-template), --tool-call-parser hermes,
--enable-auto-tool-choice, and a KV cache of 69 usable blocks (1,104 tokens) that a batch of these
~900-token prompts overflows, so requests are preempted mid-call and resumed: they share their
~880 tokens of tool definitions (prefix caching), and four running at once overflow the rest.
(With 96 blocks it took about seven at once, which requests arriving a little apart on a busy
machine did not reach: no preemption in a fresh clone beside two busy loops.) Random weights
never write a call on their own; "required" and named choices are forced by the grammar, and
every call that comes back must parse and validate against its function's schema
(jsonschema). "auto" is tested for what it must do here (plain content, no crash); the
parser under "auto" is tested on scripted text in tests/frontend/test_tools.py.
"""

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

from live_server import LiveServer, scrape
from tiny_models import HERMES_TOOLS_TEMPLATE

NAME = "tiny-tools"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9},
    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 120
"""Enough for one forced call of either tool (about 60 tokens with the tiny tokenizer)."""
CHOICES = ["required", {"type": "function", "function": {"name": "add"}},
           {"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("qwen3", max_position_embeddings=2048)
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(HERMES_TOOLS_TEMPLATE)
    srv = LiveServer([model, "--served-model-name", NAME, "--max-model-len", "1088",
                      "--num-gpu-blocks-override", "70", "--max-num-batched-tokens", "2048",
                      "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                      "--chat-template", str(template)]).start()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def check_call(call) -> dict:
    """A returned call, as a dict: it has an id, names a given function, and its arguments
    are a JSON string that validates against that function's schema."""
    call = call if isinstance(call, dict) else call.model_dump()
    assert call["id"] and call["type"] == "function"
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return call


def forced(client, choice, parallel=False, **kwargs):
    return client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
        parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=0, **kwargs)


@pytest.fixture(scope="module")
def answers(client) -> dict:
    """The greedy answer of each forced choice (parallel_tool_calls false), by its name."""
    return {json.dumps(choice): forced(client, choice) for choice in CHOICES}


def test_forced_choices_return_calls_that_validate(client, answers):
    for choice in CHOICES:
        r = answers[json.dumps(choice)]
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert message.tool_calls, (choice, message)
        (call,) = [check_call(c) for c in message.tool_calls]  # the grammar ends after one
        assert finish == "tool_calls" and message.content is None
        if isinstance(choice, dict):
            assert call["function"]["name"] == choice["function"]["name"]
    r = forced(client, "required", parallel=True)  # one call or more, each one valid
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    for call in r.choices[0].message.tool_calls:
        check_call(call)


def test_streamed_tool_calls_equal_the_plain_answer(client, answers):
    plain = answers[json.dumps("required")].choices[0].message.tool_calls
    chunks = list(forced(client, "required", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: id, type and name
                assert delta.type == "function" and delta.index not in calls
                calls[delta.index] = {"id": delta.id, "type": "function", "function": {
                    "name": delta.function.name, "arguments": ""}}
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    streamed = [check_call(calls[i]) for i in sorted(calls)]
    assert [c["function"] for c in streamed] == [c.function.model_dump() for c in plain]


def test_none_and_auto_answer_with_content(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                           tool_choice=choice, max_tokens=4, temperature=0)
        message = r.choices[0].message
        assert message.tool_calls is None and isinstance(message.content, str)
        assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content


def test_a_tool_result_goes_back_through_the_template(client, server, answers):
    first = answers[json.dumps(CHOICES[2])]
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(
        model=NAME, messages=history, tools=TOOLS, max_tokens=1, temperature=0,
        tool_choice="none", extra_body={"return_token_ids": True})
    prompt = httpx.post(server.base_url + "/detokenize", json={
        "tokens": second.model_extra["prompt_token_ids"]}).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' \
        in prompt  # the arguments rendered as JSON once (not a quoted string)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    declared = prompt.split("<tools>\n")[1].split("\n</tools>")[0]
    assert '"name": "add"' in declared  # tools= reached the template


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice",
     "'sub' has not been passed"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": "zero"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "does not compile"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, words):
    request = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}
    for stream in (False, True):
        r = httpx.post(server.base_url + "/v1/chat/completions",
                       json={**request, "stream": stream}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and words in error["message"]


def test_forced_calls_validate_under_batching_and_preemption(client, server):
    """Eight sampled requests at once over a KV cache that holds about two of them: every
    call validates, whichever request was preempted and recomputed mid-call."""
    before = scrape(server)[0].get("tidal:num_preemptions_total", 0)

    def one(i: int):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"Question {i}: add {i} and 1"}],
            tools=TOOLS, tool_choice=CHOICES[i % 3], parallel_tool_calls=False,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sampled = list(pool.map(one, range(8)))
    for r in sampled:
        assert r.choices[0].message.tool_calls
        for call in r.choices[0].message.tool_calls:
            check_call(call)
    assert scrape(server)[0]["tidal:num_preemptions_total"] > before


def test_langchain_agent_loop_of_two_tool_calls(server):
    from typing import Annotated, Literal

    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import Field
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    digit = Annotated[int, Field(ge=0, le=9)]  # bounded: random weights never stop a number

    @tool
    def add(a: digit, b: digit) -> int:
        """Add two digits."""
        return a + b

    @tool
    def get_weather(city: Literal["Paris", "Oslo"],
                    unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    tools = {"add": add, "get_weather": get_weather}
    llm = ChatOpenAI(model=NAME, base_url=server.base_url + "/v1", api_key="none",
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    messages = [HumanMessage("Add 2 and 3, then tell me the weather in Paris.")]
    for name in ("add", "get_weather"):  # each turn forces the next call of the agent's plan
        ai = llm.bind_tools([add, get_weather], tool_choice=name,
                            parallel_tool_calls=False).invoke(messages)
        assert [c["name"] for c in ai.tool_calls] == [name] and not ai.invalid_tool_calls
        call = ai.tool_calls[0]
        messages += [ai, ToolMessage(str(tools[name].invoke(call["args"])),
                                     tool_call_id=call["id"])]
    final = llm.bind_tools([add, get_weather]).invoke(messages, max_tokens=4)  # auto
    assert isinstance(final.content, str) and len(messages) == 5


def test_litellm_completion_with_tools(server, monkeypatch):
    # LiteLLM fetches a price list from GitHub when imported, unless told to use its own copy
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    kwargs = dict(model=f"openai/{NAME}", api_base=server.base_url + "/v1", api_key="none",
                  messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    r = litellm.completion(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    check_call({"id": call.id, "type": call.type, "function": {
        "name": call.function.name, "arguments": call.function.arguments}})
    arguments = ""
    for chunk in litellm.completion(**kwargs, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            arguments += delta.function.arguments or ""
    assert json.loads(arguments) == json.loads(call.function.arguments)
