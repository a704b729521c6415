"""One OpenAI request end to end: validate, admit, generate through AsyncLLM, answer.

Order of work for /v1/completions and /v1/chat/completions (everything that can fail because
of the request fails before admission, and admission happens before any byte is sent, so a
streaming request also gets a real 400 / 503 status):

    check model -> SamplingParams (ValueError -> 400) -> [--max-queue-delay: 503 if even
    an empty prompt would wait too long] -> prompts to token ids (too long -> 400; a text
    too long to possibly fit, `max_prompt_chars`: 400 untokenized) -> admission (503)
    -> one engine request per prompt (n completions each) -> JSON body, or server-sent events

(The bracketed check, made when the request's turn in the tokenizer pool comes, is the one
exception to "the request's own faults first": under a burst the pool is a queue of its own,
and a request that cannot make the limit anyway is answered without being tokenized,
`admission.py`.)

Tokenizing and the chat template run in thread pools (`off_loop`), never on the event loop:
a prompt of megabytes takes seconds to tokenize, and meanwhile this process's other streams
and its heartbeat to the engine core must go on (a silent frontend is dropped). Small prompts
have a lane of their own, so that they never queue behind huge ones (`SMALL_PROMPT_CHARS`);
and a text longer than the context could hold is refused before any tokenizing: each token
is at most the vocabulary's longest token long (`longest_token_chars`).

A `Run` holds what one HTTP request started (its engine requests and its admission ticket);
`Run.close()` always runs, whatever ends the request (finished, error, client gone): it
aborts the engine requests that are still unfinished (so their KV blocks are freed) and
releases the admission ticket. For a stream it runs when the response ends (`_EngineStream`);
for a plain request, the handler races the generation against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..chat_template import RESERVED_TEMPLATE_KWARGS, has_chat_template, render_chat_text
from .admission import AdmissionController
from .errors import (
    APIError, bad_request, engine_unavailable, from_value_error, json_response,
)
from .lora_routes import LoRARegistry
from .metrics import ServerMetrics
from ..tools import ToolSettings, template_messages
from .protocol import (
    MAX_N, ChatMessage, DetokenizeRequest, TokenizeRequest,
)
from ...ipc.messages import check_priority

logger = logging.getLogger("tidal.serve")

TOKENIZER_THREADS = 4
"""Threads per HTTP process for tokenizing and chat templates (HF fast tokenizers release the
GIL while they work, so a big prompt does not stop the event loop)."""
SMALL_PROMPT_CHARS = 16_384
"""Prompts of at most this many characters (a conversation: its messages' text) are tokenized
in a lane of their own, `SMALL_LANE_THREADS` threads, so they never wait behind huge ones:
four prompts of a million characters held all `TOKENIZER_THREADS` for about 3 s each here
(the tiny test tokenizer, a shared 2-core machine), where this many characters take ~50 ms."""
SMALL_LANE_THREADS = TOKENIZER_THREADS
"""As many as the main pool's: a burst of small prompts is served as fast as before the lanes
(it queued for the same 4 threads)."""


class _Job:
    """One engine request: one prompt and its n completions (latest output per completion)."""

    __slots__ = ("req_id", "prompt_index", "prompt_ids", "prompt_text", "gen", "finished",
                 "final", "metrics", "prefilled", "prompt_logprobs", "arrival_time",
                 "priority")

    def __init__(self, req_id: str, prompt_index: int, prompt_ids: list[int],
                 prompt_text: str | None, arrival_time: float = 0.0, priority: int = 0):
        self.req_id = req_id
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.gen = None  # the AsyncLLM.generate iterator once started
        self.finished = False
        self.final: dict = {}  # completion index -> latest CompletionOutput (cumulative)
        self.metrics = None
        self.prefilled: set[int] = set()  # completions whose first token came back
        self.prompt_logprobs = None  # with SamplingParams.prompt_logprobs, once they arrive
        self.arrival_time = arrival_time  # time.time() at admission (for --record-trace)
        self.priority = priority


class Run:
    """Everything one HTTP request started; `close()` aborts leftovers and frees the slot."""

    def __init__(self, serving: "OpenAIServing", jobs: list[_Job], params, priority: int,
                 ticket):
        self.serving = serving
        self.jobs = jobs
        self.params = params
        self.priority = priority
        self.ticket = ticket
        self.closed = False
        self.lora = None  # the LoRA adapter the request's `model` named, if any

    def num_prompt_tokens(self) -> int:
        return sum(len(job.prompt_ids) for job in self.jobs)

    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for job in self.jobs for c in job.final.values())

    async def close(self) -> None:
        """Abort unfinished engine requests and release admission; shielded, idempotent."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            engine = self.serving.engine
            for job in self.jobs:
                await _close_iterator(job.gen)
                if not job.finished and job.gen is not None:
                    self.serving.metrics.observe_finished(None, "abort")
                    self.serving.record(job, "abort")
                    try:
                        await engine.abort(job.req_id)
                    except Exception as exc:  # the engine is gone: nothing left to free
                        logger.debug("abort %s failed: %s", job.req_id, exc)
            self.ticket.release()


async def _close_iterator(gen) -> None:
    if gen is None:
        return
    try:
        await gen.aclose()
    except (RuntimeError, StopAsyncIteration):  # still running in a cancelled pump task
        pass
    except Exception as exc:
        logger.debug("closing a generate() iterator raised %r", exc)


class _EngineStream(StreamingResponse):
    """A server-sent-event response that closes its `Run` however the stream ends."""

    def __init__(self, body: AsyncIterator[bytes], run: Run):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await _close_iterator(self.body_iterator)
                await self._run.close()


class _ClientGone(Exception):
    """The client closed the connection before its (non-streaming) answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work) -> None:
    """Run `work` (a coroutine) unless the client goes away first (then raise _ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    task.result()


def compact_json(params, req, any_whitespace: bool) -> None:
    """A JSON constraint of an HTTP request is compact by default, as the OpenAI API writes
    JSON: the grammar allows no free whitespace between tokens, or a model that can emit
    newlines inside an object (SmolLM2 through LangChain's `with_structured_output`) writes
    them until max_tokens. `structured_outputs: {"disable_any_whitespace": false}` in the
    request (alone, beside response_format, or with its constraint) or the server's
    --structured-outputs-any-whitespace allow free whitespace."""
    spec = params.structured_outputs
    if spec is None or spec.kind not in ("json", "json_object"):
        return
    given = getattr(req, "structured_outputs", None)
    if isinstance(given, dict) and "disable_any_whitespace" in given:
        spec.disable_any_whitespace = bool(given["disable_any_whitespace"])
    else:
        spec.disable_any_whitespace = not any_whitespace


class OpenAIServing:
    """The OpenAI endpoints of one server process, on top of one AsyncLLM."""

    def __init__(self, engine, served_names: list[str], admission: AdmissionController,
                 metrics: ServerMetrics, recorder=None, tool_settings: ToolSettings | None = None,
                 chat_template: str | None = None):
        self.engine = engine
        self.tool_settings = tool_settings or ToolSettings()
        """--enable-auto-tool-choice and --tool-call-parser (frontend/tools)."""
        self.chat_template = chat_template
        """--chat-template's text, used instead of the tokenizer's template; None: the
        tokenizer's."""
        self.served_names = served_names
        self.admission = admission
        self.metrics = metrics
        self.recorder = recorder
        """A `tidal.engine_core.advice.trace.TraceRecorder` (--record-trace), or None."""
        self.tokenizer = engine.tokenizer
        self.vocab_size = _vocab_size(self.tokenizer, engine.engine_info)
        self.scheduling_policy = engine.engine_info.scheduling_policy
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tidal-tokenize")
        self._small_pool = ThreadPoolExecutor(SMALL_LANE_THREADS,
                                              thread_name_prefix="tidal-tokenize-small")
        self.stopping = False  # the server is shutting down: 503 from now on
        self.json_any_whitespace = False
        """--structured-outputs-any-whitespace: JSON constraints allow free whitespace
        between tokens unless the request says otherwise (`compact_json`)."""
        self.loras = LoRARegistry([], 0, served_names)
        """LoRA adapters served as model names (lora_routes.py; set up by the app)."""

    @property
    def max_model_len(self) -> int:
        return self.engine.engine_info.max_model_len  # a re-attached core may say otherwise

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a text prompt can have and still fit the context: each token
        is at most `max_token_chars` long (`longest_token_chars`)."""
        return self.max_model_len * self.max_token_chars

    async def off_loop(self, fn, *args, chars: int | None = None, **kwargs):
        """`fn(*args, **kwargs)` in a tokenizer thread pool, awaited: the small lane when the
        work is on at most SMALL_PROMPT_CHARS characters (`chars`), else the main pool."""
        small = chars is not None and chars <= SMALL_PROMPT_CHARS
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self._small_pool if small else self._pool, call)

    async def constrain_to_tools(self, plan, constraint, params,
                                 format_field: str) -> None:
        """A tool plan's grammar (`constraint`, None when its choice has none) as the request's
        structured output, compiled by the engine's check; the plan's markers kept in the text
        where they are special tokens. 400s: a structured output already there (named by
        `format_field`: response_format, text.format), a grammar the check refuses (tools)."""
        if constraint is not None:
            if params.structured_outputs is not None:
                raise bad_request(f"{format_field} cannot be combined with tools under "
                                  f"tool_choice {plan.choice.mode!r}: the tool calls' grammar "
                                  "constrains the output already", format_field)
            params.structured_outputs = constraint
            try:
                await self.engine.check_structured_outputs(params)
            except ValueError as exc:
                raise bad_request(f"tools: the tool-call grammar is refused: {exc}",
                                  "tools") from None
        if plan is not None and plan.active and not plan.parser.skip_special_tokens:
            params.skip_special_tokens = False  # the format's markers are special tokens

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._small_pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- validation helpers

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if model is None:
            return self.served_names[0]
        if model in self.served_names or self.loras.get(model) is not None:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_alive(self) -> None:
        """503 when the engine is dead, 503 with Retry-After while no core is attached or
        the server is stopping."""
        if self.stopping:
            raise engine_unavailable("This server is shutting down.")
        if self.engine.dead:
            raise APIError(503, "The engine is not running; this server cannot generate.")
        if not self.engine.attached:
            raise engine_unavailable(f"No engine core is attached ({self.engine.away_reason}); "
                                     "this server re-attaches when one is back.")

    def engine_error(self, completion) -> APIError:
        """A completion the engine failed: 503 (with Retry-After) if the core is away now or
        the server is stopping, else 500; never the client's fault."""
        message = completion.error or "the engine failed this request"
        if self.stopping or (not self.engine.attached and not self.engine.dead):
            return engine_unavailable(message)
        return APIError(500, message)

    @staticmethod
    def received_at(request: Request) -> float:
        """When this process received `request` (monotonic seconds: `ReceivedAtMiddleware`'s
        stamp; now without it)."""
        return getattr(request.state, "received_at", None) or time.monotonic()

    @classmethod
    def waited(cls, request: Request) -> float:
        """Seconds since this process received `request`."""
        return time.monotonic() - cls.received_at(request)

    async def tokenizing(self, request: Request, fn, *args, chars: int | None = None):
        """`fn(*args)` in the tokenizer pool for `request` (the lane `chars` picks, as
        `off_loop`); under --max-queue-delay, once its turn comes, first a 503 if even
        without its own prompt it would now wait too long (a burst queues here: such a
        request is answered without being tokenized)."""
        received = self.received_at(request)

        def when_its_turn_comes():
            self.admission.check_wait(0, time.monotonic() - received)
            return fn(*args)

        return await self.off_loop(when_its_turn_comes, chars=chars)

    def check_token_ids(self, token_ids, param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(f"{param} contains token id {token_id}, outside the "
                                  f"vocabulary [0, {self.vocab_size})", param)

    async def encode(self, request: Request, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of one of `request`'s prompts, made off the event loop (`tokenizing`, in
        the lane its size picks); 400 when empty or too long, before any tokenizing when it
        cannot possibly fit (`check_prompt_size`)."""
        self.check_prompt_size(prompt, param)
        return await self.tokenizing(request, self._encode, prompt, param, chars=len(prompt))

    def check_prompt_size(self, prompt: str | list[int], param: str) -> None:
        """400 for a prompt that cannot fit the context whatever its tokens: a list of
        max_model_len ids or more, a text of more than `max_prompt_chars` characters."""
        if isinstance(prompt, list):
            if len(prompt) >= self.max_model_len:
                raise self._too_long(len(prompt), param)
            return
        if len(prompt) > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, which "
                f"hold at most {self.max_prompt_chars} characters (its longest token has "
                f"{self.max_token_chars}), but the {param} has {len(prompt)} characters; it "
                f"was refused without tokenizing. Please shorten the {param}.", param)

    def _too_long(self, num_tokens: int, param: str) -> APIError:
        return bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens, but "
            f"the {param} has {num_tokens} tokens, which leaves no room to generate. "
            f"Please shorten the {param}.", param)

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, list):
            self.check_token_ids(prompt, param)
        try:
            token_ids = list(self.engine.encode_prompt(prompt))
        except (ValueError, TypeError) as exc:  # the tokenizer refused this input
            raise bad_request(str(exc), param) from None
        if not token_ids:
            raise bad_request(f"{param} must not be empty", param)
        if len(token_ids) >= self.max_model_len:
            raise self._too_long(len(token_ids), param)
        return token_ids

    def check_room(self, params, prompt_len: int, param: str) -> None:
        """400 when prompt + max_tokens does not fit the context (all numbers named)."""
        if params.max_tokens is not None and prompt_len + params.max_tokens > self.max_model_len:
            raise bad_request(
                f"'{param}' is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {prompt_len} "
                f"input tokens ({params.max_tokens} > {self.max_model_len} - {prompt_len}).",
                param)

    def sampling_params(self, req, renames: dict | None = None):
        """The request's SamplingParams; a ValueError becomes a 400 naming the field."""
        if getattr(self.engine.engine_info, "pooler", None) is not None:  # vLLM's 400
            raise bad_request("The model does not support generation: this server runs an "
                              "embedding model (--runner pooling); use /v1/embeddings.",
                              "model")
        try:
            params = req.to_sampling_params()
        except ValueError as exc:
            raise from_value_error(exc, renames) from None
        if params.top_k > self.vocab_size:  # larger than the vocabulary means "all tokens"
            params.top_k = 0
        compact_json(params, req, self.json_any_whitespace)
        return params

    async def check_structured_output(self, req, params) -> None:
        """A 400 naming the request's field when its output constraint does not compile
        (checked before admission, so a stream gets a real 400 too)."""
        if params.structured_outputs is None:
            return
        try:
            await self.engine.check_structured_outputs(params)
        except ValueError as exc:
            field = req.structured_output()[1]
            message = str(exc)
            if " does not compile: " in message:
                message = f"{field} does not compile: {message.split(' does not compile: ')[1]}"
            elif field != "structured_outputs":
                message = f"{field}: {message}"
            raise bad_request(message, field) from None

    # ---------------------------------------------------------------- generation

    def start(self, prompts: list[tuple[list[int], str | None]], params, priority: int,
              prefix: str, waited_s: float = 0.0, model: str | None = None
              ) -> tuple[str, Run]:
        """Admit the request, which reached this process `waited_s` ago (503 if full), and
        create its engine jobs (not yet started)."""
        self.check_alive()
        self._check_still_served(model)
        try:
            check_priority(priority, self.scheduling_policy)
        except ValueError as exc:
            raise bad_request(str(exc), "priority") from None
        num_reqs = len(prompts) * params.n
        if num_reqs > MAX_N:
            raise bad_request(f"n times the number of prompts must be at most {MAX_N}, got "
                              f"{num_reqs}", "n")
        num_tokens = params.n * sum(len(ids) for ids, _ in prompts)
        ticket = self.admission.admit(num_reqs, num_tokens, waited_s)
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.time()
        jobs = [_Job(f"{response_id}-{i}", i, ids, text, arrival, priority)
                for i, (ids, text) in enumerate(prompts)]
        run = Run(self, jobs, params, priority, ticket)
        run.lora = self.loras.get(model)  # an adapter's name: run with it
        return response_id, run

    def _check_still_served(self, model: str | None) -> None:
        """404 for an adapter unloaded since `check_model` (while the prompt was tokenized):
        the request must not run on the base model instead."""
        if model is not None and model not in self.served_names and \
                self.loras.get(model) is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _note(self, run: Run, job: _Job, out) -> None:
        if out.prompt_logprobs is not None:
            job.prompt_logprobs = out.prompt_logprobs
        for completion in out.outputs:
            job.final[completion.index] = completion
            if completion.index not in job.prefilled and (completion.token_ids
                                                          or completion.finished):
                job.prefilled.add(completion.index)
                run.ticket.prefill_done(len(job.prompt_ids))
        if out.finished and not job.finished:
            job.finished = True
            job.metrics = out.metrics
            reasons = [c.finish_reason for c in job.final.values()]
            self.metrics.observe_finished(out.metrics, reasons[0] if reasons else None)
            self.record(job)

    def record(self, job: _Job, reason: str | None = None) -> None:
        """One trace line per completion of a job that ended (--record-trace): arrival,
        prompt length and hashes, output length; never text. A request aborted before its
        first token has no completion yet and leaves no line."""
        if self.recorder is None:
            return
        for completion in job.final.values():
            try:
                self.recorder.record(job.arrival_time, job.prompt_ids,
                                     len(completion.token_ids), job.priority,
                                     reason or completion.finish_reason)
            except OSError as exc:  # a full disk must not fail the request
                logger.warning("--record-trace: cannot write: %s", exc)

    async def _one(self, run: Run, job: _Job):
        job.gen = self.engine.generate(job.prompt_ids, run.params, job.req_id,
                                       priority=run.priority, **(
                                           {"lora_request": run.lora} if run.lora else {}))
        async for out in job.gen:
            self._note(run, job, out)
            yield job, out

    async def events(self, run: Run) -> AsyncIterator:
        """(job, RequestOutput) updates of every job of the run, as they come."""
        if len(run.jobs) == 1:
            async for item in self._one(run, run.jobs[0]):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for item in self._one(run, job):
                    queue.put_nowait(item)
            except BaseException as exc:  # forwarded to the consumer, which re-raises
                queue.put_nowait((job, exc))
                return
            queue.put_nowait((job, None))

        tasks = [asyncio.ensure_future(pump(job)) for job in run.jobs]
        try:
            remaining = len(tasks)
            while remaining:
                job, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield job, item
        finally:
            for task in tasks:
                task.cancel()

    async def drain(self, run: Run) -> None:
        """Run every job to completion (non-streaming requests)."""
        async for _ in self.events(run):
            pass

    async def respond(self, request: Request, run: Run, stream_body, build) -> Response:
        """Stream (`stream_body(run)` yields SSE bytes) or answer once (`build(run)` dict)."""
        if stream_body is not None:
            return _EngineStream(stream_body(run), run)
        try:
            await _until_disconnect(request, self.drain(run))
            return json_response(build(run))
        except _ClientGone:
            return Response(status_code=499)
        except ValueError as exc:  # the engine core refused the request: bad input, a 400
            raise from_value_error(exc) from None
        except RuntimeError as exc:
            if self.engine.dead:  # died while this request ran
                raise APIError(503, f"The engine is not running: {exc}") from None
            if not self.engine.attached:  # went away while this request ran
                raise engine_unavailable(str(exc)) from None
            raise
        finally:
            await run.close()

    # ---------------------------------------------------------------- chat template

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False,
                    template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The conversation through the chat template (--chat-template's, else the
        tokenizer's; `tools` handed to it as `tools=`), as token ids (blocking: call it
        through `off_loop`); a rendered text too long to possibly fit is refused untokenized
        (`check_prompt_size`)."""
        if self.chat_template is None and not has_chat_template(self.tokenizer):
            raise bad_request("This model has no chat template; use /v1/completions, or "
                              "start the server with --chat-template FILE.", "messages")
        conversation = []
        for message in messages:
            item = {"role": message.role, "content": message.text()}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(message, key):
                    item[key] = getattr(message, key)
            conversation.append(item)
        extra = {k: v for k, v in (template_kwargs or {}).items()
                 if k not in RESERVED_TEMPLATE_KWARGS}
        if tools:
            extra["tools"] = tools
        try:
            text = render_chat_text(
                self.tokenizer, template_messages(conversation),
                chat_template=self.chat_template,
                continue_final_message=continue_final_message,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                chat_template_kwargs=extra)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        self.check_prompt_size(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------- tokenize endpoints

    def tokenize(self, req: TokenizeRequest) -> dict:
        """The /tokenize answer (blocking: call it through `off_loop`)."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of `prompt` and `messages`.", "prompt")
        if req.messages is not None:
            token_ids = self.render_chat(req.messages, req.add_generation_prompt)
        else:
            token_ids = self.tokenizer.encode(req.prompt,
                                              add_special_tokens=req.add_special_tokens)
        out = {"count": len(token_ids), "max_model_len": self.max_model_len,
               "tokens": token_ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(token_ids)
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """The /detokenize answer (blocking: call it through `off_loop`)."""
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}


def longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token, as stored: a byte-level token stores one
    character per byte, at least as many as its text has. A text of N characters thus holds
    at least N / this many tokens, for a tokenizer that keeps every character (byte-level
    BPE, SentencePiece with byte fallback); one that drops characters (a BERT normalizer) or
    fuses a run of unknown ones into one token could fit more. Measured: 13 for the tiny
    test model, 41 for the demo model, 81 for SmolLM2 (a run of 80 '#')."""
    return max(map(len, tokenizer.get_vocab()), default=1) or 1


def _vocab_size(tokenizer, info) -> int:
    """Token ids a prompt may hold: the tokenizer's, within the model's (EngineInfo)."""
    model_vocab = getattr(info, "vocab_size", 0)
    return min(len(tokenizer), model_vocab) if model_vocab else len(tokenizer)


def now() -> int:
    """The `created` timestamp of a response: whole seconds since the epoch."""
    return int(time.time())
