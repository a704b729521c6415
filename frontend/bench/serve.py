"""`tidal bench serve`: an async streaming client for any OpenAI-compatible `/v1/completions`.

One run: wait for the server, warm up, scrape `/metrics`, then send the workload with arrival
gaps drawn from a Gamma distribution (shape = burstiness, mean = 1/rate: Poisson at 1, burstier
below, more regular above; all at t=0 when the rate is infinite), under an optional client-side
concurrency cap, and measure each request while a sampler records the server's gauges. Then
scrape again, and summarize (see `metrics.py` for the definitions).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from .datasets import BenchRequest
from .metrics import (
    DEFAULT_PERCENTILES, RequestResult, peak_concurrency, summarize,
)
from .server_metrics import TimelineSampler, counter_deltas, scrape


@dataclass
class ServeConfig:
    """How to drive the server."""

    base_url: str = "http://127.0.0.1:8000"
    """Server root (no trailing /v1)."""
    endpoint: str = "/v1/completions"
    """Path of the completions endpoint."""
    model: str | None = None
    """Model name in requests (default: the first id from /v1/models)."""
    request_rate: float = math.inf
    """Mean requests per second; inf sends everything at t=0."""
    burstiness: float = 1.0
    """Gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular."""
    max_concurrency: int | None = None
    """Most requests in flight at once (client side); None = no cap."""
    num_warmups: int = 0
    """Requests sent (and awaited) before measuring, not counted."""
    ignore_eos: bool = False
    """Ask the server to generate exactly `max_tokens` (vLLM's extension)."""
    temperature: float = 0.0
    """Sampling temperature of every request."""
    seed: int = 0
    """Seed of the arrival gaps."""
    request_timeout_s: float = 600.0
    """Per-request timeout."""
    ready_timeout_s: float = 60.0
    """How long to wait for /v1/models to answer before giving up."""
    metrics_interval_s: float = 0.25
    """Timeline sampling period of /metrics."""
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body."""
    disable_tqdm: bool = False
    """No progress bar."""
    goodput_slos: dict = field(default_factory=dict)
    """SLOs in ms by metric (ttft, tpot, e2el) for the goodput figure; empty = none."""
    percentiles: tuple = DEFAULT_PERCENTILES
    """Latency percentiles to report."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Gamma(shape=b, scale=1/(rate*b)), mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return [float(g) for g in rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num)]


async def wait_until_ready(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> list[str]:
    """Poll /v1/models until it answers 200; returns the model ids. TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while time.monotonic() < deadline:
        try:
            response = await client.get(f"{base_url}/v1/models", timeout=5.0)
            if response.status_code == 200:
                return [m["id"] for m in response.json().get("data", [])]
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            last_error = repr(e)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{base_url}/v1/models not ready after {timeout_s} s ({last_error})")


def request_body(request: BenchRequest, model: str, config: ServeConfig) -> dict:
    """The JSON body of one streaming completion request."""
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict,
                       request: BenchRequest, t0: float, timeout_s: float) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network errors."""
    result = RequestResult(success=False, prompt_len=request.prompt_len,
                           expected_output_len=request.output_len)
    start = time.perf_counter()
    result.start_time = start - t0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as response:
            result.status_code = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
            else:
                await _read_stream(response, result, start)
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - start
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> None:
    """Consume SSE `data:` lines: time content chunks, take token counts from `usage`."""
    last = start
    num_chunks = 0
    usage = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"])[:500]
            return
        usage = chunk.get("usage") or usage
        if any(c.get("text") for c in chunk.get("choices") or []):
            now = time.perf_counter()
            if num_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            num_chunks += 1
    result.output_len = int(usage["completion_tokens"]) if usage else num_chunks
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.success = num_chunks > 0 or result.output_len > 0
    if not result.success:
        result.error = "no content streamed"


async def _run_one(client, url, body, request, t0, config, semaphore, sampler, pbar):
    if semaphore is None:
        return await _measure(client, url, body, request, t0, config, sampler, pbar)
    async with semaphore:
        return await _measure(client, url, body, request, t0, config, sampler, pbar)


async def _measure(client, url, body, request, t0, config, sampler, pbar) -> RequestResult:
    sampler.in_flight += 1
    try:
        return await send_request(client, url, body, request, t0, config.request_timeout_s)
    finally:
        sampler.in_flight -= 1
        if pbar is not None:
            pbar.update(1)


async def _warm_up(client, url, model, requests, config) -> None:
    for i in range(config.num_warmups):
        request = requests[i % len(requests)]
        await send_request(client, url, request_body(request, model, config), request,
                           time.perf_counter(), config.request_timeout_s)


async def run_serve_benchmark(requests: list[BenchRequest], config: ServeConfig) -> dict:
    """Run the workload against the server; the summary dict (JSON-ready, see `metrics`)."""
    base = config.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client:
        model_ids = await wait_until_ready(client, base, config.ready_timeout_s)
        model = config.model or (model_ids[0] if model_ids else "")
        url = base + config.endpoint
        await _warm_up(client, url, model, requests, config)
        before = await scrape(client, base + "/metrics")
        results, duration, sampler = await _measured_phase(client, url, model, requests, config)
        after = await scrape(client, base + "/metrics")
    summary = summarize(results, duration, slos=config.goodput_slos,
                        percentiles=config.percentiles)
    summary.update(counter_deltas(before, after) if after else
                   {"prefix_cache_hit_rate": None, "num_preemptions": None})
    summary.update(model=model, base_url=base, request_rate=_rate_json(config.request_rate),
                   burstiness=config.burstiness, max_concurrency=config.max_concurrency,
                   peak_concurrency=peak_concurrency([r for r in results if r.success]),
                   timeline=sampler.samples)
    return {"summary": summary, "results": results}


async def _measured_phase(client, url, model, requests, config):
    sampler = TimelineSampler(client, url.rsplit("/v1/", 1)[0] + "/metrics",
                              config.metrics_interval_s)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    gaps = arrival_gaps(len(requests), config.request_rate, config.burstiness, config.seed)
    pbar = None if config.disable_tqdm else tqdm(total=len(requests), desc="requests")
    sampler_task = asyncio.create_task(sampler.run())
    t0 = sampler.t0 = time.perf_counter()
    tasks = []
    for request, gap in zip(requests, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        body = request_body(request, model, config)
        tasks.append(asyncio.create_task(
            _run_one(client, url, body, request, t0, config, semaphore, sampler, pbar)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    sampler_task.cancel()
    await asyncio.gather(sampler_task, return_exceptions=True)
    if pbar is not None:
        pbar.close()
    return results, duration, sampler


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate
