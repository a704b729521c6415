"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

(`responses.py` is something else: the response shapes of completions and chat.)

One request, as chat's (serving.py's order: every fault of the request before admission):

    check model, unsupported fields (400 naming them) -> previous_response_id's
    conversation from the store (404) -> input items to chat messages (responses_input.py)
    -> SamplingParams, text.format as structured output -> the tool plan, its grammar (400
    when it does not compile) -> the chat template (with the tools) -> token ids ->
    admission (503) -> one engine request -> the response object, or typed server-sent
    events -> the store (unless `store: false`)

Function tools go through chat's machinery (frontend/tools: the tools and tool_choice
checked, the chat template given `tools=`, the grammar for the choice, the server's
--tool-call-parser reading calls out of the text). The output is a `message` item for the
text and a `function_call` item per call:

    "none" (or no tools)     one message (its text constrained by text.format, if given)
    "auto"                   needs --enable-auto-tool-choice and --tool-call-parser (a 400
                             otherwise, as chat's); text, and a call wherever the model
                             writes one in the parser's format (then under the grammar)
    "required", or {"type": "function", "name": N}
                             one or more calls (exactly one of N), generated under the
                             grammar, so each parses and matches its function's schema;
                             with parallel_tool_calls false, one call at most

A stream is the event sequence the `openai` client types (openai.types.responses), each event
`event: <type>` plus `data: {..., "sequence_number": k}`:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      a message: response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      a call:    response.function_call_arguments.delta, .done
    response.output_item.done; then response.completed (or response.incomplete when
    max_output_tokens cut it, response.failed when the engine failed it)

A call's item comes once the parser has it whole (its arguments in one delta); text streams
token by token, except a tail the parser holds while it could start a call.
"""

from __future__ import annotations

import re
import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from ..structured_output import from_request_fields
from ..tools import ToolCall, ToolPlan, field_of, plan_tools
from .errors import APIError, bad_request, from_value_error, json_response
from .protocol import ChatMessage, ErrorResponse
from .response_store import ResponseStore, StoredResponse, owner_index, response_id
from .responses_input import (
    FunctionTool, ResponsesRequest, function_tools, input_messages, not_found,
)
from .serving import OpenAIServing, Run
from ...ipc.messages import SamplingParams

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
        history = ([] if req.previous_response_id is None else
                   self.lookup(req.previous_response_id, "previous_response_id").conversation)
        conversation = history + input_messages(req.input)
        params = self._sampling_params(req)
        await serving.check_structured_output(_Constraint("text.format"), params)
        plan = await self._plan_tools(req, tools, params)
        prompt = ([{"role": "system", "content": req.instructions}] if req.instructions
                  else []) + conversation
        token_ids = await serving.tokenizing(request, self._render, prompt,
                                             plan.template_tools if plan else None,
                                             chars=_chars(prompt))
        token_ids = await serving.encode(request, token_ids, "input")
        serving.check_room(params, len(token_ids), "max_output_tokens")
        _, run = serving.start([(token_ids, None)], params, 0, "resp", serving.waited(request))
        view = _ResponseView(self, req, run, model, conversation,
                             plan if plan is not None and plan.active else None)
        return await serving.respond(request, run, view.stream if req.stream else None,
                                     view.build)

    def _sampling_params(self, req: ResponsesRequest) -> SamplingParams:
        """The request's SamplingParams, text.format as its structured output."""
        try:
            structured = from_request_fields({"response_format": req.response_format()})[0]
        except ValueError as exc:
            raise bad_request(f"text.format: {exc}", "text.format") from None
        optional = dict(temperature=req.temperature, top_p=req.top_p)
        try:
            params = SamplingParams(max_tokens=req.max_output_tokens, seed=req.seed,
                                    structured_outputs=structured,
                                    **{k: v for k, v in optional.items() if v is not None})
        except ValueError as exc:
            raise from_value_error(exc, {"max_tokens": "max_output_tokens"}) from None
        return self.serving.sampling_params(_Ready(params))

    async def _plan_tools(self, req: ResponsesRequest, tools: list[FunctionTool],
                          params: SamplingParams) -> ToolPlan | None:
        """The tool plan of frontend/tools (chat's), its grammar as the request's structured
        output; 400s name the field as the Responses API spells it."""
        serving = self.serving
        try:
            plan = plan_tools(serving.tool_settings,
                              [tool.chat_template_form() for tool in tools] or None,
                              req.tool_choice, req.parallel_tool_calls)
            constraint = await serving.off_loop(plan.constraint) if plan else None
        except ValueError as exc:
            raise bad_request(_flat(str(exc)), _flat_field(field_of(exc))) from None
        await serving.constrain_to_tools(plan, constraint, params, "text.format")
        return plan

    def _render(self, prompt: list[dict], tools: list[dict] | None) -> list[int]:
        """The conversation through the server's chat template (`OpenAIServing.render_chat`,
        so --chat-template too), as token ids (blocking: a tokenizer thread)."""
        messages = [ChatMessage(**message) for message in prompt]
        try:
            return self.serving.render_chat(messages, True, tools=tools)
        except APIError as exc:
            if exc.param == "messages":  # the input is what this API calls it
                exc.param = "input"
                exc.message = exc.message.replace("messages", "input")
            raise


def _flat(message: str) -> str:
    """frontend/tools names chat's fields (`tools[1].function.name`); the Responses API's
    tools are flat (`tools[1].name`)."""
    return message.replace("].function.", "].").replace("].function", "]")


def _flat_field(field: str) -> str:
    """`tools[1].function.name` -> `tools.1.name` (the param style of the other 400s)."""
    return re.sub(r"\[(\d+)\]", r".\1", _flat(field))


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


# ------------------------------------------------------------------------ output items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"id": f"fc_{call.id.removeprefix('call_')}", "type": "function_call",
            "call_id": call.id, "name": call.name, "arguments": call.arguments,
            "status": status}


def _assistant_messages(output: list[dict]) -> list[dict]:
    """The output items as chat messages (what a continuation's prompt holds; a call's
    arguments as the JSON string OpenAI's chat messages carry)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class _Events:
    """Typed server-sent events, numbered from 0."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> bytes:
        event = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class _ResponseView:
    """Turns a run's output into the response object or its event stream, and stores it.
    `tools`: the plan whose parser reads calls out of the text (None: all text)."""

    def __init__(self, api: ResponsesAPI, req: ResponsesRequest, run: Run, model: str,
                 conversation: list[dict], tools: ToolPlan | None):
        self.api = api
        self.serving = api.serving
        self.req = req
        self.run = run
        self.model = model
        self.conversation = conversation
        self.tools = tools
        self.id = response_id(api.server_index, _hex())
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
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
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
        """The output items of the whole generated text: its text as a message, each call
        the plan's parser reads out of it as a function_call."""
        if self.tools is None:
            return [_message_item(f"msg_{_hex()}", text, status)]
        extracted = self.tools.extract(text)
        items = [_message_item(f"msg_{_hex()}", extracted.content, status)
                 ] if extracted.content or not extracted.calls else []
        return items + [_call_item(call) for call in extracted.calls]

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
        items = _ItemStream(event)
        parser = self.tools.stream() if self.tools is not None else None
        yield event("response.created", response=self.body("in_progress", []))
        yield event("response.in_progress", response=self.body("in_progress", []))
        if parser is None:  # all text: the message opens at once
            yield items.open_message()
        final = None
        try:
            async for _, out in self.serving.events(run):
                final = out.outputs[0]
                if final.finish_reason == "error":
                    raise RuntimeError(final.error or "the engine failed this request")
                for chunk in items.take(final.delta_text, parser):
                    yield chunk
            if final is None:
                raise RuntimeError("the engine returned no output")
        except Exception as exc:
            yield self._failed(event, exc, items.output)
            return
        status = "incomplete" if final.finish_reason == "length" else "completed"
        for chunk in items.finish(parser, status):
            yield chunk
        body = self.body(status, items.output)
        self._keep(body)
        yield event(f"response.{status}", response=body)

    def _failed(self, event: _Events, exc: Exception, output: list[dict]) -> bytes:
        code = "invalid_prompt" if isinstance(exc, ValueError) else "server_error"
        error = {"code": code, "message": str(exc) or type(exc).__name__}
        return event("response.failed", response=self.body("failed", output, error))


class _ItemStream:
    """The output items of a stream as they form: a message item open while text comes
    (closed when a call comes or the output ends), each call an item of its own (added, its
    arguments, done: the parser releases a call once it is complete)."""

    def __init__(self, event: _Events):
        self.event = event
        self.output: list[dict] = []  # the items closed so far
        self.message: dict | None = None  # the open message item
        self.text = ""

    def open_message(self) -> bytes:
        index = len(self.output)
        self.message = _message_item(f"msg_{_hex()}", "", "in_progress")
        added = self.event("response.output_item.added", output_index=index,
                           item=self.message | {"content": []})
        return added + self.event("response.content_part.added", item_id=self.message["id"],
                                  output_index=index, content_index=0, part=_text_part(""))

    def text_delta(self, text: str):
        if not text:
            return
        if self.message is None:
            yield self.open_message()
        self.text += text
        yield self.event("response.output_text.delta", item_id=self.message["id"],
                         output_index=len(self.output), content_index=0, delta=text,
                         logprobs=[])

    def close_message(self, status: str):
        if self.message is None:
            return
        where = dict(item_id=self.message["id"], output_index=len(self.output),
                     content_index=0)
        item = _message_item(self.message["id"], self.text, status)
        yield self.event("response.output_text.done", **where, text=self.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=_text_part(self.text))
        yield self.event("response.output_item.done", output_index=len(self.output),
                         item=item)
        self.output.append(item)
        self.message, self.text = None, ""

    def call(self, call: ToolCall):
        yield from self.close_message("completed")
        index, item = len(self.output), _call_item(call)
        yield self.event("response.output_item.added", output_index=index,
                         item=item | {"status": "in_progress", "arguments": ""})
        yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=index, delta=call.arguments)
        yield self.event("response.function_call_arguments.done", item_id=item["id"],
                         output_index=index, arguments=call.arguments)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def take(self, delta: str, parser):
        """The events of one text delta (through the tool-call parser, if any)."""
        if parser is None:
            yield from self.text_delta(delta)
            return
        released = parser.feed(delta)
        yield from self.text_delta(released.content)
        for call in released.calls:
            yield from self.call(call)

    def finish(self, parser, status: str):
        """The events that end the output: what the parser still held, the last message."""
        if parser is not None:
            released = parser.finish()
            yield from self.text_delta(released.content)
            for call in released.calls:
                yield from self.call(call)
            if not self.output and self.message is None:  # nothing at all: an empty message
                yield self.open_message()
        yield from self.close_message(status)


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
