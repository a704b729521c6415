"""Admission control (503) and client disconnects (abort + release), with a fake engine."""

import asyncio
import json
import time

import httpx
import pytest

from http_fake_engine import FakeEngine
from tidal.frontend.server.admission import AdmissionController, make_shared_slots
from tidal.frontend.server.app import ServerSettings, build_app
from tidal.frontend.server.errors import QUEUE_FULL_MESSAGE, RETRY_AFTER_S, APIError
from tidal.ipc.frontend_messages import SchedulerStats


def test_controller_counts_and_releases():
    rejected = []
    ctl = AdmissionController(2, on_reject=rejected.append)
    a, b = ctl.admit(1), ctl.admit(1)
    with pytest.raises(APIError) as info:
        ctl.admit(1)
    assert info.value.status == 503 and info.value.body()["error"]["message"] == QUEUE_FULL_MESSAGE
    assert rejected == ["max_num_queued_reqs"] and ctl.num_unfinished() == 2
    a.release()
    a.release()  # idempotent
    c = ctl.admit(1)
    with pytest.raises(APIError):
        ctl.admit(1)
    b.release(), c.release()
    with pytest.raises(APIError):
        ctl.admit(3)  # an n=3 request counts 3
    assert ctl.num_unfinished() == 0


def test_controller_sums_processes_and_other_frontends():
    slots = make_shared_slots(2)
    first = AdmissionController(3, slots, 0)
    second = AdmissionController(3, slots, 1)
    first.admit(2)
    second.admit(1)
    assert first.num_ours() == second.num_ours() == 3 and first.num_local() == 2
    with pytest.raises(APIError):
        second.admit(1)
    # the core reports 5 unfinished while we have 3: 2 belong to another frontend
    lone = AdmissionController(4)
    lone.note_core_count(core_unfinished=2, ours_before=0, ours_after=0)
    assert lone.others == 2 and lone.num_unfinished() == 2
    lone.note_core_count(core_unfinished=1, ours_before=1, ours_after=2)
    assert lone.others == 0  # never negative, never counts our own twice
    assert AdmissionController(None).admit(10**6).num_reqs == 10**6  # no limit


def test_controller_counts_queued_prompt_tokens_until_the_first_token():
    rejected = []
    ctl = AdmissionController(None, token_limit=100, on_reject=rejected.append)
    a = ctl.admit(2, 60)  # n=2 over a 30-token prompt
    with pytest.raises(APIError) as info:
        ctl.admit(1, 41)  # 60 + 41 > 100
    assert info.value.status == 503
    assert info.value.body()["error"]["message"].startswith(
        "The engine has reached its prefill token backlog limit.")
    assert rejected == ["max_num_queued_tokens"] and ctl.num_queued_tokens() == 60
    b = ctl.admit(1, 40)  # exactly at the limit
    a.prefill_done(30)  # completion 0 of `a` has its first token
    assert ctl.num_queued_tokens() == 70 and ctl.num_unfinished() == 3
    c = ctl.admit(1, 30)
    a.prefill_done(30), a.prefill_done(30)  # more than it holds: no effect past its share
    assert ctl.num_queued_tokens() == 70
    a.release(), b.release(), c.release()
    assert ctl.num_queued_tokens() == 0 and ctl.num_unfinished() == 0
    # a prompt over the limit on its own is admitted when nothing is queued, not before
    big = ctl.admit(1, 500)
    with pytest.raises(APIError):
        ctl.admit(1, 1)
    big.release()
    # tokens of other frontends, from the core's snapshot, count too
    ctl.note_core_count(1, 0, 0, core_tokens=95, our_tokens_before=0, our_tokens_after=0)
    assert ctl.other_tokens == 95
    with pytest.raises(APIError):
        ctl.admit(1, 6)
    ctl.admit(1, 5)


def test_count_limit_503s_say_when_to_retry():
    """Both count limits answer 503 with a Retry-After, as every other 503 does: a fixed
    RETRY_AFTER_S for requests; for prompt tokens the time the core's estimate gives the
    excess to drain (30 tokens over at 0.25 s each: 7.5 s, rounded up), RETRY_AFTER_S
    without one."""
    ctl = AdmissionController(1, token_limit=100)
    ctl.admit(1, 90)
    with pytest.raises(APIError) as full:
        ctl.admit(1)
    assert full.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
    ctl.limit = None
    with pytest.raises(APIError) as tokens:
        ctl.admit(1, 40)
    assert tokens.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
    ctl.note_core_estimate(SchedulerStats(est_s_per_prompt_token=0.25), (0, 0))
    with pytest.raises(APIError) as tokens:
        ctl.admit(1, 40)
    assert tokens.value.status == 503 and tokens.value.headers == {"Retry-After": "8"}


def test_shared_slots_sum_tokens_over_processes():
    slots = make_shared_slots(2)
    first = AdmissionController(5, slots, 0, token_limit=50)
    second = AdmissionController(5, slots, 1, token_limit=50)
    first.admit(1, 30)
    ticket = second.admit(1, 20)
    assert first.num_ours() == second.num_ours() == 2
    assert first.num_queued_tokens() == second.num_queued_tokens() == 50
    with pytest.raises(APIError):
        first.admit(1, 1)
    ticket.prefill_done(20)
    assert first.num_queued_tokens() == 30 and first.num_ours() == 2


@pytest.fixture
def slow_engine(tokenizer):
    return FakeEngine(tokenizer, token_delay=0.05)


async def _with_app(engine, settings, body):
    async def factory():
        return engine

    app = build_app(factory, settings)
    async with app.router.lifespan_context(app):
        await body(app)


def test_burst_gets_the_expected_mix_of_200_and_503(slow_engine):
    async def body(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            reqs = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                         "stream": i % 2 == 0})
                    for i in range(6)]
            results = await asyncio.gather(*reqs)
            codes = sorted(r.status_code for r in results)
            assert codes == [200, 200, 503, 503, 503, 503]
            for r in results:
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "Service Unavailable"
            after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert after.status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'tidal:admission_rejections_total{model_name="fake-model",' \
                   'reason="max_num_queued_reqs"} 4.0' in metrics
        assert app.state.serving.admission.num_ours() == 0

    asyncio.run(_with_app(slow_engine, ServerSettings(max_num_queued_reqs=2), body))


def test_token_limit_gets_503_and_frees_at_the_first_token(tokenizer):
    """--max-num-queued-tokens: prompts of 20 tokens against a limit of 50. While two requests
    wait for their first token a third gets 503 (counted under its reason); once the first
    tokens are back (the requests still decode) the next one is admitted. The limit comes
    from the engine (EngineInfo), as --max-num-queued-tokens sets it."""
    engine = FakeEngine(tokenizer, token_delay=1.0, max_num_queued_tokens=50)
    prompt = list(range(30, 50))

    async def until(condition, timeout=5.0):
        # Polls rather than sleeping a fixed time: a loaded CI machine may take longer than
        # a tenth of a second to admit two requests.
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, "condition never held"
            await asyncio.sleep(0.01)

    async def body(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            running = [asyncio.ensure_future(client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 3})) for _ in range(2)]
            admission = app.state.serving.admission
            # Both admitted; neither has its first token (1 s).
            await until(lambda: admission.num_ours() == 2)
            assert admission.num_our_tokens() == 40
            third = await client.post("/v1/completions", json={"prompt": prompt,
                                                                "max_tokens": 1})
            assert third.status_code == 503, third.text
            assert "prefill token backlog" in third.json()["error"]["message"]
            await until(lambda: admission.num_our_tokens() == 0)  # first tokens are back
            assert admission.num_ours() == 2  # the two still decode
            fourth = await client.post("/v1/completions", json={"prompt": prompt,
                                                                 "max_tokens": 1})
            assert fourth.status_code == 200, fourth.text
            assert all(r.status_code == 200 for r in await asyncio.gather(*running))
            metrics = (await client.get("/metrics")).text
            assert 'reason="max_num_queued_tokens"} 1.0' in metrics
        assert app.state.serving.admission.num_ours() == 0
        assert app.state.serving.admission.num_our_tokens() == 0

    asyncio.run(_with_app(engine, ServerSettings(), body))


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


async def _call_and_disconnect(app, path: str, payload: dict, after_chunks: int | None,
                               after_seconds: float | None = None) -> list:
    """Drive the ASGI app like a server whose client goes away mid-request."""
    gone = asyncio.Event()
    sent, first = [], [True]

    async def receive():
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": json.dumps(payload).encode(),
                    "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if after_chunks is not None and len(chunks) >= after_chunks:
            gone.set()

    if after_seconds is not None:
        asyncio.get_running_loop().call_later(after_seconds, gone.set)
    await asyncio.wait_for(app(_scope(path), receive, send), 5)
    return sent


@pytest.mark.parametrize("path,payload", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 50, "stream": True}),
    ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 50, "stream": True}),
])
def test_streaming_disconnect_aborts_and_releases(slow_engine, path, payload):
    async def body(app):
        sent = await _call_and_disconnect(app, path, payload, after_chunks=2)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        assert len(chunks) < 10  # it stopped long before 50 tokens
        await asyncio.sleep(0.1)
        assert not slow_engine.active
        assert slow_engine.generated.keys() <= set(slow_engine.abort_calls)
        assert app.state.serving.admission.num_ours() == 0

    asyncio.run(_with_app(slow_engine, ServerSettings(max_num_queued_reqs=4), body))


def test_non_streaming_disconnect_aborts_and_releases(slow_engine):
    async def body(app):
        payload = {"prompt": "x", "max_tokens": 50, "n": 2}
        sent = await _call_and_disconnect(app, "/v1/completions", payload, None, 0.2)
        assert sent[0]["status"] == 499
        await asyncio.sleep(0.1)
        assert not slow_engine.active
        (req_id,) = slow_engine.generated
        assert req_id in slow_engine.abort_calls and req_id in slow_engine.aborted
        assert app.state.serving.admission.num_ours() == 0

    asyncio.run(_with_app(slow_engine, ServerSettings(max_num_queued_reqs=4), body))


# -- --max-queue-delay ---------------------------------------------------------------------------


def _estimate(delay=0.0, per_token=0.0, per_request=0.0):
    from tidal.ipc.frontend_messages import SchedulerStats

    return SchedulerStats(est_queue_delay_s=delay, est_s_per_prompt_token=per_token,
                          est_s_per_queued_request=per_request)


def test_controller_adds_the_prompt_and_what_it_admitted_since_the_snapshot():
    """The core says 0.5 s of queue and 1 ms per prompt token: a 400-token prompt would wait
    0.9 s (admitted, limit 1 s); a 200-token one after it 0.5 + 0.6 = 1.1 s: a 503 with
    Retry-After 1 (rounded up from 0.1 s). A fresh snapshot (taken after both were sent)
    counts the first in the core's own figure and resets what is added here."""
    rejected = []
    ctl = AdmissionController(None, on_reject=rejected.append, max_queue_delay=1.0)
    assert ctl.estimated_wait(10**6) == 0.0  # no snapshot yet: nothing to go on
    ctl.note_core_estimate(_estimate(0.5, 0.001), mark=(0, 0), now=time.monotonic())
    assert ctl.estimated_wait(400) == pytest.approx(0.9, abs=0.01)
    ctl.admit(1, 400)
    with pytest.raises(APIError) as info:
        ctl.admit(1, 200)
    err = info.value
    assert err.status == 503 and err.headers == {"Retry-After": "1"}
    assert "wait about 1.1 s" in err.message and "limit of 1 s" in err.message
    assert rejected == ["max_queue_delay"] and ctl.num_ours() == 1
    ctl.note_core_estimate(_estimate(0.7, 0.001), mark=(400, 1), now=time.monotonic())
    assert ctl.estimated_wait(200) == pytest.approx(0.9, abs=0.01)
    ctl.admit(1, 200)


def test_the_time_a_request_already_spent_here_counts_and_the_early_check_leaves_its_prompt_out():
    """0.5 s queued in the core at 1 ms a token, a 1 s limit: a 300-token request that
    arrived 0.3 s ago would wait 0.3 + 0.5 + 0.3 = 1.1 s (503), one that arrived 0.1 s ago
    0.9 s (admitted). Before tokenizing, the check counts no prompt: 0.3 + 0.5 passes; after
    0.6 s in this process even an empty prompt is over (503, nothing admitted)."""
    ctl = AdmissionController(None, max_queue_delay=1.0)
    ctl.note_core_estimate(_estimate(0.5, 0.001), mark=(0, 0), now=time.monotonic())
    assert ctl.estimated_wait(300, waited_s=0.3) == pytest.approx(1.1, abs=0.01)
    ctl.check_wait(0, waited_s=0.3)
    with pytest.raises(APIError, match="wait about 1.1 s"):
        ctl.admit(1, 300, waited_s=0.3)
    ctl.admit(1, 300, waited_s=0.1)
    with pytest.raises(APIError, match="wait about 1.4 s"):  # 0.6 + 0.5 + the 300 admitted
        ctl.check_wait(0, waited_s=0.6)
    assert ctl.num_ours() == 1
    AdmissionController(None).check_wait(10**6, waited_s=100.0)  # no limit: never a 503


def test_the_core_estimate_drains_a_second_per_second_until_the_next_snapshot():
    """A snapshot of 0.8 s of queue at 1 ms a token, taken at t=100: at t=100.3 the queue
    ahead is 0.5 s, at t=101 and later nothing (never below 0), while what was admitted since
    still counts in full."""
    ctl = AdmissionController(None, max_queue_delay=1.0)
    ctl.note_core_estimate(_estimate(0.8, 0.001), mark=(0, 0), now=100.0)
    assert ctl.estimated_wait(0, now=100.0) == pytest.approx(0.8)
    assert ctl.estimated_wait(100, now=100.3) == pytest.approx(0.5 + 0.1)
    ctl.admit(1, 200)
    assert ctl.estimated_wait(0, now=101.5) == pytest.approx(0.2)


def test_the_margin_is_the_p90_of_how_far_first_tokens_ran_over_their_estimates():
    """Nine first tokens give no margin yet; with ten, 0.1 s each over, 0.1 s is added: a
    request estimated at 0.97 s is then refused under a 1 s limit (about 1.07 s). Tokens that
    came early give no negative margin. A ticket reports its first token once, however many
    completions it has."""
    ctl = AdmissionController(None, max_queue_delay=1.0)
    ctl.note_core_estimate(_estimate(0.97), mark=(0, 0), now=time.monotonic())
    for _ in range(9):
        ctl.note_first_token(0.6, 0.5)
    assert ctl.margin() == 0.0
    ctl.admit(1, 0).release()
    ctl.note_first_token(0.6, 0.5)
    assert ctl.margin() == pytest.approx(0.1)
    with pytest.raises(APIError, match="wait about 1.1 s"):
        ctl.admit(1, 0)
    early = AdmissionController(None, max_queue_delay=1.0)
    for _ in range(20):
        early.note_first_token(0.2, 0.5)
    assert early.margin() == 0.0
    ticket = early.admit(2, 10)
    ticket.prefill_done(5)
    ticket.prefill_done(5)
    assert len(early._errors) == 21


def test_a_request_that_cannot_make_it_is_refused_before_its_prompt_is_tokenized(
        tokenizer, monkeypatch):
    """A core estimate of 0.7 s against a 1 s limit, the one tokenizer thread of the small
    prompts' lane kept busy for 0.5 s (as by other requests' prompts): a request that arrives
    meanwhile gets its turn at 0.5 s, when even without its own prompt it would wait
    0.5 + 0.7 s: 503 without being tokenized."""
    import tidal.frontend.server.admission as admission
    import tidal.frontend.server.serving as serving_module

    monkeypatch.setattr(admission, "DELAY_REFRESH_SECONDS", 0.02)  # kept fresh
    monkeypatch.setattr(serving_module, "SMALL_LANE_THREADS", 1)
    engine = FakeEngine(tokenizer, token_delay=0.05)
    engine.stats = _estimate(0.7)
    encoded = []
    encode = engine.encode_prompt
    engine.encode_prompt = lambda prompt: encoded.append(prompt) or encode(prompt)

    async def body(app):
        await asyncio.sleep(0.05)  # the first stats refresh
        busy = asyncio.ensure_future(app.state.serving.off_loop(time.sleep, 0.5, chars=1))
        await asyncio.sleep(0.01)  # the thread is taken
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 4})
        await busy
        assert r.status_code == 503 and "wait about 1.2 s" in r.json()["error"]["message"]
        assert encoded == [] and not engine.generated

    asyncio.run(_with_app(engine, ServerSettings(max_queue_delay=1.0), body))


def test_queue_delay_503_comes_at_once_with_retry_after(tokenizer, monkeypatch):
    """An estimate of 2.9 s against a 1 s limit: the request is answered 503 with
    Retry-After: 2 (1.9 s and the moments it spent in the server, rounded up) before it
    reaches the engine."""
    import tidal.frontend.server.admission as admission

    monkeypatch.setattr(admission, "DELAY_REFRESH_SECONDS", 0.02)  # kept fresh
    engine = FakeEngine(tokenizer, token_delay=0.05)
    engine.stats = _estimate(2.9)

    async def body(app):
        await asyncio.sleep(0.05)  # the first stats refresh
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "Service Unavailable"
            assert "2.9 s" in r.json()["error"]["message"]
            metrics = (await client.get("/metrics")).text
            assert ('tidal:admission_rejections_total{model_name="fake-model",'
                    'reason="max_queue_delay"} 1.0') in metrics
        assert not engine.generated

    asyncio.run(_with_app(engine, ServerSettings(max_queue_delay=1.0), body))


def test_queue_delay_burst_every_request_gets_an_answer(tokenizer, monkeypatch):
    """0.5 s of queue, 0.45 s per request admitted since the snapshot, limit 1 s, no fresh
    snapshot: of six at once the first two to arrive are admitted (0.5, 0.95 s, less the
    moments the queue drained since the snapshot); each of the other four would wait about
    1.4 s (a rejected request adds nothing) and gets 503 with Retry-After 1; the admitted two
    run to the end."""
    import tidal.frontend.server.admission as admission

    monkeypatch.setattr(admission, "DELAY_REFRESH_SECONDS", 100.0)
    engine = FakeEngine(tokenizer, token_delay=0.02)
    engine.stats = _estimate(0.5, 0.0, 0.45)

    async def body(app):
        await asyncio.sleep(0.05)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            reqs = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                         "stream": i % 2 == 0})
                    for i in range(6)]
            results = await asyncio.wait_for(asyncio.gather(*reqs), 10)
        # which two are admitted depends on the order the six reach admission (their prompts
        # are tokenized off the event loop, so that order is not the order of sending)
        codes = [r.status_code for r in results]
        assert sorted(codes) == [200, 200, 503, 503, 503, 503], codes
        for i, r in enumerate(results):
            if r.status_code == 503:
                assert r.headers.get("retry-after") == "1"
            elif i % 2 == 0:  # streamed
                assert r.headers.get("retry-after") is None and "data: [DONE]" in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 4
        assert app.state.serving.admission.num_ours() == 0

    asyncio.run(_with_app(engine, ServerSettings(max_queue_delay=1.0), body))


# -- --record-trace ------------------------------------------------------------------------------


def test_record_trace_writes_one_line_per_completion(tokenizer, tmp_path):
    """Two requests, one with n=2: three trace lines with the prompt's length and hashes, the
    output length and why it ended; a client that leaves is recorded as an abort. No text."""
    from tidal.engine_core.advice.trace import read_trace, start_recording

    path = str(tmp_path / "trace.jsonl")
    settings = ServerSettings(record_trace=(path, start_recording(path)))
    engine = FakeEngine(tokenizer, token_delay=0.01, max_model_len=256)
    prompt = "the quick brown fox jumps over the lazy dog " * 4

    async def body(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            one = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 3, "priority": 0})
            two = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 5, "n": 2, "stream": True})
            assert one.status_code == two.status_code == 200
        await _call_and_disconnect(app, "/v1/completions",
                                   {"prompt": "x", "max_tokens": 50, "stream": True}, 2)

    asyncio.run(_with_app(engine, settings, body))
    text = open(path).read()
    assert "quick" not in text and "fox" not in text
    requests = read_trace(path).requests
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    full = [r for r in requests if r.prompt_len == prompt_len]
    assert sorted(r.output_len for r in full) == [3, 5, 5]
    assert all(r.finish_reason == "length" for r in full)
    assert len(full[0].prefix_hashes) == prompt_len // 16 > 0
    assert all(r.prefix_hashes == full[0].prefix_hashes for r in full)
    (aborted,) = [r for r in requests if r.prompt_len != prompt_len]
    assert aborted.finish_reason == "abort" and 0 < aborted.output_len < 50


def test_shutdown_ends_a_background_loop_that_lost_a_cancel():
    """On Python < 3.12 `asyncio.wait_for` can swallow a cancel that lands as its inner call
    completes, and the admission refresh loop around it then ran on: the server's shutdown
    hung (CI, under load). A loop that swallows its first cancel still ends."""
    from tidal.frontend.server.app import _stop_tasks

    async def swallows_one_cancel():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # lost, as wait_for can lose it
        while True:
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.ensure_future(swallows_one_cancel())
        await asyncio.sleep(0.01)
        await asyncio.wait_for(_stop_tasks([task]), 5)
        assert task.cancelled()

    asyncio.run(main())
