"""Reading a server's Prometheus `/metrics` (tidal's `tidal:` or vLLM's `vllm:` names).

The benchmark scrapes once before and once after the run (counters: prefix-cache queries and
hits, preemptions) and samples the gauges (running, waiting, KV usage) during it for the
timeline plot. A server without `/metrics` simply yields empty scrapes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

METRIC_PREFIXES = ("tidal:", "vllm:")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


def parse_prometheus(text: str) -> dict[str, float]:
    """Engine metrics by short name (prefix and `_total` dropped), summed over label sets.

    `tidal:num_preemptions_total{model_name="m"} 3` -> {"num_preemptions": 3.0}. Lines of
    other metrics, comments, `_created` samples and histogram series are skipped. One
    prefix is read: tidal's where the page has it (tidal serve writes every series under
    both), else vLLM's.
    """
    values: dict[str, float] = {}
    prefix = next((p for p in METRIC_PREFIXES if f"\n{p}" in f"\n{text}"), None)
    for line in text.splitlines():
        if not line or line.startswith("#") or prefix is None or not line.startswith(prefix):
            continue
        name = _short_name(line.split("{", 1)[0].split(" ", 1)[0])
        if name is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def _short_name(full: str) -> str | None:
    for prefix in METRIC_PREFIXES:
        if full.startswith(prefix):
            name = full[len(prefix):]
            if name.endswith(("_created", "_bucket", "_sum", "_count")):
                return None
            return name[: -len("_total")] if name.endswith("_total") else name
    return None


async def scrape(client: httpx.AsyncClient, metrics_url: str) -> dict[str, float]:
    """One scrape; {} when the server has no usable /metrics."""
    try:
        response = await client.get(metrics_url, timeout=5.0)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return parse_prometheus(response.text)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Prefix-cache hit rate and preemptions over the run (None for what the server lacks)."""
    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    preemptions = delta("num_preemptions")
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else
        (0.0 if queries == 0 else None),
        "num_preemptions": int(preemptions) if preemptions is not None else None,
    }


@dataclass
class TimelineSampler:
    """Samples the server gauges and the client's in-flight count every `interval_s`."""

    client: httpx.AsyncClient
    metrics_url: str
    interval_s: float = 0.25
    t0: float = field(default_factory=time.perf_counter)
    in_flight: int = 0
    samples: list[dict] = field(default_factory=list)

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            values = await scrape(self.client, self.metrics_url)
            sample = {"t": time.perf_counter() - self.t0, "client_in_flight": self.in_flight}
            for name in GAUGES:
                if name in values:
                    sample[name] = values[name]
            self.samples.append(sample)
            await asyncio.sleep(self.interval_s)
