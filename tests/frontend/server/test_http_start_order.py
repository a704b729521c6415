"""Which of `tidal serve`'s HTTP processes answers while the engine loads: the first one
answers 503 "Loading model" meanwhile and says when it serves (`on_attached`); every other
one accepts no connection before that (`before_serving`), so once any process answered
/health 200, no process answers "Loading model"."""

import asyncio
import threading
import time

from fastapi.testclient import TestClient

from http_fake_engine import FakeEngine
from tidal.frontend.server.app import ServerSettings, build_app


def test_the_first_server_says_when_it_serves(tokenizer):
    engine = FakeEngine(tokenizer)
    attached = asyncio.Event()
    told = []

    async def factory():
        await attached.wait()  # the engine core is loading
        return engine

    app = build_app(factory, ServerSettings(attach_in_background=True,
                                            on_attached=lambda: told.append(True)))
    with TestClient(app) as c:
        assert c.get("/health").json()["error"]["message"] == "Loading model"
        assert not told
        c.portal.call(attached.set)
        for _ in range(200):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        assert told == [True]  # once, when it serves
        assert c.get("/health").status_code == 200


def test_another_server_starts_only_once_the_first_serves(tokenizer):
    engine = FakeEngine(tokenizer)
    first_serving = threading.Event()

    async def factory():
        return engine

    async def wait_for_first():
        while not first_serving.is_set():
            await asyncio.sleep(0.01)

    app = build_app(factory, ServerSettings(before_serving=wait_for_first))
    started = threading.Event()
    answers = []

    def run():  # TestClient's start returns once the app's start-up is over
        with TestClient(app) as c:
            started.set()
            answers.append(c.get("/health").status_code)

    thread = threading.Thread(target=run)
    thread.start()
    assert not started.wait(0.5)  # attached, but the first server does not serve yet
    first_serving.set()
    thread.join(10)
    assert started.is_set() and answers == [200]
