"""Huge requests (issue 39): a body over --max-request-body-bytes is refused before it is
parsed. A fake engine, no engine core."""

import asyncio

import httpx

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app

LIMIT = 4096  # --max-request-body-bytes of these tests


async def _serve(engine, body, **settings):
    """Run `body(client, app)` against the app, in this event loop (no server thread)."""
    async def factory():
        return engine

    app = build_app(factory, ServerSettings(**settings))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=30) as client:
            await body(client, app)


def _assert_413(r: httpx.Response) -> None:
    error = r.json()["error"]
    assert r.status_code == 413 and error["code"] == 413, r.text
    assert f"limit of {LIMIT} bytes" in error["message"]
    assert "--max-request-body-bytes" in error["message"]
    assert r.headers["x-tidal-server"] == "0"


# ------------------------------------------------------------------ request bodies


def test_a_declared_body_over_the_limit_is_refused_unread(tokenizer):
    """Content-Length over the limit: 413 at once; the body is never asked for."""
    engine = FakeEngine(tokenizer)
    sent = []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    async def body(client, app):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(10**9).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}
        await app(scope, receive, send)

    asyncio.run(_serve(engine, body, max_request_body_bytes=LIMIT))
    assert sent[0]["status"] == 413
    assert b"has 1000000000 bytes, more than this server's limit" in sent[1]["body"]
    assert engine.generated == {}


def test_a_chunked_body_is_refused_once_past_the_limit(tokenizer):
    """No Content-Length (a chunked upload): counted as it arrives, 413 once past the
    limit; the server goes on serving, and a body just under the limit is served."""
    engine = FakeEngine(tokenizer)

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    async def body(client, app):
        r = await client.post("/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        _assert_413(r)
        assert "is larger than" in r.json()["error"]["message"]
        _assert_413(await client.post("/v1/completions", json={"prompt": "x" * LIMIT}))
        assert engine.generated == {}
        fits = {"prompt": "x", "max_tokens": 2, "user": "u" * (LIMIT - 60)}
        r = await client.post("/v1/completions", json=fits)
        assert len(r.request.content) <= LIMIT and r.status_code == 200, r.text

    asyncio.run(_serve(engine, body, max_request_body_bytes=LIMIT))
