"""Issue 13: read timeouts. A real uvicorn server (the protocol `tidal serve` runs) in a
thread, driven through raw sockets: a silent connection, a half-sent head and a stalled or
trickled body are cut off at their deadline; a request being handled has none, and a
client within the deadlines is served."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from tidal.frontend.server.serve import _check_args, add_serve_args
from tidal.frontend.server.timeouts import timed_http_protocol

HEAD_S, BODY_S, KEEP_ALIVE_S = 0.6, 0.6, 1
SLACK_S = 3.0  # a deadline is met when the server acts within it plus this


async def app(scope, receive, send):
    """POST /echo answers its body; POST /slow reads its body, then works 2 s."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * max(HEAD_S, BODY_S))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=timed_http_protocol(HEAD_S, BODY_S),
                            timeout_keep_alive=KEEP_ALIVE_S)
    srv = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(10)
    sock.close()


def connect(address) -> socket.socket:
    conn = socket.create_connection(address)
    conn.settimeout(max(HEAD_S, BODY_S, KEEP_ALIVE_S) + SLACK_S)
    return conn


def read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; socket.timeout if it never does."""
    start, data = time.monotonic(), b""
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def post(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n").encode() \
        + body


def test_a_silent_connection_is_closed(server):
    with connect(server) as conn:
        data, waited = read_until_closed(conn)
    assert data == b"" and waited < HEAD_S + SLACK_S


def test_a_half_sent_head_is_closed(server):
    with connect(server) as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        data, waited = read_until_closed(conn)
    assert data == b"" and waited < HEAD_S + SLACK_S


def test_a_head_sent_slowly_within_the_deadline_is_served(server):
    with connect(server) as conn:
        request = post("/echo", b"hello")
        conn.sendall(request[:10])
        time.sleep(HEAD_S / 3)
        conn.sendall(request[10:])
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("trickle", [False, True])
def test_a_stalled_or_trickled_body_gets_408_and_is_closed(server, trickle):
    with connect(server) as conn:
        conn.sendall(post("/echo", b"0123456789", content_length=100))
        start = time.monotonic()
        if trickle:  # a byte now and then never ends the wait: the deadline is for all of it
            try:
                while time.monotonic() - start < BODY_S + SLACK_S:
                    conn.sendall(b"x")
                    time.sleep(BODY_S / 4)
            except OSError:
                pass  # closed under us
        data, _ = read_until_closed(conn)
        waited = time.monotonic() - start
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    error = json.loads(body)["error"]
    assert error["code"] == 408 and "--timeout-request-body" in error["message"]
    assert waited < BODY_S + SLACK_S


def test_handling_has_no_deadline_and_keep_alive_idles_out(server):
    """/slow works twice the read deadlines and still answers; the connection is reused
    for a second request, then closed after the keep-alive idle (uvicorn's timeout)."""
    with connect(server) as conn:
        conn.sendall(post("/slow", b"abc"))
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        conn.sendall(post("/echo", b"again"))
        reply = conn.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"again")
        data, waited = read_until_closed(conn)
    assert data == b"" and KEEP_ALIVE_S / 2 < waited < KEEP_ALIVE_S + SLACK_S


def test_a_half_sent_head_after_keep_alive_is_closed(server):
    with connect(server) as conn:
        conn.sendall(post("/echo", b"one"))
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        conn.sendall(b"POST /echo HTTP/1.1\r\n")  # keep-alive stops; the head's clock starts
        data, waited = read_until_closed(conn)
    assert data == b"" and waited < HEAD_S + SLACK_S


def test_timeout_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(["--timeout-keep-alive", "7", "--timeout-request-header", "2.5",
                            "--timeout-request-body", "90"])
    assert (ns.timeout_keep_alive, ns.timeout_request_header, ns.timeout_request_body) == \
        (7, 2.5, 90.0)
    defaults = parser.parse_args([])
    assert (defaults.timeout_keep_alive, defaults.timeout_request_header,
            defaults.timeout_request_body) == (30, 10.0, 60.0)
    for flag in ("--timeout-keep-alive", "--timeout-request-header", "--timeout-request-body"):
        with pytest.raises(ValueError, match=flag):
            _check_args(parser.parse_args([flag, "0"]))
