"""The live page of the engine at `/` (and its feed, which `tidal top` reads too).

    GET /              the page (frontend/server/ui_assets/index.html, app.js, style.css),
    GET /ui/app.js     served without the API key: they hold no data, and a browser cannot
    GET /ui/style.css  send a header when it navigates (the page asks for the key and sends it)
    GET /ui/view       one snapshot as JSON (?since=STEP: the steps after that one)
    GET /ui/events     server-sent events: a snapshot about 4 times a second

A snapshot: the engine core's counters and live batch view (`ipc/batch_view.py`: the recent
steps, KV blocks, the queue by priority, warnings), this process's recent TTFT and ITL
percentiles, and with `-dp N` each core's own. One `ViewFeed` per HTTP process polls the
engine core only while someone watches (a page open, a `tidal top`), so a server nobody looks
at pays nothing; each viewer has a queue of `VIEWER_QUEUE` snapshots and loses the oldest when
it does not read (a stalled client holds no more memory), and at most `MAX_VIEWERS` streams
are open at once per process (503 beyond).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .errors import APIError
from .metrics import RecentLatencies

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "ui_assets"
PAGE_PATHS = {"/": ("index.html", "text/html; charset=utf-8"),
              "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
"""The page's own files: open without the API key, and while the model loads."""
POLL_S = 0.25
"""Seconds between two snapshots while someone watches."""
VIEWER_QUEUE = 4
MAX_VIEWERS = 100
_encode = msgspec.json.Encoder().encode


class ViewFeed:
    """Polls the engine core for the live view while at least one viewer is subscribed."""

    def __init__(self, engine, latencies: RecentLatencies, model: str) -> None:
        self.engine = engine
        self.latencies = latencies
        self.model = model
        self.viewers: set[asyncio.Queue] = set()
        self.last_step = 0
        self._task: asyncio.Task | None = None

    def subscribe(self) -> asyncio.Queue:
        if len(self.viewers) >= MAX_VIEWERS:
            raise APIError(503, f"{MAX_VIEWERS} live views are open on this server process; "
                           "close one", headers={"Retry-After": "5"})
        queue: asyncio.Queue = asyncio.Queue(VIEWER_QUEUE)
        self.viewers.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._poll())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.viewers.discard(queue)

    async def snapshot(self, since: int) -> dict:
        """One snapshot: the engine's stats and view (steps after `since`), our latencies."""
        stats = await asyncio.wait_for(self.engine.get_stats(view_since=max(0, since)), 2.0)
        return self._to_json(stats)

    def _to_json(self, stats) -> dict:
        out = {"time": time.time(), "model": self.model, "stats": _as_dict(_counters(stats)),
               "latency": self.latencies.percentiles()}
        out["cores"] = [{"stats": _as_dict(_counters(core)), "view": _as_dict(core.view)}
                        for core in stats.cores or [stats]]
        return out

    async def _poll(self) -> None:
        """Until nobody watches: a snapshot every POLL_S to every viewer."""
        while self.viewers:
            started = time.monotonic()
            try:
                snap = await self.snapshot(self.last_step)
            except Exception as exc:  # the engine away or slow: say so, try again
                snap = {"time": time.time(), "error": str(exc) or type(exc).__name__}
            else:
                steps = [s["step_id"] for core in snap["cores"] if core["view"]
                         for s in core["view"]["steps"]]
                if steps and len(snap["cores"]) == 1:
                    self.last_step = max(steps)
            data = b"data: " + _encode(snap) + b"\n\n"
            for queue in list(self.viewers):
                if queue.full():  # a viewer that does not read loses its oldest snapshot
                    queue.get_nowait()
                queue.put_nowait(data)
            await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - started)))


def _as_dict(value):
    """A wire struct (array-like: a list on the wire) as JSON objects, for the page."""
    if isinstance(value, msgspec.Struct):
        return {name: _as_dict(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [_as_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_dict(v) for k, v in value.items()}
    return value


def _counters(stats):
    """The snapshot without its nested parts (the view and the cores go apart)."""
    return msgspec.structs.replace(stats, cores=[], view=None)


def add_ui_routes(app: FastAPI, enabled: bool) -> None:
    """The page and its feed (`--no-ui`: neither; `/` then answers 404 saying so)."""

    def page_file(path: str) -> Response:
        if not enabled:
            raise APIError(404, "the web page is turned off on this server (--no-ui)")
        name, media_type = PAGE_PATHS[path]
        return Response((ASSETS / name).read_bytes(), media_type=media_type,
                        headers={"Cache-Control": "no-cache"})

    for path in PAGE_PATHS:
        app.add_api_route(path, (lambda p: lambda: page_file(p))(path), methods=["GET"],
                          include_in_schema=False)

    def feed(request: Request) -> ViewFeed:
        if not enabled:
            raise APIError(404, "the live view is turned off on this server (--no-ui)")
        state = request.app.state
        request.app.state.serving.check_alive()
        if getattr(state, "view_feed", None) is None:
            state.view_feed = ViewFeed(state.engine, state.metrics.recent,
                                       state.serving.served_names[0])
        return state.view_feed

    @app.get("/ui/view", include_in_schema=False)
    async def view(request: Request, since: int = 0) -> Response:
        """One snapshot (for `tidal top` and scripts)."""
        snap = await feed(request).snapshot(since)
        return Response(_encode(snap), media_type="application/json")

    @app.get("/ui/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        """A snapshot about 4 times a second, as server-sent events, until the client goes."""
        source = feed(request)
        queue = source.subscribe()

        async def stream():
            try:
                while True:
                    try:
                        yield await asyncio.wait_for(queue.get(), 15.0)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
            finally:
                source.unsubscribe(queue)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
