"""`tidal serve`'s tool-calling flags (vLLM's names) and what they make.

    --enable-auto-tool-choice     the model may call tools on its own (`tool_choice: auto`)
    --tool-call-parser NAME       the format it writes calls in (hermes, llama3_json, mistral,
                                  pythonic)
    --chat-template FILE          a Jinja chat template used instead of the tokenizer's (a file,
                                  or the template itself when it is no file)
"""

from __future__ import annotations

import argparse
import os

from .parsers import TOOL_PARSERS
from .request import ToolSettings


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (`tool_choice: "auto"`, the '
                   "default when a request gives tools); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   metavar="NAME",
                   help="the format the model writes tool calls in: "
                   f"{', '.join(sorted(TOOL_PARSERS))} (docs/tools.md); also the format "
                   '"required" and named tool choices are forced into')
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the tokenizer's (a text "
                   "that is no file is taken as the template itself)")


def tools_from_args(ns: argparse.Namespace) -> tuple[ToolSettings, str | None]:
    """(the tool settings, the chat template's text) from the flags; ValueError naming the
    flag (a missing parser, a template file that cannot be read)."""
    settings = ToolSettings(auto=ns.enable_auto_tool_choice, parser=ns.tool_call_parser)
    return settings, load_chat_template(ns.chat_template)


def load_chat_template(value: str | None) -> str | None:
    """A chat template from a file path, or `value` itself when it is a template (it holds
    "{{" or "{%"), as vLLM's --chat-template; ValueError for a path that cannot be read."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file (and not a Jinja template)")
