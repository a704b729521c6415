"""The FastAPI application of one `tidal serve` HTTP process.

    build_app(engine_factory, settings) -> FastAPI

`engine_factory` is an async callable returning a started AsyncLLM (attached to the engine
daemon); it is awaited in the app's lifespan, on the server's own event loop, and the engine
is closed (detached) at shutdown. With `attach_in_background` (`tidal serve`) the server
answers at once while the engine core loads: GET /health (and /ping) 503 `Loading model`,
every other route a 503 that says the model is loading (`LoadingMiddleware`), as
llama-server does, so probes and scripts can wait for /health's 200 instead of hanging.
Tests pass a factory returning a fake engine. Run the app with `Server` (uvicorn's, which on
shutdown first ends every request in flight with an error: streams get an error event and
[DONE] instead of a cut connection).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET /
DELETE /v1/responses/{id}: responses_api.py), GET /v1/models, POST /tokenize,
POST /detokenize, GET /health, GET /metrics, GET /version, GET|POST /ping. With an API key,
every route except health, metrics, version, ping and the API docs needs
`Authorization: Bearer KEY` (401 otherwise); then a body over --max-request-body-bytes is
answered 413 before it is parsed (body_limit.py). Every response carries
`x-tidal-server: <index>`, the `--api-server-count` process that answered it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from importlib import metadata
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response

from .admission import AdmissionController
from .body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import EmbeddingRequest, create_embedding
from .errors import APIError, install_error_handlers, json_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelList, TokenizeRequest,
    TokenizeResponse,
)
from .lora_routes import LoRARegistry, add_lora_routes, model_cards
from .response_store import DEFAULT_STORE_SIZE
from .responses_api import ResponsesAPI, add_responses_routes
from .serving import OpenAIServing
from .ui import PAGE_PATHS, add_ui_routes

logger = logging.getLogger("tidal.serve")
__version__ = metadata.version("tidal")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc", *PAGE_PATHS})
"""Paths served without the API key (the live page's files hold no data; its feed is
guarded)."""

STATS_TIMEOUT_SECONDS = 2.0


@dataclass
class ServerSettings:
    """How one HTTP server process behaves (built by serve.py from the command line)."""

    served_model_names: list[str] | None = None
    """Names clients may use in `model`; None = the engine's served name."""
    api_key: str | None = None
    """When set, requests need `Authorization: Bearer <api_key>`."""
    max_num_queued_reqs: int | None = None
    """Admission limit; None = the engine's `--max-num-queued-reqs` (EngineInfo)."""
    max_num_queued_tokens: int | None = None
    """Admission limit; None = the engine's `--max-num-queued-tokens` (EngineInfo)."""
    max_queue_delay: float | None = None
    """Seconds of estimated wait before a 503; None = the engine's `--max-queue-delay`."""
    admission_slots: Any = None
    """Shared per-process counters of unfinished requests (admission.make_shared_slots)."""
    server_index: int = 0
    """This process's index among the `--api-server-count` processes (its slot)."""
    record_trace: tuple[str, bytes] | None = None
    """(trace file, hash key) from `tidal.engine_core.advice.trace.start_recording`
    (--record-trace)."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Larger request bodies are answered 413 before they are parsed (body_limit.py)."""
    json_any_whitespace: bool = False
    """--structured-outputs-any-whitespace: JSON constraints allow free whitespace unless
    the request says otherwise (serving.py `compact_json`); default compact."""
    attach_in_background: bool = False
    """Serve at once and attach to the engine core meanwhile (503 "loading" until then);
    False: the lifespan waits for the engine, so uvicorn accepts no connection before it
    (`tidal serve`'s servers but the first; tests with a fake engine)."""
    on_attach_failed: Callable[[BaseException], None] | None = None
    """Called when the attach fails (`tidal serve`: the server process ends); None: the
    failure is raised (from the lifespan when it waits for the engine)."""
    on_attached: Callable[[], None] | None = None
    """Called once the attach succeeded and this process serves (`tidal serve`'s first
    server: the others may accept connections from then on)."""
    before_serving: Callable[[], Awaitable[None]] | None = None
    """Awaited after a successful attach that the lifespan waits for, before uvicorn
    accepts a connection (`tidal serve`'s other servers: until the first one serves)."""
    tool_settings: Any = None
    """--enable-auto-tool-choice / --tool-call-parser (`tools.ToolSettings`); None: neither."""
    chat_template: str | None = None
    """--chat-template's text (None: the tokenizer's template)."""
    responses_store_size: int = DEFAULT_STORE_SIZE
    """Responses this process keeps for GET /v1/responses/{id} and previous_response_id
    (an LRU; `--responses-store-size`)."""
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    """--lora-modules: (name, PEFT folder) of each adapter served as a model name."""
    runtime_lora_loads: bool = True
    """Whether /v1/load_lora_adapter may add names (one HTTP process only: lora_routes.py)."""
    ui: bool = True
    """The live page at / and its feed (`--no-ui` turns them off: frontend/server/ui.py)."""


LOADING_RETRY_AFTER_S = 2


class LoadingMiddleware:
    """Pure ASGI middleware: while this process has no engine yet (`app.state.serving` is
    None), /health and /ping answer 503 `Loading model` and every other route (but /version
    and the API docs) a 503 that says so, with Retry-After, instead of waiting."""

    _PASS = frozenset({"/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                       *PAGE_PATHS})

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or getattr(self.state, "serving", None) is not None
                or scope["path"] in self._PASS):
            await self.app(scope, receive, send)
            return
        if scope["path"] in ("/health", "/ping"):
            message = "Loading model"
        else:
            message = ("The model is loading: the server answers once the engine core is "
                       "ready (GET /health answers 200 then); retry later.")
        response = APIError(503, message, headers={
            "Retry-After": str(LOADING_RETRY_AFTER_S)}).response()
        await response(scope, receive, send)


class APIKeyMiddleware:
    """Pure ASGI middleware (keeps disconnect detection intact): 401 without the key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        response = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                            "<key>'.").response()
        await response(scope, receive, send)


class ServerIndexMiddleware:
    """Adds `x-tidal-server: <index>` to every response: which of the N processes answered."""

    def __init__(self, app, index: int):
        self.app = app
        self._header = (b"x-tidal-server", str(index).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class ReceivedAtMiddleware:
    """Stamps `request.state.received_at` (monotonic seconds) as a request enters the
    application, before its body is read and parsed: --max-queue-delay counts the time a
    request then spends in this process (`admission.py`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["received_at"] = time.monotonic()
        await self.app(scope, receive, send)


class Server(uvicorn.Server):
    """uvicorn's server; its graceful shutdown starts by failing every request in flight
    (finish reason "error": an error event then [DONE] for streams, a 5xx for the others),
    so clients learn why instead of seeing the connection cut after the grace period."""

    async def shutdown(self, sockets=None) -> None:
        serving = getattr(self.config.app.state, "serving", None)  # None: never started
        if serving is not None:
            serving.stopping = True  # a request still being tokenized gets a 503
            serving.engine.fail_requests("the HTTP server is shutting down")
        await super().shutdown(sockets)


_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
           404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def build_app(engine_factory: Callable[[], Awaitable[Any]],
              settings: ServerSettings | None = None) -> FastAPI:
    """The application; the engine is created in its lifespan (startup) and closed after."""
    settings = settings or ServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.serving = None
        tasks: list[asyncio.Task] = []
        attaching = asyncio.ensure_future(_attach(app, engine_factory, settings, tasks))
        if not settings.attach_in_background:
            await attaching
            if settings.before_serving is not None and app.state.serving is not None:
                await settings.before_serving()
        try:
            yield
        finally:
            await _stop_tasks([attaching])
            await _stop_tasks(tasks)
            if app.state.serving is not None:
                app.state.serving.close()
                await app.state.engine.close()
                if app.state.serving.recorder is not None:
                    app.state.serving.recorder.close()

    app = FastAPI(title="tidal", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    _add_generate_routes(app)
    add_responses_routes(app)
    add_lora_routes(app)
    _add_info_routes(app)
    add_ui_routes(app, settings.ui)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(LoadingMiddleware, state=app.state)
    app.add_middleware(ServerIndexMiddleware, index=settings.server_index)
    app.add_middleware(ReceivedAtMiddleware)  # added last: the outermost, so the first to run
    return app


async def _attach(app: FastAPI, engine_factory, settings: ServerSettings,
                  tasks: list[asyncio.Task]) -> None:
    """Attach to the engine core, then serve (`app.state.serving` set, background tasks
    appended to `tasks`). A failure goes to `settings.on_attach_failed` where there is one."""
    try:
        engine = await engine_factory()
    except Exception as exc:
        if settings.on_attach_failed is None:
            raise
        settings.on_attach_failed(exc)
        return
    tasks += _start_state(app, engine, settings)
    if settings.on_attached is not None:
        settings.on_attached()


async def _stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel the background tasks and wait until each has ended. A cancel can be lost: on
    Python < 3.12 `asyncio.wait_for` swallows one that lands just as its inner call completes
    (CPython gh-86296), and a loop around it then runs on; the admission refresh loop did,
    hanging the server's shutdown (seen under load in CI). So they are cancelled again until
    they have ended."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
    await asyncio.gather(*tasks, return_exceptions=True)  # all ended: fetch their outcomes


def _start_state(app: FastAPI, engine, settings: ServerSettings) -> list[asyncio.Task]:
    """Build the per-process state on app.state; start the background tasks."""
    info = engine.engine_info
    names = settings.served_model_names or [engine.model_name]
    metrics = ServerMetrics(names[0])
    limit = settings.max_num_queued_reqs or info.max_num_queued_reqs
    token_limit = settings.max_num_queued_tokens or info.max_num_queued_tokens
    delay = settings.max_queue_delay or info.max_queue_delay
    admission = AdmissionController(limit, settings.admission_slots, settings.server_index,
                                    on_reject=metrics.count_rejection, token_limit=token_limit,
                                    max_queue_delay=delay)
    app.state.engine = engine
    app.state.metrics = metrics
    recorder = None
    if settings.record_trace is not None:
        from ...engine_core.advice.trace import TraceRecorder

        recorder = TraceRecorder(*settings.record_trace)
    app.state.serving = OpenAIServing(engine, names, admission, metrics, recorder,
                                      settings.tool_settings, settings.chat_template)
    app.state.serving.json_any_whitespace = settings.json_any_whitespace
    app.state.serving.loras = LoRARegistry(settings.lora_modules,
                                           getattr(info, "max_lora_rank", 0), names,
                                           settings.runtime_lora_loads)
    app.state.responses = ResponsesAPI(app.state.serving, settings.responses_store_size,
                                       settings.server_index)
    app.state.root = getattr(info, "model", None)
    logger.info("HTTP server %d attached: serving %s (max_model_len %d%s%s%s)",
                settings.server_index, ", ".join(names), info.max_model_len,
                f", at most {limit} unfinished requests" if limit else "",
                f", at most {token_limit} queued prompt tokens" if token_limit else "",
                f", 503 beyond an estimated {delay:g} s wait" if delay else "")
    tasks = []
    if admission.limited:
        tasks.append(asyncio.ensure_future(admission.refresh_loop(engine.get_stats)))
    return tasks


def _add_generate_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        """OpenAI completions (`stream: true` answers with server-sent events)."""
        return await create_completion(request.app.state.serving, req, request)

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions through the model's chat template."""
        return await create_chat_completion(request.app.state.serving, req, request)

    @app.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, request: Request) -> Response:
        """OpenAI embeddings, from a server started with --runner pooling."""
        return await create_embedding(request.app.state.serving, req, request)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_ERRORS})
    async def tokenize(req: TokenizeRequest, request: Request) -> Response:
        """Token ids of a prompt, or of messages through the chat template."""
        serving = request.app.state.serving
        chars = None if req.prompt is None else len(req.prompt)
        return json_response(await serving.off_loop(serving.tokenize, req, chars=chars))

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_ERRORS})
    async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
        """Text of a list of token ids."""
        serving = request.app.state.serving
        return json_response(await serving.off_loop(serving.detokenize, req,
                                                    chars=len(req.tokens)))


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/v1/models", responses={200: {"model": ModelList}})
    async def models(request: Request) -> Response:
        """The served model (one card per served name)."""
        serving = request.app.state.serving
        created = int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "tidal",
                  "root": request.app.state.root, "parent": None,
                  "max_model_len": serving.max_model_len, "permission": []}
                 for name in serving.served_names]
        cards += model_cards(serving.loras, serving.served_names[0], created)
        return json_response({"object": "list", "data": cards})

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while an engine core serves this process; 503 once it is dead, and 503 with
        Retry-After while none is attached."""
        try:
            request.app.state.serving.check_alive()
        except APIError as exc:
            return exc.response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text: this server's request metrics and the engine core's snapshot."""
        stats = await _core_stats(request.app.state.engine)
        return Response(request.app.state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)


async def _core_stats(engine):
    """The engine core's SchedulerStats; when it does not answer in time (a long step, a busy
    event loop) the last snapshot this process received, or None if there is none."""
    try:
        return await asyncio.wait_for(engine.get_stats(), STATS_TIMEOUT_SECONDS)
    except Exception as exc:
        latest = getattr(engine, "latest_stats", None)
        logger.warning("/metrics: the engine core did not answer a stats query (%r); %s", exc,
                       "using the last snapshot" if latest is not None else "no core metrics")
        return latest

