"""A request's tools, checked and planned: what the template gets, what the grammar forces, how
the output is read back. Shared by /v1/chat/completions and /v1/responses.

    settings = ToolSettings(auto=True, parser="hermes")      # the server's flags
    plan = plan_tools(settings, raw_tools, raw_choice, parallel_tool_calls)   # ValueError
    plan.template_tools        -> `tools=` for the chat template (None when there are none)
    plan.constraint()          -> StructuredOutputsParams | None (blocks: off the event loop)
    plan.extract(text)         -> Extracted(content, calls)
    plan.stream()              -> ToolCallStream

Errors are ValueErrors whose message starts with the field (`tools[1].function.name ...`,
`tool_choice ...`); `field_of(error)` gives that field for the HTTP layer's 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .grammar import FunctionTool, ToolChoice, grammar_parser, tool_call_grammar
from .parsers import Extracted, ToolCallStream, ToolParser, get_tool_parser

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
"""OpenAI's rule for function names (letters, digits, _ . -, at most 64)."""


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags."""

    auto: bool = False
    """--enable-auto-tool-choice: the model may decide to call tools (`tool_choice: auto`)."""
    parser: str | None = None
    """--tool-call-parser: the format the model writes calls in."""

    def __post_init__(self) -> None:
        if self.parser is not None:
            get_tool_parser(self.parser)  # ValueError naming the known parsers
        if self.auto and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             "hermes, llama3_json, mistral, pythonic)")


@dataclass
class ToolPlan:
    """One request's tools and choice, checked, with the parser that reads its output."""

    tools: list[FunctionTool]
    choice: ToolChoice
    parser: ToolParser | None
    """Reads the output (None: `tool_choice` "none", the output is plain content)."""
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict] | None:
        return [t.to_openai() for t in self.tools] or None

    @property
    def active(self) -> bool:
        """Whether the output may hold calls (and is parsed for them)."""
        return self.parser is not None

    def constraint(self):
        """The grammar's `StructuredOutputsParams`, or None (module grammar.py says which
        choices are constrained); ValueError naming the schema that does not compile."""
        if self.parser is None:
            return None
        return tool_call_grammar(self.parser, self.tools, self.choice, self.parallel)

    def extract(self, text: str) -> Extracted:
        extracted = self.parser.extract(text) if self.parser else Extracted(text or None, [])
        if not self.parallel and len(extracted.calls) > 1:
            extracted.calls = extracted.calls[:1]
        return extracted

    def stream(self) -> ToolCallStream:
        return self.parser.stream()


def plan_tools(settings: ToolSettings, tools: list[Any] | None, tool_choice: Any,
               parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """The request's plan, or None when it has no tools (and no `tool_choice` needing them).
    ValueError naming the field: a malformed tool, a tool_choice naming no given tool,
    "auto" on a server without --enable-auto-tool-choice."""
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    if not parsed:
        return None
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if choice.mode == "none":
        return ToolPlan(parsed, choice, None, parallel)
    if choice.mode == "auto":
        if not settings.auto:
            raise ValueError('tool_choice: "auto" tool choice requires '
                             "--enable-auto-tool-choice and --tool-call-parser to be set")
        return ToolPlan(parsed, choice, get_tool_parser(settings.parser), parallel)
    server = get_tool_parser(settings.parser) if settings.parser else None
    return ToolPlan(parsed, choice, grammar_parser(server, choice), parallel)


def parse_tools(tools: list[Any] | None, where: str = "tools",
                flat: bool = False) -> list[FunctionTool]:
    """FunctionTools from chat completions' `[{"type": "function", "function": {"name",
    "description", "parameters"}}]`, or with `flat` the Responses API's `[{"type":
    "function", "name", "description", "parameters"}]`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        here = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{here}: only tools of type \"function\" are supported")
        function = tool if flat else tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{here}.function must be an object")
        out.append(_function_tool(function, here if flat else f"{here}.function"))
        if out[-1].name in names:
            raise ValueError(f"{here}: two tools are named {out[-1].name!r}")
        names.add(out[-1].name)
    return out


def _function_tool(function: dict, here: str) -> FunctionTool:
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{here}.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                         f"got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{here}.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"{here}.parameters must be a JSON schema object")
    return FunctionTool(name, description, parameters)


def parse_tool_choice(tool_choice: Any, tools: list[FunctionTool]) -> ToolChoice:
    """OpenAI's `tool_choice`: "none", "auto", "required", `{"type": "function", "function":
    {"name": N}}` (or the Responses API's `{"type": "function", "name": N}`); None means
    "auto" with tools, "none" without."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named '
                             f"function, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise ValueError('tool_choice: "required" needs `tools`; none were given')
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function", tool_choice)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice.function.name must be a string")
        if name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice: tool {name!r} has not been passed in `tools`")
        return ToolChoice("named", name)
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                     '"function": {"name": ...}}')


def field_of(error: ValueError, default: str = "tools") -> str:
    """The request field an error of this module names (its first word, `[i]...` kept)."""
    head = str(error).split(" ", 1)[0].rstrip(":")
    return head if head.startswith(("tools", "tool_choice", "messages")) else default


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as HF chat templates expect them: an assistant's `tool_calls[i].function.
    arguments` as a dict (OpenAI sends a JSON string; Qwen's template writes it `tojson`),
    a tool message's `tool_call_id` kept. A string that is not JSON stays a string."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": function}
