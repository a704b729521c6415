"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

(`responses.py` is something else: the response shapes of completions and chat.)

One request, as chat's (serving.py's order: every fault of the request before admission):

    check model, unsupported fields (400 naming them) -> function tools and tool_choice ->
    previous_response_id's conversation from the store (404) -> input items to chat messages
    (responses_input.py) -> SamplingParams, with text.format or a forced tool call as a
    grammar (400 when it does not compile) -> the chat template (with the tools) -> token
    ids -> admission (503) -> one engine request -> the response object, or typed
    server-sent events -> the store (unless `store: false`)

Output items and how each tool_choice makes them:

    "none" (or no tools)     one `message` item (its `output_text` constrained by text.format)
    "auto"                   one `message` item: the model's text (see docs/responses.md)
    {"type": "function", "name": N}
                             one `function_call` item for N: its arguments are generated
                             under N's parameters schema (xgrammar), so they always parse
    "required"               one or more `function_call` items: the output is generated as
                             [{"name": ..., "arguments": {...}}, ...] under a schema that
                             allows each tool's name with its parameters (one item at most
                             with parallel_tool_calls false), then split into items

A stream is the event sequence the `openai` client types (openai.types.responses), each event
`event: <type>` plus `data: {..., "sequence_number": k}`:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      a message: response.content_part.added, response.output_text.delta..., 
                 response.output_text.done, response.content_part.done
      a call:    response.function_call_arguments.delta..., .done
    response.output_item.done; then response.completed (or response.incomplete when
    max_output_tokens cut it, response.failed when the engine failed it)

A named call streams its arguments as they are generated; "required" calls come whole at the
end (the array must be complete to be split).
"""

from __future__ import annotations

import json
import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from ..chat_template import has_chat_template, render_chat_text
from ..structured_output import from_request_fields
from .errors import bad_request, from_value_error, json_response
from .protocol import ErrorResponse
from .response_store import ResponseStore, StoredResponse, owner_index, response_id
from .responses_input import (
    FunctionTool, ResponsesRequest, function_tools, input_messages, not_found, tool_choice,
)
from .serving import OpenAIServing, Run
from ...ipc.messages import SamplingParams, StructuredOutputsParams

_encode = msgspec.json.Encoder().encode


def _hex() -> str:
    return uuid.uuid4().hex


class ResponsesAPI:
    """The Responses endpoints of one HTTP process: its store and its OpenAIServing."""

    def __init__(self, serving: OpenAIServing, store_size: int, server_index: int = 0):
        self.serving = serving
        self.store = ResponseStore(store_size)
        self.server_index = server_index

    def lookup(self, resp_id: str, param: str | None = None) -> StoredResponse:
        record = self.store.get(resp_id)
        if record is None:
            raise not_found(resp_id, self.server_index, owner_index(resp_id), param)
        return record

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        """Validate, admit and answer one request (the module docstring's order)."""
        serving = self.serving
        model = serving.check_model(req.model)
        req.check_supported()
        tools = function_tools(req.tools)
        mode = _ToolMode(tool_choice(req.tool_choice, tools), tools, req.parallel_tool_calls)
        history = ([] if req.previous_response_id is None else
                   self.lookup(req.previous_response_id, "previous_response_id").conversation)
        conversation = history + input_messages(req.input)
        params, constraint = self._sampling_params(req, mode)
        await serving.check_structured_output(constraint, params)
        prompt = ([{"role": "system", "content": req.instructions}] if req.instructions
                  else []) + conversation
        token_ids = await serving.tokenizing(request, self._render, prompt, mode.prompt_tools(),
                                             chars=_chars(prompt))
        token_ids = await serving.encode(request, token_ids, "input")
        serving.check_room(params, len(token_ids), "max_output_tokens")
        _, run = serving.start([(token_ids, None)], params, 0, "resp", serving.waited(request))
        view = _ResponseView(self, req, run, model, conversation, mode)
        return await serving.respond(request, run, view.stream if req.stream else None,
                                     view.build)

    def _sampling_params(self, req: ResponsesRequest, mode: "_ToolMode"):
        """(SamplingParams, the constraint's field for check_structured_output)."""
        schema = mode.schema()
        response_format = req.response_format()
        if schema is not None and response_format is not None:
            raise bad_request(f"text.format cannot be combined with tool_choice "
                              f"{mode.choice!r}: a forced tool call is JSON already",
                              "text.format")
        field = "tool_choice" if schema is not None else "text.format"
        try:
            if schema is not None:  # no free whitespace: a call is data, not prose
                structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            else:
                structured = from_request_fields({"response_format": response_format})[0]
        except ValueError as exc:
            raise bad_request(f"{field}: {exc}", field) from None
        optional = dict(temperature=req.temperature, top_p=req.top_p)
        try:
            params = SamplingParams(max_tokens=req.max_output_tokens, seed=req.seed,
                                    structured_outputs=structured,
                                    **{k: v for k, v in optional.items() if v is not None})
        except ValueError as exc:
            raise from_value_error(exc, {"max_tokens": "max_output_tokens"}) from None
        params = self.serving.sampling_params(_Ready(params))
        return params, _Constraint(field)

    def _render(self, prompt: list[dict], tools: list[dict] | None) -> list[int]:
        """The conversation through the chat template, as token ids (a tokenizer thread)."""
        serving = self.serving
        if not has_chat_template(serving.tokenizer):
            raise bad_request("This model has no chat template; use /v1/completions.",
                              "input")
        try:
            text = render_chat_text(serving.tokenizer, prompt, add_generation_prompt=True,
                                    chat_template_kwargs={"tools": tools} if tools else None)
        except ValueError as exc:
            raise bad_request(str(exc).replace("messages:", "input:", 1), "input") from None
        serving.check_prompt_size(text, "input")
        return serving.tokenizer.encode(text, add_special_tokens=False)


class _Ready:
    """Hands ready SamplingParams to `OpenAIServing.sampling_params` (its top_k rule)."""

    def __init__(self, params: SamplingParams):
        self._params = params

    def to_sampling_params(self) -> SamplingParams:
        return self._params


class _Constraint:
    """What `OpenAIServing.check_structured_output` asks of a request: the field to name."""

    def __init__(self, field: str):
        self.field = field

    def structured_output(self):
        return None, self.field


def _chars(prompt: list[dict]) -> int:
    return sum(len(m.get("content") or "") for m in prompt)


class _ToolMode:
    """What the request's tool_choice asks of the output (module docstring's table)."""

    def __init__(self, choice: str, tools: list[FunctionTool], parallel: bool):
        self.choice = choice
        self.tools = tools
        self.parallel = parallel

    @property
    def named(self) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == self.choice), None)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def prompt_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them; none under "none"."""
        if self.choice == "none" or not self.tools:
            return None
        return [tool.chat_template_form() for tool in self.tools]

    def schema(self) -> dict | None:
        """The JSON schema a forced call's output is generated under."""
        if self.named is not None:
            return self.named.parameters or {"type": "object"}
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {
            "name": {"const": tool.name},
            "arguments": tool.parameters or {"type": "object"}},
            "required": ["name", "arguments"]} for tool in self.tools]
        schema = {"type": "array", "minItems": 1,
                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a forced output; None if it does not parse
        (the output was cut by max_output_tokens)."""
        if self.named is not None:
            try:
                json.loads(text)
            except ValueError:
                return None
            return [(self.named.name, text)]
        try:
            calls = json.loads(text)
            return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                    for c in calls]
        except (ValueError, TypeError, KeyError):
            return None


# ------------------------------------------------------------------------ output items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _assistant_messages(output: list[dict]) -> list[dict]:
    """The output items as chat messages (what a continuation's prompt holds)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": _parsed(item["arguments"])}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _parsed(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class _Events:
    """Typed server-sent events, numbered from 0."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> bytes:
        event = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class _ResponseView:
    """Turns a run's output into the response object or its event stream, and stores it."""

    def __init__(self, api: ResponsesAPI, req: ResponsesRequest, run: Run, model: str,
                 conversation: list[dict], mode: _ToolMode):
        self.api = api
        self.serving = api.serving
        self.req = req
        self.run = run
        self.model = model
        self.conversation = conversation
        self.mode = mode
        self.id = response_id(api.server_index, _hex())
        self.message_id = f"msg_{_hex()}"
        self.created = time.time()

    # -------------------------------------------------------------- the response object

    def body(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        req, params = self.req, self.run.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id,
                "temperature": params.temperature, "top_p": params.top_p,
                "tool_choice": req.tool_choice or ("auto" if self.mode.tools else "none"),
                "tools": req.tools or [], "text": {"format": req.text_format()},
                "truncation": "disabled", "store": req.store, "background": False,
                "user": req.user, "error": error, "incomplete_details": incomplete,
                "usage": self._usage() if status in ("completed", "incomplete") else None}

    def _usage(self) -> dict:
        job = self.run.jobs[0]
        cached = job.metrics.num_cached_tokens if job.metrics is not None else 0
        prompt, generated = self.run.num_prompt_tokens(), self.run.num_completion_tokens()
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + generated}

    def _output(self, text: str, status: str) -> list[dict]:
        """The output items of the whole generated text."""
        if self.mode.forced:
            calls = self.mode.calls(text)
            if calls is not None:
                return [_call_item(f"fc_{_hex()}", f"call_{_hex()}", name, arguments,
                                   "completed") for name, arguments in calls]
            status = "incomplete"  # a forced call that does not parse was cut short
        return [_message_item(self.message_id, text, status)]

    def _keep(self, body: dict) -> None:
        if self.req.store:
            self.api.store.put(StoredResponse(
                body, self.conversation + _assistant_messages(body["output"])))

    def build(self, run: Run) -> dict:
        """The non-streaming body (stored unless `store: false`)."""
        final = run.jobs[0].final[0]
        if final.finish_reason == "error":
            raise self.serving.engine_error(final)
        status = "incomplete" if final.finish_reason == "length" else "completed"
        body = self.body(status, self._output(final.text, status))
        self._keep(body)
        return body

    # -------------------------------------------------------------- the event stream

    async def stream(self, run: Run):
        """The typed event stream (module docstring)."""
        event = _Events()
        yield event("response.created", response=self.body("in_progress", []))
        yield event("response.in_progress", response=self.body("in_progress", []))
        named = self.mode.named
        if named is not None:
            streamer = _CallStreamer(event, named.name)
        elif self.mode.forced:
            streamer = _Buffered(event)
        else:
            streamer = _TextStreamer(event, self.message_id)
        for chunk in streamer.start():
            yield chunk
        final = None
        try:
            async for _, out in self.serving.events(run):
                final = out.outputs[0]
                if final.finish_reason == "error":
                    raise RuntimeError(final.error or "the engine failed this request")
                for chunk in streamer.delta(final.delta_text):
                    yield chunk
        except Exception as exc:
            yield self._failed(event, exc, streamer.output())
            return
        if final is None:
            yield self._failed(event, RuntimeError("the engine returned no output"), [])
            return
        status = "incomplete" if final.finish_reason == "length" else "completed"
        output = streamer.output(status) if named is not None or not self.mode.forced \
            else self._output(final.text, status)
        for index, item in enumerate(output):
            for chunk in streamer.finish(item, index):
                yield chunk
        body = self.body(status, output)
        self._keep(body)
        yield event(f"response.{status}", response=body)

    def _failed(self, event: _Events, exc: Exception, output: list[dict]) -> bytes:
        code = "invalid_prompt" if isinstance(exc, ValueError) else "server_error"
        error = {"code": code, "message": str(exc) or type(exc).__name__}
        return event("response.failed", response=self.body("failed", output, error))


class _TextStreamer:
    """Events of one message item whose text streams."""

    def __init__(self, event: _Events, item_id: str):
        self.event = event
        self.item_id = item_id
        self.text = ""

    def start(self):
        yield self.event("response.output_item.added", output_index=0,
                         item=_message_item(self.item_id, "", "in_progress") | {"content": []})
        yield self.event("response.content_part.added", item_id=self.item_id, output_index=0,
                         content_index=0, part=_text_part(""))

    def delta(self, text: str):
        if text:
            self.text += text
            yield self.event("response.output_text.delta", item_id=self.item_id,
                             output_index=0, content_index=0, delta=text, logprobs=[])

    def output(self, status: str = "incomplete") -> list[dict]:
        return [_message_item(self.item_id, self.text, status)]

    def finish(self, item: dict, index: int):
        where = dict(item_id=self.item_id, output_index=index, content_index=0)
        yield self.event("response.output_text.done", **where, text=self.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=_text_part(self.text))
        yield self.event("response.output_item.done", output_index=index, item=item)


class _CallStreamer:
    """Events of one function_call item whose arguments stream (a named tool_choice)."""

    def __init__(self, event: _Events, name: str):
        self.event = event
        self.name = name
        self.item_id = f"fc_{_hex()}"
        self.call_id = f"call_{_hex()}"
        self.arguments = ""

    def start(self):
        yield self.event("response.output_item.added", output_index=0, item=_call_item(
            self.item_id, self.call_id, self.name, "", "in_progress"))

    def delta(self, text: str):
        if text:
            self.arguments += text
            yield self.event("response.function_call_arguments.delta", item_id=self.item_id,
                             output_index=0, delta=text)

    def output(self, status: str = "incomplete") -> list[dict]:
        return [_call_item(self.item_id, self.call_id, self.name, self.arguments, status)]

    def finish(self, item: dict, index: int):
        yield self.event("response.function_call_arguments.done", item_id=self.item_id,
                         output_index=index, arguments=self.arguments)
        yield self.event("response.output_item.done", output_index=index, item=item)


class _Buffered:
    """Events of "required" calls: nothing until the whole array is there, then each item
    whole (added, its arguments in one delta, done)."""

    def __init__(self, event: _Events):
        self.event = event

    def start(self):
        return ()

    def delta(self, text: str):
        return ()

    def output(self, status: str = "incomplete") -> list[dict]:
        return []

    def finish(self, item: dict, index: int):
        event = self.event
        if item["type"] == "message":  # the array did not parse: the text, as a message
            streamer = _TextStreamer(event, item["id"])
            streamer.text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item=item | {"status": "in_progress", "content": []})
            yield event("response.content_part.added", item_id=item["id"],
                        output_index=index, content_index=0, part=_text_part(""))
            yield event("response.output_text.delta", item_id=item["id"], output_index=index,
                        content_index=0, delta=streamer.text, logprobs=[])
            yield from streamer.finish(item, index)
            return
        yield event("response.output_item.added", output_index=index,
                    item=item | {"status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)


# ------------------------------------------------------------------------------ routes

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
           404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def add_responses_routes(app: FastAPI) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{response_id}; they use
    `app.state.responses` (a ResponsesAPI, made with the app's state)."""

    @app.post("/v1/responses", responses=_ERRORS)
    async def create_response(req: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses: input items through the chat template (`stream: true` answers
        with typed server-sent events)."""
        return await request.app.state.responses.create(req, request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str, request: Request) -> Response:
        """A stored response (404 when it was not stored, or was dropped: LRU)."""
        return json_response(request.app.state.responses.lookup(response_id).body)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str, request: Request) -> Response:
        """Forget a stored response (404 when it is not held)."""
        api = request.app.state.responses
        api.lookup(response_id)
        api.store.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})
