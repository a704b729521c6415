"""A live `tidal serve --engine ADDRESS --api-server-count 2` (its key in $TIDAL_API_KEY) of
a tiny model, attached to a `tidal core` daemon, driven by the real `openai` package, httpx and
schemathesis.

One daemon and one server for the whole module; `LLM(engine=ADDRESS)` attaches to the same
daemon to compute the reference greedy outputs.
"""

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from live_server import ENGINE_FLAGS, LiveServer, Proc, scrape
from process_tree import descendants
from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

pytestmark = pytest.mark.slow  # live server subprocesses (still run by CI)

KEY = "test-key-123"
MODEL = "tiny"
PROMPTS = ["Hello world! How are you", "The quick brown fox"]
ABORTED = "tidal:request_success_total/abort"


@pytest.fixture(scope="module")
def engine_address(tiny_llama, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('core')}/engine.sock"
    core = Proc(["core", tiny_llama, *ENGINE_FLAGS, "--max-model-len", "512",
                 "--listen", address])
    yield address
    core.stop()


@pytest.fixture(scope="module")
def server(engine_address):
    srv = LiveServer(["--engine", engine_address, "--api-server-count", "2",
                      "--served-model-name", MODEL], api_key=KEY)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm(engine_address, server):
    engine = LLM(engine=engine_address)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                         timeout=60)


def greedy(llm, prompts, max_tokens=16) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


# ------------------------------------------------------------------ 1. the openai package


def test_sync_completions_greedy_equal_llm_generate(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    ours = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert ours == greedy(llm, PROMPTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 32


def test_sync_chat_greedy_equals_llm_generate_on_the_template(client, llm):
    messages = [{"role": "system", "content": "You count."},
                {"role": "user", "content": "one, two, three"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0)
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True),
                     add_special_tokens=False)
    assert r.choices[0].message.content == greedy(llm, [ids], 12)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)


def test_n2_logprobs_and_stop_strings(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2,
                                  temperature=1.0, seed=7, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0
        assert all(len(top) >= 3 for top in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "hi"}],
                                          max_tokens=6, n=2, logprobs=True, top_logprobs=2)
    assert len(chat.choices) == 2
    for c in chat.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    # a stop string taken from the greedy text ends it there
    text = greedy(llm, [PROMPTS[1]], 16)[0]
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3) if text[i:i + 3].strip())
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_sync_streaming_chat_with_usage(client, llm):
    messages = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens


def test_async_client_streaming_and_not(server, llm):
    expected = greedy(llm, PROMPTS, 12)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY,
                                     max_retries=0, timeout=60)

        async def streamed(prompt):
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=2, stream=True,
                stream_options={"include_usage": True})
            texts, usage = {0: "", 1: ""}, None
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.text
                usage = chunk.usage or usage
            return texts, usage

        async def plain(prompt):
            r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                 temperature=0)
            return r.choices[0].text

        try:
            return await asyncio.gather(streamed(PROMPTS[0]), plain(PROMPTS[1]),
                                        streamed(PROMPTS[1]))
        finally:
            await aclient.close()

    (texts0, usage0), plain1, (texts1, _) = asyncio.run(main())
    assert texts0 == {0: expected[0], 1: expected[0]}  # greedy: both completions equal
    assert plain1 == expected[1] and texts1[0] == expected[1]
    assert usage0.completion_tokens > 0


# ------------------------------------------------------------------ 3. bad requests

MALFORMED = [
    ("/v1/completions", b"{oops", 400),
    ("/v1/completions", b"42", 400),
    ("/v1/completions", {}, 400),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404),
    ("/v1/completions", {"prompt": "x", "temperature": "warm"}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "x" * 3000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400),  # > context
    ("/v1/completions", {"prompt": [10**7]}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2**80}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "frequency_penalty": 9}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "min_p": 2}, 400),
    ("/detokenize", {"tokens": ["a"]}, 400),
]


def test_twenty_malformed_requests_then_a_good_one(server):
    assert len(MALFORMED) == 20
    with server.client(timeout=30) as http:
        for path, body, status in MALFORMED:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert error["code"] == status and error["message"] and error["type"], error
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    too_long = httpx.post(server.base_url + "/v1/completions", headers=server.headers,
                          json={"prompt": "x" * 3000}).json()["error"]["message"]
    assert "512" in too_long and "3000" in too_long


# ------------------------------------------------------------------ 4. disconnect


def _hang_up(server, stream: bool) -> None:
    """Send an 8 x 500-token request (seconds of work) and leave before it can finish."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 500, "n": 8, "ignore_eos": True,
            "stream": stream}
    with server.client(timeout=30) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first chunk arrived; now hang up
        else:
            _hang_up_once_running(server, body)


def _hang_up_once_running(server, body: dict) -> None:
    """POST on a raw socket and close it once the engine runs the request.

    Not a client timeout: with fast steps 8 x 500 tokens can finish inside any timeout short
    enough for a test, and then there is nothing left to abort."""
    payload = json.dumps(body).encode()
    head = ["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{server.port}",
            "Content-Type: application/json", f"Content-Length: {len(payload)}",
            *(f"{k}: {v}" for k, v in server.headers.items())]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 10
        while scrape(server)[0]["tidal:num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.005)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_disconnect_aborts_and_frees_kv(server, stream):
    idle, _ = scrape(server)
    assert idle["tidal:num_requests_running"] == 0
    aborts = idle.get(ABORTED, 0)
    _hang_up(server, stream)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now, _ = scrape(server)
        if now["tidal:num_requests_running"] == 0 and \
                now["tidal:kv_cache_usage_perc"] == idle["tidal:kv_cache_usage_perc"]:
            break
        time.sleep(0.1)
    assert now["tidal:num_requests_running"] == 0 and now["tidal:num_requests_waiting"] == 0
    assert now["tidal:kv_cache_usage_perc"] == idle["tidal:kv_cache_usage_perc"]
    assert now.get(ABORTED, 0) == aborts + 1  # the server saw the disconnect and aborted
    generated = now["tidal:generation_tokens_total"] - idle["tidal:generation_tokens_total"]
    assert generated < 8 * 500  # aborted, not run to the end


# ------------------------------------------------------------------ 6. metrics, 2 servers


def test_metrics_parse_move_and_are_whole_server(server):
    before, _ = scrape(server)
    with server.client(timeout=30) as http:
        for _ in range(4):
            r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5,
                                                   "ignore_eos": True})
            assert r.status_code == 200
    seen = set()
    for _ in range(200):  # new connections land on either process
        after, index = scrape(server)
        seen.add(index)
        assert after["tidal:request_success_total"] - before.get(
            "tidal:request_success_total", 0) == 4
        assert after["tidal:e2e_request_latency_seconds_count"] - before.get(
            "tidal:e2e_request_latency_seconds_count", 0) == 4
        assert after["tidal:generation_tokens_total"] - before[
            "tidal:generation_tokens_total"] == 20
        if len(seen) == 2:
            break
    assert seen == {"0", "1"}
    assert after["tidal:prompt_tokens_total"] > before["tidal:prompt_tokens_total"]
    assert after["tidal:time_to_first_token_seconds_count"] >= 4
    assert after["tidal:inter_token_latency_seconds_count"] > 0
    assert "tidal:prefix_cache_queries_total" in after and "tidal:num_preemptions_total" in after


# ------------------------------------------------------------------ 7. API key


def test_api_key_enforced(server):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = httpx.get(server.base_url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_api_key_is_on_no_command_line(server):
    """The key came from $TIDAL_API_KEY and reached the HTTP processes inside their spawn
    pipe: no process of the server shows it in its command line, which every local user
    can read."""
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    assert len(pids) >= 3  # the supervisor and its two HTTP processes at least
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), pid


# ------------------------------------------------------------------ 3b. fuzzing (last: it
# leaves the engine busy with the requests it hung up on)


def test_schemathesis_fuzz_finds_no_server_error(server):
    before, _ = scrape(server)
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.base_url + "/openapi.json",
           "--checks", "not_a_server_error", "--max-time", "6", "--seed", "1",
           "--workers", "1", "--request-timeout", "60", "--no-color",
           "-H", f"Authorization: Bearer {KEY}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"schemathesis did not finish in time: {exc.stdout}")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert httpx.get(server.base_url + "/health").status_code == 200
    after, _ = scrape(server)  # the fuzzer's valid requests reached the engine
    assert after["tidal:request_success_total"] > before["tidal:request_success_total"]
