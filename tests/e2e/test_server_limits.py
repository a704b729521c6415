"""A live `tidal serve MODEL --max-num-seqs 1 --max-num-queued-reqs 2 --stream-interval 4
--timeout-request-header 1 --timeout-request-body 1` (the server starts its own engine-core
daemon): admission 503s, stream chunking, and read timeouts through the command line; and
`--max-queue-delay` on a real engine core, with a fabricated step cost model."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from live_server import ENGINE_FLAGS, LiveServer

pytestmark = pytest.mark.slow  # live server subprocesses (still run by CI)


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = LiveServer([tiny_llama, *ENGINE_FLAGS, "--max-model-len", "256",
                      "--max-num-seqs", "1", "--max-num-queued-reqs", "2",
                      "--stream-interval", "4", "--timeout-request-header", "1",
                      "--timeout-request-body", "1"])
    try:
        yield srv.start()
    finally:
        srv.stop()


def test_burst_of_8_gets_2_admitted_and_6_rejected(server):
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            # warm the connection pool so the 8 requests leave together
            await asyncio.gather(*[client.get("/health") for _ in range(8)])
            return await asyncio.gather(*[
                client.post("/v1/completions", json={**body, "stream": i % 2 == 1})
                for i in range(8)])

    results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 2 + [503] * 6, [r.text[:200] for r in results]
    for r in results:
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["code"] == 503 and error["type"] == "Service Unavailable"
            assert "busy" in error["message"] and error["param"] is None
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    after = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert after.status_code == 200
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'reason="max_num_queued_reqs"} 6.0' in metrics


def test_stream_interval_4_chunks_first_token_alone_loses_none(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 18, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    full = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    expected = full["choices"][0]
    sizes, token_ids, text = [], [], ""
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            sizes.append(len(choice["token_ids"]))
            token_ids += choice["token_ids"]
            text += choice["text"]
    assert sizes == [1, 4, 4, 4, 4, 1]
    assert token_ids == expected["token_ids"] and text == expected["text"]


def test_read_timeouts_reach_the_server(server):
    """The flags reach every server process: a silent connection is closed, a stalled body
    answered 408, both within seconds; the server goes on answering."""
    address = ("127.0.0.1", server.port)
    with socket.create_connection(address, timeout=10) as silent, \
            socket.create_connection(address, timeout=10) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        start = time.monotonic()
        assert silent.recv(1024) == b""
        reply = b""
        while chunk := stalled.recv(65536):
            reply += chunk
        assert time.monotonic() - start < 8
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == 408
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_max_queue_delay_refuses_what_the_real_core_prices_over_the_limit(tiny_llama,
                                                                           tmp_path):
    """`--max-queue-delay 1` with a step cost model pricing 20 ms a prompt token (and 5 ms
    of intake per arriving request) on a real engine core: a short prompt is served; one of
    ~90 tokens is priced ~1.8 s and answered 503 with Retry-After at once (once
    the core's first estimate has reached the HTTP process); short prompts are served after
    it, so the core's step and arrival accounting ran without a fault."""
    from tidal.engine_core.step_cost import StepCostModel

    cost = tmp_path / "cost.json"
    StepCostModel(0.001, per_prefill_token_s=0.020, per_arrival_s=0.005).save(str(cost))
    srv = LiveServer([tiny_llama, *ENGINE_FLAGS, "--max-model-len", "256",
                      "--max-queue-delay", "1", "--step-cost-model", str(cost)]).start()
    try:
        short = {"prompt": "Hello", "max_tokens": 4}
        long = {"prompt": "word " * 30, "max_tokens": 1}  # ~90 tokens here

        def refused() -> bool:
            assert httpx.post(srv.base_url + "/v1/completions", json=short,
                              timeout=60).status_code == 200
            r = httpx.post(srv.base_url + "/v1/completions", json=long, timeout=60)
            assert r.status_code in (200, 503), r.text
            return r.status_code == 503 and int(r.headers["retry-after"]) >= 1

        deadline = time.monotonic() + 20
        while not refused():
            assert time.monotonic() < deadline, "the ~2 s prompt was never refused"
        assert httpx.post(srv.base_url + "/v1/completions", json=short,
                          timeout=60).status_code == 200
        assert 'reason="max_queue_delay"}' in httpx.get(srv.base_url + "/metrics").text
    finally:
        srv.stop()
