"""The grammar that makes tool calls valid: the tools' JSON schemas in the parser's format.

`tool_call_grammar(parser, tools, choice, parallel)` builds an xgrammar structural tag (its
JSON form) and turns it into EBNF text, sent to the workers as an ordinary
`StructuredOutputsParams(grammar=...)`: the wire, the engine core and the workers' matchers
are structured output's, unchanged (workers/structured_output.py). xgrammar is imported here
inside functions only (it imports torch).

What each choice constrains (`parallel` false: at most one call):

    named     exactly one call of that function, in the parser's format, then only EOS
    required  one or more calls (no text around them), then only EOS
    auto      free text; once the model writes the parser's trigger (`<tool_call>`,
              `[TOOL_CALLS]`, `{"name": `) the call must follow, with a declared name and
              arguments matching that function's schema; then free text again
    none      nothing (no grammar)

Formats (the parts a structural tag `tag` fixes; ARGS is the function's `parameters` schema):

    hermes       <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>, "\\n" between
    llama3_json  {"name": "NAME", "parameters": ARGS}, "; " between
    mistral      [TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]
    json_list    [{"name": "NAME", "parameters": ARGS}, ...]   (required / named under pythonic
                 or no parser; pythonic has no grammar, so its "auto" is unconstrained)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...ipc.grammar import _xgrammar_message
from ...ipc.messages import StructuredOutputsParams
from .parsers import (
    HermesParser, JsonListParser, Llama3JsonParser, MistralParser, ToolParser,
)


MAX_WHITESPACE = 4
"""Most whitespace characters in a row inside a call's arguments: room for compact and lightly
indented JSON, while a model that rambles spaces (random weights do) cannot fill its budget
with them between two tokens of JSON."""


@dataclass(frozen=True)
class FunctionTool:
    """One function a request offers the model (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    """Its arguments' JSON schema (None: any JSON object)."""

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object"}

    def to_openai(self) -> dict:
        """As the chat template receives it (`tools=` of HF templates)."""
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: mode "none" | "auto" | "required" | "named" (then `name`)."""

    mode: str
    name: str | None = None


@dataclass(frozen=True)
class _Format:
    """A call's fixed text around its arguments, and the text around a list of calls."""

    begin: str  # with {name} for the function's name
    end: str
    separator: str
    trigger: str | None  # what starts a call in free text ("auto"); None: no auto grammar
    open: str = ""  # before the first call of a list
    close: str = ""  # after the last


_FORMATS: dict[type, _Format] = {
    HermesParser: _Format('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>",
                          "\n", "<tool_call>"),
    Llama3JsonParser: _Format('{{"name": "{name}", "parameters": ', "}", "; ", '{"name": '),
    MistralParser: _Format('{{"name": "{name}", "arguments": ', "}", ", ", "[TOOL_CALLS]",
                           open="[TOOL_CALLS][", close="]"),
    JsonListParser: _Format('{{"name": "{name}", "parameters": ', "}", ", ", None,
                            open="[", close="]"),
}


def grammar_parser(parser: ToolParser | None, choice: ToolChoice) -> ToolParser:
    """The parser whose format the grammar of `choice` writes, which must then read it: the
    server's own when it has a grammar format, else `json_list` (required / named)."""
    if parser is not None and type(parser) in _FORMATS:
        return parser
    return JsonListParser()


def tool_call_grammar(parser: ToolParser, tools: list[FunctionTool], choice: ToolChoice,
                      parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint for `choice` over `tools` in `parser`'s format (see the module's table),
    or None where nothing is constrained ("none"; "auto" under a parser without a grammar).
    ValueError naming `tools[i].function.parameters` for a schema xgrammar cannot compile.
    Blocks for the conversion (milliseconds; call it off the event loop)."""
    fmt = _FORMATS.get(type(parser))
    if choice.mode == "none" or fmt is None or (choice.mode == "auto" and fmt.trigger is None):
        return None
    check_schemas(tools)
    if choice.mode == "named":
        tools = [t for t in tools if t.name == choice.name]
    tag = {"type": "structural_tag", "format": _choice_format(fmt, tools, choice, parallel)}
    return StructuredOutputsParams(grammar=_to_ebnf(tag))


def _choice_format(fmt: _Format, tools: list[FunctionTool], choice: ToolChoice,
                   parallel: bool) -> dict:
    tags = [{"type": "tag", "begin": fmt.begin.format(name=t.name),
             "content": {"type": "json_schema", "json_schema": t.schema,
                         "max_whitespace_cnt": MAX_WHITESPACE},
             "end": fmt.end}
            for t in tools]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
             "at_least_one": True, "stop_after_first": not parallel}
    if choice.mode == "named":
        calls = tags[0]
    if choice.mode in ("named", "required"):
        if not fmt.open:
            return calls
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": fmt.open}, calls,
            {"type": "const_string", "value": fmt.close}]}
    if fmt.open:  # auto, a list format: the trigger opens one list of calls
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "stop_after_first": True,
                "tags": [{"type": "tag", "begin": fmt.open, "content": calls,
                          "end": fmt.close}]}
    return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
            "stop_after_first": not parallel}


def check_schemas(tools: list[FunctionTool]) -> None:
    """ValueError naming `tools[i].function.parameters` for the first schema xgrammar
    cannot turn into a grammar."""
    import xgrammar

    for i, tool in enumerate(tools):
        try:
            xgrammar.Grammar.from_json_schema(json.dumps(tool.schema))
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own
            raise ValueError(f"tools[{i}].function.parameters does not compile: "
                             f"{_first_line(exc)}") from None


def _to_ebnf(tag: dict) -> str:
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
    except Exception as exc:
        raise ValueError(f"tools: the tool-call grammar does not compile: "
                         f"{_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    """xgrammar's message, first line, without its C++ log prefix."""
    return _xgrammar_message(exc)
