"""What an HTTP client sees when the engine is away, fails its request, or the server stops;
and that tokenizing runs off the event loop (one huge prompt stalls nobody else)."""

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from http_fake_engine import FakeEngine
from test_http_app import make_client, sse_events
from tidal.frontend.server.app import Server, ServerSettings, build_app
from tidal.frontend.server.errors import RETRY_AFTER_S

SLOW_S = 2.0


class VanishingEngine(FakeEngine):
    """Fails every request at its last token, and the core is gone at that moment."""

    async def generate(self, *args, **kwargs):
        async for out in super().generate(*args, **kwargs):
            if out.finished:
                self.attached, self.away_reason = False, "the engine core went away"
            yield out


class SlowEngine(FakeEngine):
    """Tokenizing a prompt that starts with "slow" takes SLOW_S seconds (a 20 MB body)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.encoding = threading.Event()

    def encode_prompt(self, prompt):
        if isinstance(prompt, str) and prompt.startswith("slow"):
            self.encoding.set()
            time.sleep(SLOW_S)
        return super().encode_prompt(prompt)


class ThreadRecorder:
    """The tokenizer, noting the thread of each encode / apply_chat_template / decode."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.threads: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name):
        value = getattr(self._tokenizer, name)
        if name not in ("encode", "apply_chat_template", "decode"):
            return value

        def recorded(*args, **kwargs):
            self.threads.append((name, threading.current_thread().name))
            return value(*args, **kwargs)

        return recorded


def assert_retry_later(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "Service Unavailable" and error["message"]


def test_no_core_attached_is_503_with_retry_after(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.attached, engine.away_reason = False, "the connection to the engine core was lost"
    with make_client(engine) as c:
        assert_retry_later(c.get("/health"))
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert_retry_later(r)
            assert "connection to the engine core was lost" in r.json()["error"]["message"]
        assert_retry_later(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]}))
        assert not engine.generated
        engine.attached = True
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_request_failed_as_the_core_went_away(tokenizer):
    """Non-streaming: 503 with Retry-After and the engine's message; streaming: an error
    event, then [DONE]."""
    engine = VanishingEngine(tokenizer, fail_with="engine core died")
    with make_client(engine) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_retry_later(r)
        assert "engine core died" in r.json()["error"]["message"]
        engine.attached = True
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "engine core died" in events[-2]["error"]["message"]


def test_a_slow_prompt_does_not_stall_other_requests(tokenizer):
    engine = SlowEngine(tokenizer)
    with make_client(engine) as c:
        slow = []
        worker = threading.Thread(target=lambda: slow.append(c.post(
            "/v1/completions", json={"prompt": "slow prompt", "max_tokens": 2})))
        worker.start()
        try:
            assert engine.encoding.wait(10)
            started = time.monotonic()
            fast = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            health = c.get("/health")
            elapsed = time.monotonic() - started
        finally:
            worker.join(30)
        assert fast.status_code == 200 and health.status_code == 200
        assert elapsed < SLOW_S / 2, f"other requests waited {elapsed:.2f} s"
        assert slow[0].status_code == 200


def test_tokenizing_and_chat_templates_run_in_the_thread_pool(tokenizer):
    engine = FakeEngine(ThreadRecorder(tokenizer))
    with make_client(engine) as c:
        assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        assert c.post("/tokenize", json={
            "messages": [{"role": "user", "content": "x"}]}).status_code == 200
        assert c.post("/detokenize", json={"tokens": [70, 71]}).status_code == 200
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200
    threads = engine.tokenizer.threads
    names = {name for name, _ in threads}
    assert {"encode", "apply_chat_template", "decode"} <= names
    before_generation = [t for name, t in threads if name != "decode"] + [
        t for name, t in threads[:5] if name == "decode"]
    assert all(t.startswith("tidal-tokenize") for t in before_generation), threads


@pytest.mark.timeout(60)
def test_shutdown_ends_requests_with_an_error(tokenizer):
    """uvicorn's graceful shutdown would wait, then cut the stream; `Server` fails it first:
    an error event and [DONE], and a 503 for the non-streaming request."""
    engine = FakeEngine(tokenizer, token_delay=0.2)  # 60 tokens: 12 s

    async def factory():
        return engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server(uvicorn.Config(build_app(factory, ServerSettings()), host="127.0.0.1",
                                   port=port, loop="asyncio", lifespan="on",
                                   log_level="warning", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/completions"
        plain = []
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(
            url, json={"prompt": "x", "max_tokens": 60}, timeout=20)))
        waiter.start()
        body = {"prompt": "x", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=20) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            while len(engine.active) < 2:  # the non-streaming request is generating too
                time.sleep(0.01)
            stopped = time.monotonic()
            server.should_exit = True
            rest = [line for line in lines if line]
        waiter.join(10)
        assert time.monotonic() - stopped < 5
    finally:
        server.should_exit = True
        thread.join(20)
    assert rest[-1] == "data: [DONE]"
    assert "the HTTP server is shutting down" in rest[-2] and '"error"' in rest[-2]
    assert_retry_later(plain[0])
    assert "the HTTP server is shutting down" in plain[0].json()["error"]["message"]
    assert engine.closed
