"""The Responses API's request: its model, and its input and tools in the chat template's form.

    ResponsesRequest                        POST /v1/responses (pydantic; unknown fields ignored)
    input_messages(input) -> [message]      input items as chat messages
    function_tools(tools) -> [FunctionTool] the request's function tools (400 for any other)

Input items (OpenAI's `input`, a string or a list) map onto the chat template's messages:

    "text"                                           {"role": "user", "content": "text"}
    {"role": R, "content": "..." | [parts]}          {"role": R, "content": joined text}
      (type "message" or absent; parts input_text / output_text / text; developer -> system)
    {"type": "function_call", call_id, name, arguments}
                                                     an assistant message's `tool_calls`
                                                     (consecutive calls share one message)
    {"type": "function_call_output", call_id, output}
                                                     {"role": "tool", "tool_call_id", "content"}

Anything else (images, files, audio, reasoning items, item references, hosted tools' calls)
is a 400 naming the item and its type: tidal serves text models without hosted tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from .errors import APIError, bad_request
from .protocol import OpenAIModel, Text
from ...ipc.messages import is_valid_unicode

_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}
"""Message roles and the chat template's role for each: HF templates know "system", few know
OpenAI's "developer", which means the same to a model served here."""
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_UNSUPPORTED_REASONS = {
    "background": "background mode is not supported: answer in the request (stream for "
                  "progress)",
    "conversation": "conversations are not supported: continue with previous_response_id",
    "prompt": "prompt templates are not supported: send input and instructions",
}


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses (OpenAI's fields tidal serves; unknown fields are ignored)."""

    model: Text | None = None
    """The served model name; None means the (only) served model."""
    input: Text | list[dict[str, Any]]
    """A user message's text, or a list of input items (module docstring)."""
    instructions: Text | None = None
    """A system message put first; not carried over to a `previous_response_id` continuation."""
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    """Most tokens to generate (null = up to the context)."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    """Softmax temperature (default 1.0); 0 is greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Nucleus sampling threshold in (0, 1] (default 1.0)."""
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    """(tidal, as vLLM) per-request seed: same seed, same tokens."""
    tools: list[dict[str, Any]] | None = None
    """Function tools `{"type": "function", "name", "description", "parameters"}`."""
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto" (the default with tools), "required", or {"type": "function", "name"}."""
    parallel_tool_calls: bool = True
    """With tool_choice "required": whether the model may call several tools in one turn."""
    text: dict[str, Any] | None = None
    """`{"format": {"type": "text" | "json_object" | "json_schema", "schema": ..., ...}}`."""
    stream: bool = False
    """Answer as typed server-sent events (`response.created` ... `response.completed`)."""
    store: bool = True
    """Keep the response for `previous_response_id` and GET (`--responses-store-size`)."""
    previous_response_id: Text | None = None
    """Continue a stored response: its input and output come before this input."""
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    user: str | None = None
    """An end-user id (accepted, not used)."""
    truncation: str | None = None
    """"disabled" (the default) alone: a conversation that does not fit is a 400."""
    top_logprobs: int | None = None
    """Not supported beyond 0 (400)."""
    reasoning: dict[str, Any] | None = None
    """Not supported beyond an effort of "none" (no model served here has reasoning items)."""
    include: list[str] | None = None
    """Extra output to include; "message.output_text.logprobs" is not supported (400)."""
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    def check_supported(self) -> None:
        """400 naming the field for what tidal does not serve."""
        for name, reason in _UNSUPPORTED_REASONS.items():
            if getattr(self, name):
                raise bad_request(reason, name)
        if self.truncation not in (None, "disabled"):
            raise bad_request(f'truncation {self.truncation!r} is not supported: only '
                              '"disabled" (a conversation that does not fit is a 400)',
                              "truncation")
        if self.top_logprobs:
            raise bad_request("top_logprobs is not supported", "top_logprobs")
        if "message.output_text.logprobs" in (self.include or ()):
            raise bad_request("include 'message.output_text.logprobs' is not supported",
                              "include")
        if self.reasoning and (self.reasoning.get("effort") not in (None, "none")
                               or self.reasoning.get("summary")):
            raise bad_request("reasoning is not supported: the served model has no "
                              "reasoning items", "reasoning")

    def text_format(self) -> dict:
        """`text.format` ({"type": "text"} when absent); 400 for a malformed one."""
        text = self.text or {}
        if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
            raise bad_request('text must be {"format": {"type": ...}}', "text.format")
        return text.get("format") or {"type": "text"}

    def response_format(self) -> dict | None:
        """`text.format` as chat's `response_format` (what structured_output.py reads)."""
        fmt = self.text_format()
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise bad_request('text.format of type "json_schema" needs a "schema" object',
                                  "text.format.schema")
            return {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt["schema"], "strict": fmt.get("strict")}}
        raise bad_request(f'text.format.type must be "text", "json_object" or "json_schema", '
                          f'got {kind!r}', "text.format.type")


@dataclass(frozen=True)
class FunctionTool:
    """One function tool of a request."""

    name: str
    description: str | None
    parameters: dict | None

    def chat_template_form(self) -> dict:
        """As HF chat templates take a tool (`tools=` of apply_chat_template)."""
        function = {"name": self.name, "parameters": self.parameters or {"type": "object",
                                                                         "properties": {}}}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def function_tools(tools: list[dict] | None) -> list[FunctionTool]:
    """The request's function tools; 400 naming the tool for a hosted tool (web_search,
    file_search, code_interpreter, ...) or a malformed one."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported: tidal "
                              "serves function tools only (no hosted tools)", f"tools.{i}.type")
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools.{i}.name")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object",
                              f"tools.{i}.parameters")
        description = tool.get("description")
        out.append(FunctionTool(name, description if isinstance(description, str) else None,
                                params))
    names = [tool.name for tool in out]
    if len(set(names)) != len(names):
        raise bad_request("tools: two function tools have one name", "tools")
    return out


# ------------------------------------------------------------------------------ input items


def input_messages(items: str | list[dict]) -> list[dict]:
    """The input as chat messages (module docstring); 400 naming the item otherwise."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            _add_call(messages, _function_call(item, i))
        elif kind == "function_call_output":
            messages.append(_call_output(item, i))
        else:
            raise bad_request(f"input[{i}]: item type {kind!r} is not supported: tidal takes "
                              "messages, function_call and function_call_output items",
                              f"input.{i}.type")
    if not messages:
        raise bad_request("input must not be empty", "input")
    return messages


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", where)
    if not is_valid_unicode(value):
        raise bad_request(f"{where} must be valid Unicode (it contains a lone surrogate "
                          "escape)", where)
    return value


def _content_text(content: Any, where: str) -> str:
    """A message's content, a string or a list of text parts, as one string."""
    if isinstance(content, str):
        return _text(content, where)
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}]: content type {kind!r} is not supported: tidal "
                              "serves text models (input_text / output_text parts)",
                              f"{where}.{j}.type")
        texts.append(_text(part.get("text"), f"{where}.{j}.text"))
    return "".join(texts)


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"input[{i}].role must be one of user, assistant, system, developer; "
                          f"got {role!r}", f"input.{i}.role")
    return {"role": _ROLES[role], "content": _content_text(item.get("content"),
                                                           f"input.{i}.content")}


def _function_call(item: dict, i: int) -> dict:
    """A function_call item as a chat `tool_calls` entry (OpenAI's shape: the arguments a
    JSON string, which the chat path hands the template as an object)."""
    call_id = _text(item.get("call_id"), f"input.{i}.call_id")
    name = _text(item.get("name"), f"input.{i}.name")
    arguments = _text(item.get("arguments"), f"input.{i}.arguments")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict], call: dict) -> None:
    """Consecutive calls (parallel tool calls) join the assistant message before them."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict, i: int) -> dict:
    output = item.get("output")
    content = _content_text(output, f"input.{i}.output")
    return {"role": "tool", "tool_call_id": _text(item.get("call_id"), f"input.{i}.call_id"),
            "content": content}


def not_found(resp_id: str, server_index: int, owner: int | None,
              param: str | None = None) -> APIError:
    """The 404 of a response id this process does not hold (saying so when another HTTP
    process made it: `response_store.py`)."""
    message = f"Response with id {resp_id!r} not found."
    if owner is not None and owner != server_index:
        message += (f" It was made by HTTP process {owner} and this is process "
                    f"{server_index}: with --api-server-count above 1 each process keeps its "
                    "own responses (docs/responses.md)")
    return APIError(404, message, param)
