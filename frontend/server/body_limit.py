"""How large a request body an HTTP server process reads: `--max-request-body-bytes`.

A body is read whole, then parsed (JSON, then pydantic) on the event loop, before any of its
fields is checked: its size alone decides what it costs this process, and every other
stream of the process waits while it is parsed. `BodyLimitMiddleware` answers 413 before
that, with the OpenAI error body naming the limit and its flag:

    Content-Length over the limit         413 at once; nothing of the body is read
    no Content-Length (chunked upload)    counted as it arrives; 413 once past the limit

Either way the handler never holds more than the limit. uvicorn reads and drops what is left
of a refused body (for at most --timeout-request-header, timeouts.py), so a client that sends
its whole body before reading the answer still gets the 413 rather than a reset connection.

The prompt inside a body that passes has a limit of its own, in characters, from the model's
context (serving.py `max_prompt_chars`): a text too long to fit is refused untokenized.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a prompt of a million tokens fits, as text (about 4 bytes a token) or as token ids
(about 7 bytes each in JSON). Parsing the largest body then takes the event loop about
0.15 s for text and about 2 s for token ids (measured here, on a shared 2-core machine)."""


class BodyTooLarge(HTTPException):
    """Raised by the limited `receive` once a body without Content-Length passes the limit.
    FastAPI re-raises an HTTPException met while reading a body, and the server's error
    handlers (errors.py) answer it with the OpenAI error body."""

    def __init__(self, limit: int, size: int | None = None):
        got = "is larger" if size is None else f"has {size} bytes, more"
        super().__init__(413, f"The request body {got} than this server's limit of {limit} "
                              "bytes (--max-request-body-bytes).")


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 for a request body over `limit` bytes (module docstring)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            from .errors import APIError

            refused = BodyTooLarge(self.limit, declared)
            await APIError(413, refused.detail).response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive):
        """`receive` that raises BodyTooLarge once the body's bytes pass the limit."""
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return receive_within_limit


def _content_length(scope) -> int | None:
    """The request's Content-Length, or None (absent or not a number: uvicorn refuses a
    malformed one before the application sees the request)."""
    value = Headers(scope=scope).get("content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
