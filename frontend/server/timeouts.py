"""How long a connection may keep an HTTP server process waiting for its request.

uvicorn times out only the idle time between two requests of a kept-alive connection
(`timeout_keep_alive`, armed when a response completes). A connection opened and left
silent, one that sends half a request head, or one that announces a body and stops or
trickles it, would hold a socket (and, for a body, a handler task) forever: a handful of
such clients exhaust the process. `timed_http_protocol` returns uvicorn's HTTP protocol with
two more deadlines, one event-loop timer per connection, nothing per byte:

    --timeout-keep-alive S      idle between two requests (uvicorn's own; vLLM's flag name)
    --timeout-request-header S  from a connection's opening, or from the first byte after a
                                keep-alive idle, to the end of the request head: the
                                connection is closed
    --timeout-request-body S    from the end of the head to the end of the body: answered
                                408 (OpenAI error body) and closed

A request being handled (generating, streaming) has no deadline: these bound only reading.
"""

from __future__ import annotations

import asyncio

DEFAULT_TIMEOUT_KEEP_ALIVE_S = 30
"""Idle seconds between two requests on one connection. Longer than uvicorn's and vLLM's 5
so that a load balancer's idle timeout (often 60 s; set it shorter than this, or raise this
past it) or a client's pool rarely races the server's close."""
DEFAULT_TIMEOUT_REQUEST_HEADER_S = 10.0
"""Seconds for a request head (a few hundred bytes) to arrive."""
DEFAULT_TIMEOUT_REQUEST_BODY_S = 60.0
"""Seconds for a request body to arrive once its head has (a prompt of many MB on a slow
link may need more)."""


def timed_http_protocol(header_timeout: float, body_timeout: float) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11: uvicorn's "auto")
    with the request head and body deadlines, for `uvicorn.Config(http=...)`."""
    base = _auto_protocol()
    return type(f"ReadTimeouts{base.__name__}", (_ReadTimeouts, base),
                {"header_timeout": header_timeout, "body_timeout": body_timeout,
                 "body_timeout_response": _request_timeout_response(body_timeout)})


def _auto_protocol() -> type:
    try:
        import httptools  # noqa: F401 - what uvicorn's "auto" checks
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


class _ReadTimeouts:
    """Mixed in before a uvicorn protocol class. Reads the protocol's `cycle` (the request in
    progress: `more_body` while its body is arriving, `response_started`, `response_complete`),
    which both of uvicorn's HTTP/1.1 implementations keep."""

    header_timeout: float
    body_timeout: float
    body_timeout_response: bytes

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._await_head()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head arrived
            self._await_body()
        elif cycle is not None and not cycle.more_body and self._read_timer is not None \
                and not cycle.response_complete:
            self._cancel_read_timer()  # its body is complete
        elif self._read_timer is None and (cycle is None or cycle.response_complete):
            self._await_head()  # the first bytes after a keep-alive idle

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # uvicorn's keep-alive timer now watches the idle
        self._cancel_read_timer()
        if self.cycle is not cycle:  # a pipelined request started
            self._await_body()

    def connection_lost(self, exc) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    # -- timers -----------------------------------------------------------------------------

    def _await_head(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.header_timeout, self._head_timed_out,
                                                self.cycle)

    def _await_body(self) -> None:
        self._cancel_read_timer()
        if self.cycle is not None and self.cycle.more_body:
            self._read_timer = self.loop.call_later(self.body_timeout, self._body_timed_out,
                                                    self.cycle)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _head_timed_out(self, cycle) -> None:
        self._read_timer = None
        if self.cycle is cycle and not self.transport.is_closing():
            self.transport.close()  # no request began: nothing to answer

    def _body_timed_out(self, cycle) -> None:
        self._read_timer = None
        if self.cycle is not cycle or not cycle.more_body or self.transport.is_closing():
            return
        if not cycle.response_started:
            self.transport.write(self.body_timeout_response)
        self.transport.close()  # the handler reading the body sees a disconnect


def _request_timeout_response(timeout: float) -> bytes:
    """The whole 408 answer, with the OpenAI error body."""
    import msgspec

    from .errors import error_body

    body = msgspec.json.encode(error_body(
        408, f"The request body did not arrive within {timeout:g} s "
             "(--timeout-request-body).", None, "RequestTimeout"))
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body
