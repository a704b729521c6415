"""POST /v1/chat/completions: messages through the tokenizer's chat template.

A stream starts with one chunk per choice carrying `delta.role = "assistant"` (and empty
content), then content deltas; a choice's last chunk carries its finish_reason.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import responses as R
from .errors import bad_request
from .protocol import ChatCompletionRequest
from .serving import OpenAIServing, Run, now
from ..tools import ToolPlan, field_of, plan_tools, to_chunks

_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    """Validate, admit and answer one chat completions request (JSON or SSE)."""
    model = serving.check_model(req.model)
    _check_supported(req)
    params = serving.sampling_params(req, _RENAMES)
    await serving.check_structured_output(req, params)
    tools = await _plan_tools(serving, req, params)
    token_ids = await serving.tokenizing(request, serving.render_chat, req.messages,
                                         req.add_generation_prompt, req.continue_final_message,
                                         req.chat_template_kwargs,
                                         tools.template_tools if tools else None,
                                         chars=_chars(req))
    token_ids = await serving.encode(request, token_ids, "messages")
    serving.check_room(params, len(token_ids), "max_completion_tokens"
                       if req.max_completion_tokens else "max_tokens")
    response_id, run = serving.start([(token_ids, None)], params, req.priority, "chatcmpl",
                                     serving.waited(request), model)
    view = _ChatView(serving, req, run, response_id, model, tools if tools and tools.active
                     else None)
    return await serving.respond(request, run, view.stream if req.stream else None,
                                 view.build)


async def _plan_tools(serving: OpenAIServing, req: ChatCompletionRequest,
                      params) -> ToolPlan | None:
    """The request's tool plan (None without tools); its grammar, when its choice has one,
    becomes the request's structured output (compiled by the check that follows). 400s
    name the field: a malformed tool, an unknown tool_choice name, "auto" without
    --enable-auto-tool-choice, a schema that does not compile, a response_format beside a
    tool grammar."""
    try:
        plan = plan_tools(serving.tool_settings, req.tools, req.tool_choice,
                          req.parallel_tool_calls)
        constraint = await serving.off_loop(plan.constraint) if plan else None
    except ValueError as exc:
        raise bad_request(str(exc), field_of(exc)) from None
    # the field that set the request's own constraint, named only when the two would clash
    format_field = (req.structured_output()[1]
                    if constraint is not None and params.structured_outputs else "")
    await serving.constrain_to_tools(plan, constraint, params, format_field)
    return plan


def _chars(req: ChatCompletionRequest) -> int:
    """The conversation's characters (what picks its tokenizer lane)."""
    return sum(len(m.text()) + len(m.name or "") for m in req.messages)


class _ChatView:
    """Turns a run's outputs into the chat JSON body or its SSE stream."""

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, run: Run,
                 response_id: str, model: str, tools: ToolPlan | None = None):
        self.serving = serving
        self.tools = tools  # the output is parsed for tool calls (None: plain content)
        self.tool_streams: dict = {}  # choice index -> its ToolCallStream
        self.req = req
        self.run = run
        self.id = response_id
        self.model = model
        self.created = now()
        self.num_top = (req.top_logprobs or 0) if req.logprobs else None

    def _logprobs(self, token_ids, logprobs):
        if self.num_top is None:
            return None
        return R.chat_logprobs(token_ids, logprobs, self.num_top, self.serving.tokenizer)

    def build(self, run: Run) -> dict:
        """The non-streaming body."""
        choices = []
        job = run.jobs[0]
        for index in sorted(job.final):
            c = job.final[index]
            if c.finish_reason == "error":
                raise self.serving.engine_error(c)
            message, finish_reason = self._message(c.text, c.finish_reason)
            choice = {"index": index, "message": message,
                      "logprobs": self._logprobs(c.token_ids, c.logprobs),
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        body = R.chat_response(self.id, self.created, self.model, choices,
                               R.usage(run.num_prompt_tokens(), run.num_completion_tokens()))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = job.prompt_ids
        return body

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The choice's message (tool calls parsed out of the text) and finish reason
        ("tool_calls" when a call ended the answer)."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        extracted = self.tools.extract(text)
        message = {"role": "assistant", "content": extracted.content}
        if extracted.calls:
            message["tool_calls"] = [call.to_openai() for call in extracted.calls]
            finish_reason = _tool_finish(finish_reason)
        return message, finish_reason

    async def stream(self, run: Run):
        """The SSE body: role chunks, content chunks, usage chunk, [DONE]."""
        for index in range(run.params.n):
            yield R.sse(self._chunk({"index": index, "delta": {"role": "assistant",
                                                               "content": ""},
                                     "logprobs": None, "finish_reason": None}))
        try:
            async for _, out in self.serving.events(run):
                for c in out.outputs:
                    if c.finish_reason == "error":
                        yield R.error_event(c.error or "the engine failed this request")
                        yield R.DONE
                        return
                    for choice in self._delta_choices(c):
                        yield R.sse(self._chunk(choice))
        except Exception as exc:
            yield R.exception_event(exc)
            yield R.DONE
            return
        if self.req.include_usage:
            yield R.sse(R.usage_chunk(self.id, "chat.completion.chunk", self.created,
                                      self.model, self._usage()))
        yield R.DONE

    def _delta_choices(self, c) -> list[dict]:
        """The chunks' choices for one output of completion `c`: one, or with tools, the
        content released (if any), then one per tool-call delta, the last carrying the
        finish reason (and the token ids / logprobs of this output)."""
        if self.tools is None:
            return [self._delta_choice(c)]
        stream = self.tool_streams.setdefault(c.index, self.tools.stream())
        released = stream.feed(c.delta_text)
        if c.finished:
            rest = stream.finish()
            released.content += rest.content
            released.calls += rest.calls
        first = stream.num_calls - len(released.calls)
        if not self.tools.parallel:
            released.calls = released.calls[:max(0, 1 - first)]
        deltas = [{"content": released.content}] if released.content else []
        deltas += [{"tool_calls": [entry]} for entry in to_chunks(released.calls, first)]
        if not deltas and (c.finished or self.num_top is not None
                           or self.req.return_token_ids):
            deltas = [{}]  # nothing to say yet: the token ids / logprobs / finish alone
        choices = [{"index": c.index, "delta": delta, "logprobs": None,
                    "finish_reason": None, "stop_reason": None} for delta in deltas]
        if choices:
            last = choices[-1]
            last.update(self._delta_choice(c), delta=last["delta"])
            if c.finished and stream.num_calls:
                last["finish_reason"] = _tool_finish(c.finish_reason)
        return choices

    def _delta_choice(self, c) -> dict:
        choice = {"index": c.index, "delta": {"content": c.delta_text},
                  "logprobs": self._logprobs(c.delta_token_ids, c.delta_logprobs),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.delta_token_ids)
        return choice

    def _chunk(self, choice: dict) -> dict:
        chunk = R.chat_chunk(self.id, self.created, self.model, choice)
        if self.req.include_usage:
            chunk["usage"] = self._usage() if self.req.continuous_usage else None
        return chunk

    def _usage(self) -> dict:
        return R.usage(self.run.num_prompt_tokens(), self.run.num_completion_tokens())


def _tool_finish(finish_reason: str | None) -> str | None:
    """An answer that ended on its own after tool calls finished for them ("tool_calls");
    one cut by max_tokens says so ("length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
