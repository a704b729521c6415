"""Tool calling's parts alone (frontend/tools): each parser on scripted model text, whole and
streamed in every split, the grammar of each format and choice (what it accepts and refuses,
by xgrammar's own matcher), and the request checks. The live server's tests are
tests/e2e/test_tool_calling.py."""

import json

import pytest

from tidal.frontend.tools import (
    TOOL_PARSERS, FunctionTool, ToolChoice, ToolSettings, get_tool_parser, plan_tools,
    template_messages, to_chunks, tool_call_grammar,
)
from tidal.frontend.tools.options import load_chat_template
from tidal.frontend.tools.request import field_of

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [FunctionTool("get_weather", "Weather of a city", WEATHER), FunctionTool("add", None, ADD)]
RAW_TOOLS = [t.to_openai() for t in TOOLS]

# (parser, model text, expected content, expected [(name, arguments)])
SCRIPTS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>', "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
     "</tool_call>", None, [("add", {"a": 1, "b": 2}),
                            ("get_weather", {"city": "Oslo", "unit": "c"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),  # ended on EOS before the closing tag
    ("hermes", 'A.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
     '<tool_call>\n{"name": "ad', "A.", [("add", {"a": 1, "b": 2})]),  # cut by max_tokens
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>",
     []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Lima"}}]', "Sure.",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Lima"})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]'
     '{"city": "Lima"}', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Lima"})]),
    ("mistral", "Plain [text] here.", "Plain [text] here.", []),
    ("pythonic", "[get_weather(city='Paris', unit='c'), add(a=1, b=2)]", None,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    ("pythonic", "<|python_start|>[add(a=1, b=2)]<|python_end|>", None,
     [("add", {"a": 1, "b": 2})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("json_list", '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', None,
     [("add", {"a": 1, "b": 2})]),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", SCRIPTS)
def test_extract(name, text, content, calls):
    extracted = get_tool_parser(name).extract(text)
    assert extracted.content == content
    assert _calls(extracted.calls) == calls


@pytest.mark.parametrize("name,text,content,calls", SCRIPTS)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_releases_what_extract_finds(name, text, content, calls, step):
    """Fed in pieces of `step` characters, the stream releases the same content (never a
    piece of a call) and the same calls as `extract` on the whole text."""
    stream = get_tool_parser(name).stream()
    released, found = "", []
    for i in range(0, len(text), step):
        out = stream.feed(text[i:i + step])
        released += out.content
        found += out.calls
    out = stream.finish()
    released += out.content
    found += out.calls
    assert (released or None) == content
    assert _calls(found) == calls


def test_stream_holds_back_a_marker_prefix_and_releases_a_hermes_call_when_it_closes():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool").content == "Hi "  # "<tool" may open a call
    out = stream.feed('_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert out.content == "" and out.calls == []
    out = stream.feed("</tool_call>")
    assert _calls(out.calls) == [("add", {"a": 1, "b": 2})]
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("a <t").content == "a " and stream.feed("> c").content == "<t> c"


def test_openai_stream_chunks():
    call = get_tool_parser("hermes").extract(
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>').calls[0]
    assert to_chunks([call], 2) == [
        {"index": 2, "id": call.id, "type": "function",
         "function": {"name": "add", "arguments": ""}},
        {"index": 2, "function": {"arguments": '{"a": 1}'}}]
    assert call.id.startswith("call_") and call.to_openai()["type"] == "function"


# ---------------------------------------------------------------------------------------------
# the grammar


def _accepts(grammar: str, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text)


HERMES_CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
GOOD = {  # parser: (one call of add, two calls, a call whose arguments break add's schema)
    "hermes": (HERMES_CALL.format("add", '{"a": 1, "b": 2}'),
               HERMES_CALL.format("add", '{"a": 1, "b": 2}') + "\n"
               + HERMES_CALL.format("get_weather", '{"city": "x"}'),
               HERMES_CALL.format("add", '{"a": "one", "b": 2}')),
    "llama3_json": ('{"name": "add", "parameters": {"a": 1, "b": 2}}',
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "x"}}',
                    '{"name": "add", "parameters": {"a": 1}}'),
    "mistral": ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "x"}}]',
                '[TOOL_CALLS][{"name": "sub", "arguments": {"a": 1, "b": 2}}]'),
    "json_list": ('[{"name": "add", "parameters": {"a": 1, "b": 2}}]',
                  '[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
                  '{"name": "get_weather", "parameters": {"city": "x"}}]',
                  '[{"name": "add", "parameters": {"a": 1, "b": 2, "c": 3}}]'),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_grammar_of_each_choice(name):
    one, two, invalid = GOOD[name]
    parser = get_tool_parser(name)
    grammar = {mode: tool_call_grammar(parser, TOOLS, ToolChoice(mode, "add" if mode == "named"
                                                                  else None)).grammar
               for mode in ("required", "named")}
    assert _accepts(grammar["required"], one) and _accepts(grammar["required"], two)
    assert _accepts(grammar["named"], one) and not _accepts(grammar["named"], two)
    for g in grammar.values():
        assert not _accepts(g, invalid) and not _accepts(g, "Hello")
        assert not _accepts(g, "Hello " + one)  # no text before a forced call
    single = tool_call_grammar(parser, TOOLS, ToolChoice("required"), parallel=False).grammar
    assert _accepts(single, one) and not _accepts(single, two)
    if name == "json_list":  # no trigger: "auto" is unconstrained
        assert tool_call_grammar(parser, TOOLS, ToolChoice("auto")) is None
        return
    auto = tool_call_grammar(parser, TOOLS, ToolChoice("auto")).grammar
    assert _accepts(auto, "Just text, no call.") and _accepts(auto, one)
    assert not _accepts(auto, invalid)  # once the trigger is written, the schema holds
    assert tool_call_grammar(parser, TOOLS, ToolChoice("none")) is None
    for text in (one, two):  # and the parser reads back what the grammar allows
        assert [c.name for c in parser.extract(text).calls][0] == "add"


def test_pythonic_has_no_grammar_of_its_own():
    plan = plan_tools(ToolSettings(True, "pythonic"), RAW_TOOLS, "required")
    assert plan.parser.name == "json_list" and plan.constraint() is not None
    assert plan_tools(ToolSettings(True, "pythonic"), RAW_TOOLS, "auto").constraint() is None


def test_a_schema_xgrammar_cannot_compile_names_the_tool():
    bad = [RAW_TOOLS[0], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]
    plan = plan_tools(ToolSettings(), bad, "required")
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters does not compile"):
        plan.constraint()


# ---------------------------------------------------------------------------------------------
# the request's checks


@pytest.mark.parametrize("settings,tools,choice,field,words", [
    (ToolSettings(), RAW_TOOLS, None, "tool_choice", "--enable-auto-tool-choice"),
    (ToolSettings(), RAW_TOOLS, "auto", "tool_choice", "--enable-auto-tool-choice"),
    (ToolSettings(), RAW_TOOLS, {"type": "function", "function": {"name": "nope"}},
     "tool_choice", "'nope' has not been passed"),
    (ToolSettings(), RAW_TOOLS, "sometimes", "tool_choice", "must be"),
    (ToolSettings(), None, "required", "tool_choice", "needs `tools`"),
    (ToolSettings(), [{"type": "retrieval"}], "required", "tools[0]", "function"),
    (ToolSettings(), [{"type": "function", "function": {"name": "a b"}}], "required",
     "tools[0].function.name", "letters"),
    (ToolSettings(), [RAW_TOOLS[0], RAW_TOOLS[0]], "required", "tools[1]", "two tools"),
])
def test_bad_tools_name_their_field(settings, tools, choice, field, words):
    with pytest.raises(ValueError) as info:
        plan_tools(settings, tools, choice)
    assert field_of(info.value) == field and words in str(info.value)


def test_plans():
    assert plan_tools(ToolSettings(), None, None) is None
    assert plan_tools(ToolSettings(), None, "none") is None
    none = plan_tools(ToolSettings(), RAW_TOOLS, "none")
    assert not none.active and none.template_tools == RAW_TOOLS and none.constraint() is None
    named = plan_tools(ToolSettings(), RAW_TOOLS, {"type": "function", "function": {
        "name": "add"}})
    assert named.parser.name == "json_list"  # no --tool-call-parser: vLLM's JSON form
    auto = plan_tools(ToolSettings(True, "hermes"), RAW_TOOLS, None, parallel_tool_calls=False)
    assert auto.choice.mode == "auto" and auto.parser.name == "hermes"
    two = HERMES_CALL.format("add", "{}") + HERMES_CALL.format("add", "{}")
    assert len(auto.extract(two).calls) == 1  # parallel_tool_calls false: the first only


def test_settings_and_template_option(tmp_path):
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolSettings(auto=True)
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'"):
        ToolSettings(parser="qwen")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_template_messages_turn_arguments_into_objects():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1] == messages[1] and messages[0]["tool_calls"][0]["function"]["arguments"] \
        == '{"a": 1}'  # the request's own message is left as it was
