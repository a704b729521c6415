"""Tool calling with a real model: SmolLM2-135M-Instruct (the pinned Q4_1 GGUF of
`real_models.smollm2_gguf`) served by `tidal serve` with `real_models.SMOLLM2_TOOLS_TEMPLATE`
(--chat-template), --tool-call-parser hermes and --enable-auto-tool-choice, through the
`openai` client. Forced calls parse and validate against free-form schemas (strings the
model has to close itself), alone and batched; a tool result goes back and the model answers
in text; under "auto" whatever comes back is either text or calls that validate.

Marked `real_model` (the first run downloads ~93 MB): deselect offline with
`-m "not real_model"`.
"""

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from live_server import LiveServer
from real_models import SMOLLM2_TOOLS_TEMPLATE, real_model_cache, smollm2_gguf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

NAME = "smollm2"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
QUESTIONS = ["What is the weather like in Paris today?", "What time is it in Tokyo?",
             "Is it raining in London?", "Tell me the weather in Lima in fahrenheit."]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "smollm2_tools.jinja"
    template.write_text(SMOLLM2_TOOLS_TEMPLATE)
    gguf = smollm2_gguf()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", real_model_cache())  # the conversion is kept
        server = LiveServer([gguf, "--served-model-name", NAME, "--max-model-len", "1024",
                             "--kv-cache-memory", "64MiB", "--tool-call-parser", "hermes",
                             "--enable-auto-tool-choice", "--chat-template", str(template)])
    server.start(timeout=600)
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    assert server.stop() == 0, server.output()[-3000:]


def ask(client, question: str, **kwargs):
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": question}], tools=TOOLS,
        temperature=0, max_tokens=80, **kwargs)


def check_calls(message) -> list:
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls or []


def test_forced_calls_batched_validate_and_a_result_goes_back(client):
    choices = ["required", {"type": "function", "function": {"name": "get_weather"}},
               {"type": "function", "function": {"name": "get_time"}}, "required"]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda qc: ask(client, qc[0], tool_choice=qc[1],
                                               parallel_tool_calls=False),
                                zip(QUESTIONS, choices)))
    for answer, choice in zip(answers, choices):
        (call,) = check_calls(answer.choices[0].message)
        assert answer.choices[0].finish_reason == "tool_calls"
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"]
    first = answers[1].choices[0].message
    history = [{"role": "user", "content": QUESTIONS[1]}, first,
               {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    final = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=24)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_auto_answers_text_or_valid_calls(client):
    for question in QUESTIONS[:2]:
        message = ask(client, question).choices[0].message
        assert message.content or check_calls(message)
