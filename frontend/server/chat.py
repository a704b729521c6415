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

_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported", "tools")
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
    token_ids = await serving.tokenizing(request, serving.render_chat, req.messages,
                                         req.add_generation_prompt, req.continue_final_message,
                                         req.chat_template_kwargs, chars=_chars(req))
    token_ids = await serving.encode(request, token_ids, "messages")
    serving.check_room(params, len(token_ids), "max_completion_tokens"
                       if req.max_completion_tokens else "max_tokens")
    response_id, run = serving.start([(token_ids, None)], params, req.priority, "chatcmpl",
                                     serving.waited(request))
    view = _ChatView(serving, req, run, response_id, model)
    return await serving.respond(request, run, view.stream if req.stream else None,
                                 view.build)


def _chars(req: ChatCompletionRequest) -> int:
    """The conversation's characters (what picks its tokenizer lane)."""
    return sum(len(m.text()) + len(m.name or "") for m in req.messages)


class _ChatView:
    """Turns a run's outputs into the chat JSON body or its SSE stream."""

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, run: Run,
                 response_id: str, model: str):
        self.serving = serving
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
            choice = {"index": index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": self._logprobs(c.token_ids, c.logprobs),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        body = R.chat_response(self.id, self.created, self.model, choices,
                               R.usage(run.num_prompt_tokens(), run.num_completion_tokens()))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = job.prompt_ids
        return body

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
                    yield R.sse(self._chunk(self._delta_choice(c)))
        except Exception as exc:
            yield R.exception_event(exc)
            yield R.DONE
            return
        if self.req.include_usage:
            yield R.sse(R.usage_chunk(self.id, "chat.completion.chunk", self.created,
                                      self.model, self._usage()))
        yield R.DONE

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
