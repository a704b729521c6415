"""Issue 37: the live page of the batch and its playground, against a live `tidal serve` with
an API key, and in a real browser (Debian's headless Chromium driven by Selenium through
Debian's chromedriver; `.ci/run` installs both; skipped, saying so, where they are missing).

1. The page's files are served without the key (a browser cannot send one when it navigates);
   its feed is not: /ui/view and /ui/events answer 401 without it.
2. /ui/view: one snapshot with the engine core's counters, the recent steps (each request's
   part: prefill chunk or decode), KV blocks, the queue and this process's latencies.
3. /ui/events streams snapshots while the batch runs, and a client that never reads holds
   no more than a few of them (the feed drops its oldest).
4. In Chromium: the page asks for the key, goes live, the step strip moves while requests
   run, and the playground streams an answer with its TTFT and tokens/s, logprobs on hover.
   With TIDAL_UI_SCREENSHOTS=DIR the test saves the screenshots docs/ui.md shows.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import httpx
import pytest

from live_server import ENGINE_FLAGS, LiveServer

KEY = "ui-test-key"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = LiveServer([tiny_llama, *ENGINE_FLAGS, "--served-model-name", "tiny"],
                     api_key=KEY).start()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def _load(server, n=6, max_tokens=24):
    """n concurrent completions, in threads (returns them, started)."""
    def one(i):
        with server.client(timeout=120) as c:
            c.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i} " * (5 + 9 * i),
                                            "max_tokens": max_tokens, "ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_page_is_open_and_its_feed_needs_the_key(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200 and "<title>tidal</title>" in page.text
        assert c.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/ui/style.css").status_code == 200
        assert c.get("/ui/view").status_code == 401
        assert c.get("/ui/events").status_code == 401


def test_a_snapshot_shows_the_steps_the_blocks_and_the_latencies(server):
    with server.client(timeout=30) as c:
        assert c.get("/ui/view").status_code == 200  # starts the recording
        for t in _load(server, n=4):
            t.join()
        snap = c.get("/ui/view").json()
    assert snap["model"] == "tiny" and len(snap["cores"]) == 1
    view = snap["cores"][0]["view"]
    steps = view["steps"]
    assert steps and view["max_num_batched_tokens"] == 512 and view["num_kv_blocks"] > 0
    parts = [r for s in steps for r in s["requests"]]
    assert any(r["prefill"] for r in parts) and any(not r["prefill"] for r in parts)
    assert all(s["num_tokens"] == sum(r["num_tokens"] for r in s["requests"]) for s in steps)
    assert view["kv_blocks_used"] == 0 and view["kv_blocks_cached"] > 0  # all finished
    assert snap["stats"]["generation_tokens"] >= 4 * 24
    assert snap["latency"]["ttft"]["n"] >= 4 and snap["latency"]["itl"]["p50"] > 0


def test_events_stream_while_the_batch_runs_and_a_stalled_reader_costs_nothing(server):
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.sendall(f"GET /ui/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
                    .encode())  # and never reads
    threads = _load(server, n=3)
    seen_steps = set()
    with server.client(timeout=30) as c, c.stream("GET", "/ui/events") as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        for line in events.iter_lines():
            if line.startswith("data: "):
                snap = json.loads(line[6:])
                seen_steps |= {s["step_id"] for s in snap["cores"][0]["view"]["steps"]}
                if len(seen_steps) >= 10:
                    break
    for t in threads:
        t.join()
    assert len(seen_steps) >= 10
    with server.client(timeout=30) as c:  # the server still answers; the stall is its own
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                               "max_tokens": 2}).status_code == 200
    stalled.close()


def test_tidal_top_draws_the_batch_in_a_terminal(server):
    """`tidal top URL --once`: one frame of the terminal view while requests run."""
    import subprocess
    import sys

    threads = _load(server, n=3, max_tokens=32)
    out = subprocess.run([sys.executable, "-m", "tidal.frontend.cli", "top", server.base_url,
                          "--once", "--interval", "1"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "TIDAL_API_KEY": KEY, "COLUMNS": "160"})
    for t in threads:
        t.join()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tiny at " + server.base_url in out.stdout and "steps (height" in out.stdout
    assert "running" in out.stdout and "KV used" in out.stdout
    wrong = subprocess.run([sys.executable, "-m", "tidal.frontend.cli", "top", server.base_url,
                            "--once"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TIDAL_API_KEY": "wrong"})
    assert wrong.returncode == 1 and "401" in wrong.stdout


def _browser():
    if not (os.path.exists(CHROMIUM) and shutil.which("chromedriver")):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs "
                    "them: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _wait(driver, condition, timeout=60, what="the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; status: "
                         f"{driver.find_element('id', 'status').text!r}")


def test_in_a_browser_the_batch_moves_and_the_playground_streams(server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shots = os.environ.get("TIDAL_UI_SCREENSHOTS")
    driver = _browser()
    try:
        driver.get(server.base_url + "/")
        _wait(driver, lambda d: d.find_element(By.ID, "status").text == "API key needed",
              what="the page to ask for the key")
        key = driver.find_element(By.ID, "api-key")
        key.send_keys(KEY, Keys.TAB)  # change event: kept in localStorage, reconnects
        _wait(driver, lambda d: d.find_element(By.ID, "status").text == "live",
              what="the live feed")
        threads = _load(server, n=6, max_tokens=48)
        _wait(driver, lambda d: d.find_element(By.ID, "step-detail").text.startswith("step "),
              what="steps to show")
        step_id = lambda d: int(d.find_element(By.ID, "step-detail").text.split()[1][:-1])
        first = step_id(driver)
        _wait(driver, lambda d: step_id(d) >= first + 20, what="the step view to move")
        assert "/ 512" in driver.find_element(By.ID, "budget").text
        if shots:
            os.makedirs(shots, exist_ok=True)
            driver.save_screenshot(os.path.join(shots, "batch.png"))
        for t in threads:
            t.join()

        driver.find_element(By.ID, "tab-play").click()
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "max_tokens").clear()
        driver.find_element(By.ID, "max_tokens").send_keys("16")
        driver.find_element(By.ID, "prompt").send_keys("The quick brown fox")
        driver.find_element(By.ID, "send").click()
        meta = _wait(driver, lambda d: [m.text for m in d.find_elements(By.CSS_SELECTOR,
                                                                         ".msg.assistant .meta")
                                        if "TTFT" in m.text], what="the streamed answer")
        assert "16 tokens" in meta[0] and "tokens/s" in meta[0]
        spans = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok")
        assert len(spans) == 16 and spans[0].get_attribute("title").startswith("logprob ")
        if shots:
            driver.save_screenshot(os.path.join(shots, "playground.png"))
    finally:
        driver.quit()
