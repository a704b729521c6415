"""Tool calling (function calling) for the OpenAI endpoints: parsers, the grammar, streaming.

The interface (stable; /v1/chat/completions and /v1/responses both use it):

    from tidal.frontend.tools import ToolSettings, plan_tools, to_chunks

    settings = ToolSettings(auto=True, parser="hermes")   # --enable-auto-tool-choice,
                                                          # --tool-call-parser
    plan = plan_tools(settings, tools, tool_choice, parallel_tool_calls)
        # None without tools; ValueError whose first word is the field (field_of(error))
    plan.template_tools     # `tools=` for the chat template (HF shape) or None
    plan.constraint()       # StructuredOutputsParams(grammar=...) or None; blocking, off
                            # the event loop; ValueError naming tools[i].function.parameters
    plan.extract(text)      # Extracted(content: str | None, calls: list[ToolCall])
    stream = plan.stream()  # ToolCallStream: feed(delta) / finish() -> StreamDelta(content,
                            # calls completed)
    to_chunks(calls, first_index)   # OpenAI `delta.tool_calls` entries
    template_messages(messages)     # assistant tool_calls' arguments as dicts, for templates

    ToolCall(name, arguments: JSON string, id).to_openai()

Modules: `parsers.py` (the formats, their registry `TOOL_PARSERS`, the streaming state
machine), `grammar.py` (the tools' schemas as an xgrammar structural tag, sent as an EBNF
grammar through structured output's path; which choices it guarantees), `request.py`
(checking `tools` / `tool_choice`, the plan). No torch or xgrammar at import time.
"""

from .grammar import FunctionTool, ToolChoice, tool_call_grammar
from .parsers import (
    TOOL_PARSERS, Extracted, StreamDelta, ToolCall, ToolCallStream, ToolParser,
    get_tool_parser, to_chunks,
)
from .request import (
    ToolPlan, ToolSettings, field_of, parse_tool_choice, parse_tools, plan_tools,
    template_messages,
)

__all__ = [
    "TOOL_PARSERS", "Extracted", "FunctionTool", "StreamDelta", "ToolCall", "ToolCallStream",
    "ToolChoice", "ToolParser", "ToolPlan", "ToolSettings", "field_of", "get_tool_parser",
    "parse_tool_choice", "parse_tools", "plan_tools", "template_messages", "to_chunks",
    "tool_call_grammar",
]
