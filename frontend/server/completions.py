"""POST /v1/completions: prompts (strings or token ids) in, `text_completion` out.

Choice indices: prompt i, completion j -> index i * n + j (OpenAI's order). Usage counts each
prompt once, however many completions it has. With `echo` the prompt's text leads each
choice's text (a stream: its first chunk); with `echo` and `logprobs` also the prompt's tokens
and their logprobs (computed by the engine, `SamplingParams.prompt_logprobs`) lead the
completion's, the first token's logprob null, as OpenAI and vLLM answer.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import responses as R
from .errors import bad_request
from .protocol import CompletionRequest
from .serving import OpenAIServing, Run, now


def _prompt_list(prompt) -> list:
    """The request's prompt as a list of prompts (str or token-id list)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _check_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


async def create_completion(serving: OpenAIServing, req: CompletionRequest,
                            request: Request) -> Response:
    """Validate, admit and answer one completions request (JSON or SSE)."""
    model = serving.check_model(req.model)
    _check_supported(req)
    params = serving.sampling_params(req)
    await serving.check_structured_output(req, params)
    prompts = []
    for prompt in _prompt_list(req.prompt):
        token_ids = await serving.encode(request, prompt, "prompt")
        serving.check_room(params, len(token_ids), "max_tokens")
        text = prompt if isinstance(prompt, str) else None
        prompts.append((token_ids, text))
    response_id, run = serving.start(prompts, params, req.priority, "cmpl",
                                     serving.waited(request), model)
    view = _CompletionView(serving, req, run, response_id, model)
    return await serving.respond(request, run, view.stream if req.stream else None,
                                 view.build)


class _CompletionView:
    """Turns a run's outputs into the completions JSON body or its SSE stream."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, run: Run,
                 response_id: str, model: str):
        self.serving = serving
        self.req = req
        self.run = run
        self.id = response_id
        self.model = model
        self.created = now()
        self.n = run.params.n

    def _prompt_text(self, job) -> str:
        if job.prompt_text is None:
            job.prompt_text = self.serving.tokenizer.decode(job.prompt_ids)
        return job.prompt_text

    def _choice(self, job, completion, text: str, token_ids, logprobs, offset: int):
        choice = {"index": job.prompt_index * self.n + completion.index, "text": text,
                  "logprobs": None, "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if self.req.logprobs is not None:
            choice["logprobs"], offset = R.completion_logprobs(
                token_ids, logprobs, self.req.logprobs, offset, self.serving.tokenizer)
        return choice, offset

    def _echoed(self, job, token_ids, logprobs):
        """Token ids and logprobs with the prompt's in front (echo with logprobs)."""
        if not (self.req.echo and self.req.logprobs is not None):
            return token_ids, logprobs
        prompt_logprobs = job.prompt_logprobs or [None] * len(job.prompt_ids)
        return [*job.prompt_ids, *token_ids], [*prompt_logprobs, *(logprobs or ())]

    def build(self, run: Run) -> dict:
        """The non-streaming body."""
        choices = []
        for job in run.jobs:
            for index in sorted(job.final):
                c = job.final[index]
                if c.finish_reason == "error":
                    raise self.serving.engine_error(c)
                prefix = self._prompt_text(job) if self.req.echo else ""
                token_ids, logprobs = self._echoed(job, c.token_ids, c.logprobs)
                choice, _ = self._choice(job, c, prefix + c.text, token_ids, logprobs, 0)
                if self.req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        body = R.completion_response(self.id, self.created, self.model, choices,
                                     R.usage(run.num_prompt_tokens(),
                                             run.num_completion_tokens()))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = [job.prompt_ids for job in run.jobs]
        return body

    async def stream(self, run: Run):
        """The SSE body: one chunk per completion per update, usage chunk, [DONE]."""
        offsets: dict[int, int] = {}
        try:
            async for job, out in self.serving.events(run):
                for c in out.outputs:
                    if c.finish_reason == "error":
                        yield R.error_event(c.error or "the engine failed this request")
                        yield R.DONE
                        return
                    yield R.sse(self._chunk(job, c, offsets))
        except Exception as exc:
            yield R.exception_event(exc)
            yield R.DONE
            return
        if self.req.include_usage:
            yield R.sse(R.usage_chunk(self.id, "text_completion", self.created, self.model,
                                      self._usage()))
        yield R.DONE

    def _chunk(self, job, c, offsets: dict[int, int]) -> dict:
        index = job.prompt_index * self.n + c.index
        text, token_ids, logprobs = c.delta_text, c.delta_token_ids, c.delta_logprobs
        if index not in offsets and self.req.echo:
            text = self._prompt_text(job) + text
            token_ids, logprobs = self._echoed(job, token_ids, logprobs)
        choice, offsets[index] = self._choice(job, c, text, token_ids, logprobs,
                                              offsets.get(index, 0))
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.delta_token_ids)
        chunk = R.completion_chunk(self.id, self.created, self.model, choice)
        if self.req.include_usage:
            chunk["usage"] = self._usage() if self.req.continuous_usage else None
        return chunk

    def _usage(self) -> dict:
        return R.usage(self.run.num_prompt_tokens(), self.run.num_completion_tokens())

