"""Huge requests (issue 39): a body over --max-request-body-bytes is refused before it is
parsed, a prompt too long to fit the context before it is tokenized, and small prompts never
wait behind huge ones for a tokenizer thread. A fake engine, no engine core."""

import asyncio
import time

import httpx
import pytest

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.serving import SMALL_PROMPT_CHARS, longest_token_chars

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


# ------------------------------------------------------------------ prompt characters


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(tokenizer, monkeypatch):
    """A text of more characters than max_model_len tokens of the vocabulary's longest token
    can hold gets a 400 naming the field and the limit, and the tokenizer never sees it;
    one character less is tokenized (and, being too many tokens here, refused for that)."""
    engine = FakeEngine(tokenizer)  # max_model_len 64
    cap = 64 * longest_token_chars(tokenizer)
    encoded = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: (
        encoded.append(len(text)), encode(text, **kw))[1])

    async def body(client, app):
        assert app.state.serving.max_prompt_chars == cap
        cases = [("/v1/completions", {"prompt": "ab" * cap}, "prompt"),
                 ("/v1/completions", {"prompt": ["ok", "ab" * cap]}, "prompt"),
                 ("/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "ab" * cap}]}, "messages")]
        for path, request, param in cases:
            r = await client.post(path, json=request)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param, r.text
            assert f"at most {cap} characters" in error["message"]
            assert "without tokenizing" in error["message"]
        assert all(n < cap for n in encoded), encoded  # only "ok" and chat headers
        r = await client.post("/v1/completions", json={"prompt": "a" * cap})
        assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
        assert cap in encoded
        r = await client.post("/v1/completions", json={"prompt": list(range(64))})
        assert r.status_code == 400 and "has 64 tokens" in r.json()["error"]["message"]

    asyncio.run(_serve(engine, body))


# ------------------------------------------------------------------ tokenizer lanes


class SlowTokenizingEngine(FakeEngine):
    """Takes `big_s` seconds (in its thread, GIL released) to encode a prompt of more than
    SMALL_PROMPT_CHARS characters, as a real tokenizer takes seconds for megabytes."""

    big_s = 1.5

    def encode_prompt(self, prompt):
        if isinstance(prompt, str) and len(prompt) > SMALL_PROMPT_CHARS:
            time.sleep(self.big_s)
            return [5] * 10
        return super().encode_prompt(prompt)


def test_small_prompts_do_not_wait_behind_huge_ones(tokenizer):
    """Six huge prompts (each within the context, each 1.5 s to tokenize) take every thread
    of the main pool; a small prompt sent after them is answered in well under 1.5 s from
    its own lane, while they are still tokenizing."""
    engine = SlowTokenizingEngine(tokenizer, max_model_len=1_000_000)

    async def body(client, app):
        huge = {"prompt": "x" * (SMALL_PROMPT_CHARS + 1), "max_tokens": 1}
        big = [asyncio.ensure_future(client.post("/v1/completions", json=huge))
               for _ in range(6)]
        await asyncio.sleep(0.2)  # the huge ones hold the main pool
        start = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        waited = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert waited < 1.0, f"the small prompt waited {waited:.2f} s"
        assert not any(task.done() for task in big)
        assert [r.status_code for r in await asyncio.gather(*big)] == [200] * 6

    asyncio.run(_serve(engine, body))


@pytest.mark.parametrize("vocab,expected", [({"a": 0, "Ġhello": 1}, 6), ({}, 1)])
def test_longest_token_chars(vocab, expected):
    class Tokenizer:
        def get_vocab(self):
            return vocab

    assert longest_token_chars(Tokenizer()) == expected
