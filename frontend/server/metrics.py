"""Prometheus metrics of `tidal serve`, named as vLLM names them, under both prefixes:
every series is on the page as `tidal:NAME` and as `vllm:NAME`, so a dashboard or alert made
for vLLM (its Grafana dashboard: vllm:num_requests_running, vllm:kv_cache_usage_perc and the
older vllm:gpu_cache_usage_perc, vllm:time_to_first_token_seconds, vllm:e2e_request_latency_
seconds, vllm:time_per_output_token_seconds (the older name of inter_token_latency_seconds),
vllm:prompt_tokens_total, ...) works unchanged (`with_vllm_names`). No `_created` series
(as vLLM: `disable_created_metrics`), so no name has two HELP lines.

Two sources, so that the numbers are the whole server's with any `--api-server-count`:

- Engine-core state and totals (requests running / waiting, KV cache usage, preemptions,
  prefix-cache queries / hits, prompt / generation tokens) are already whole-server in the
  engine core. Each scrape asks the core (`AsyncLLM.get_stats()`) and renders them from that
  one snapshot; they are never counted per process, so N processes cannot multiply them.
  With data parallelism the router's snapshot holds each engine core's too: every such metric
  then has an `engine` label, "0" .. "N-1" per core and "total" for the whole server.
- Per-request numbers (TTFT, inter-token latency, end-to-end latency, queue time, finished
  requests by reason, admission rejections) are observed by the process that served the
  request. With one process they live in a private registry. With several, the parent sets
  PROMETHEUS_MULTIPROC_DIR before any server process imports prometheus_client, every process
  writes its samples to its own memory-mapped files there, and a scrape (answered by whichever
  process accepted the connection) merges all files with `MultiProcessCollector`: histograms
  and counters are summed across processes.

Every series carries a `model_name` label: the served model name, except that a served name
which is an absolute path (a model served without --served-model-name is served under its
path, as in vLLM) is labelled with its last component: a scrape must not tell where the
server's files are.

The periodic log line ("Avg prompt throughput ... Prefix cache hit rate ...", every 10 s while
busy) is printed by the engine-core daemon itself (engine_core/daemon.py), once for the whole
server, so the HTTP processes do not print it again.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Iterable

import re

from prometheus_client import (
    CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # a `_created` gauge per counter and histogram: noise, and a
# second HELP line under a name of its own; vLLM turns them off too

VLLM_ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc",
                "inter_token_latency_seconds": "time_per_output_token_seconds"}
"""tidal's name -> the name older vLLM releases (and their dashboards) use for it."""

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# name (without prefix) -> (help, SchedulerStats field); gauges are instantaneous values
_CORE_GAUGES = {
    "num_requests_running": ("Requests in the running batch.", "num_running"),
    "num_requests_waiting": ("Requests waiting to be scheduled.", "num_waiting"),
    "kv_cache_usage_perc": ("KV-cache usage, 0 to 1 (1 = every block in use).",
                            "kv_cache_usage"),
}
# counters are totals since the engine core started
_CORE_COUNTERS = {
    "num_preemptions": ("Preemptions (recompute) since start.", "num_preemptions"),
    "prefix_cache_queries": ("Prefix-cache lookups, in tokens.", "prefix_cache_queries"),
    "prefix_cache_hits": ("Prefix-cache hits, in tokens.", "prefix_cache_hits"),
    "prompt_tokens": ("Prompt tokens computed (prefill).", "prompt_tokens"),
    "generation_tokens": ("Tokens generated.", "generation_tokens"),
    "worker_restarts": ("Times the engine core replaced its workers after a failure.",
                        "num_worker_restarts"),
    # speculative decoding (--speculative-config), vLLM's spec_decode names
    "spec_decode_num_drafts": ("Speculative decoding: request-steps that verified drafts.",
                               "spec_num_drafts"),
    "spec_decode_num_draft_tokens": ("Speculative decoding: draft tokens verified.",
                                     "spec_num_draft_tokens"),
    "spec_decode_num_accepted_tokens": ("Speculative decoding: draft tokens accepted.",
                                        "spec_num_accepted_tokens"),
}
_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos",
                 "Speculative decoding: draft tokens accepted at each draft position "
                 "(label position, 0 = the first draft).", "spec_accepted_per_pos")


def multiprocess_mode() -> bool:
    """True when samples go to PROMETHEUS_MULTIPROC_DIR (several server processes)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def metric_model_name(served_name: str) -> str:
    """The `model_name` label of a served name: the name, or for an absolute path (the
    default served name of a model given by its path) its last component."""
    if not os.path.isabs(served_name):
        return served_name
    return os.path.basename(os.path.normpath(served_name)) or served_name


class _CoreStatsCollector:
    """Renders one SchedulerStats snapshot as gauges and counters (a prometheus collector)."""

    def __init__(self, stats, model_name: str, prefix: str):
        self._stats = stats
        self._model = model_name
        self._prefix = prefix

    def collect(self) -> Iterable:
        for name, (doc, field) in _CORE_GAUGES.items():
            yield self._family(GaugeMetricFamily, name, doc, field)
        for name, (doc, field) in _CORE_COUNTERS.items():
            yield self._family(CounterMetricFamily, name, doc, field)
        if self._stats.spec_accepted_per_pos:
            yield self._per_position()

    def _per_position(self):
        """Accepted drafts per draft position (one series per position; with data
        parallelism the whole server's)."""
        name, doc, field = _PER_POSITION
        family = CounterMetricFamily(self._prefix + name, doc, labels=["model_name", "position"])
        for position, value in enumerate(getattr(self._stats, field)):
            family.add_metric([self._model, str(position)], float(value))
        return family

    def _family(self, kind, name: str, doc: str, field: str):
        """One metric: with data parallelism (`stats.cores`) one series per engine core,
        labelled engine="0", "1", ..., plus the whole server's, engine="total"."""
        if not self._stats.cores:
            family = kind(self._prefix + name, doc, labels=["model_name"])
            family.add_metric([self._model], float(getattr(self._stats, field)))
            return family
        family = kind(self._prefix + name, doc, labels=["model_name", "engine"])
        for index, core in enumerate(self._stats.cores):
            family.add_metric([self._model, str(index)], float(getattr(core, field)))
        family.add_metric([self._model, "total"], float(getattr(self._stats, field)))
        return family


LATENCY_WINDOW_S = 60.0
"""The live page's TTFT and ITL percentiles are over requests finished in the last minute."""


class RecentLatencies:
    """TTFT and inter-token latencies of the requests this process finished lately (bounded:
    the newest `max_samples` of each), for the page's percentiles."""

    def __init__(self, max_samples: int = 4096, clock=time.monotonic) -> None:
        self.clock = clock
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.itl: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, ttft: float | None, itls) -> None:
        now = self.clock()
        if ttft is not None:
            self.ttft.append((now, ttft))
        for latency in itls or ():
            self.itl.append((now, latency))

    def percentiles(self) -> dict:
        """{"ttft": {p50, p90, p99, n}, "itl": {...}} in seconds, over the last window."""
        since = self.clock() - LATENCY_WINDOW_S
        return {"ttft": _percentiles([v for t, v in self.ttft if t >= since]),
                "itl": _percentiles([v for t, v in self.itl if t >= since])}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values.sort()
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


class ServerMetrics:
    """The per-request metrics of one server process, and the `/metrics` page."""

    def __init__(self, model_name: str, prefix: str = "tidal:"):
        self.model_name = metric_model_name(model_name)
        self.prefix = prefix
        self._multiprocess = multiprocess_mode()
        # In multiprocess mode samples are written to files whatever the registry, and the
        # page merges the files, so the metrics are not registered anywhere in this process.
        self._registry = None if self._multiprocess else CollectorRegistry()
        labels = ["model_name"]
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time to first token, seconds.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between consecutive outputs, seconds.", ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "End-to-end request latency, seconds.", LATENCY_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Time spent waiting before first scheduled, seconds.",
                                     LATENCY_BUCKETS)
        self.success = Counter(prefix + "request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=self._registry)
        self.recent = RecentLatencies()  # for the live page (frontend/server/ui.py)
        self.rejections = Counter(prefix + "admission_rejections",
                                  "Requests rejected with 503 by admission control.",
                                  labels + ["reason"], registry=self._registry)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        return Histogram(self.prefix + name, doc, ["model_name"], buckets=buckets,
                         registry=self._registry)

    def count_rejection(self, reason: str = "max_num_queued_reqs") -> None:
        """One 503 from admission control; `reason` is the limit's name."""
        self.rejections.labels(self.model_name, reason).inc()

    def observe_finished(self, metrics, finish_reason: str | None) -> None:
        """Record a finished request from its `RequestMetrics` (None: count it only)."""
        self.success.labels(self.model_name, finish_reason or "abort").inc()
        if metrics is None:
            return
        model = self.model_name
        self.recent.add(None if metrics.first_token_time is None
                        else max(0.0, metrics.first_token_time - metrics.arrival_time),
                        metrics.inter_token_latencies)
        if metrics.first_token_time is not None:
            self.ttft.labels(model).observe(max(0.0, metrics.first_token_time
                                                - metrics.arrival_time))
        itl = self.itl.labels(model)
        for latency in metrics.inter_token_latencies or ():
            itl.observe(max(0.0, latency))
        if metrics.finished_time is not None:
            self.e2e.labels(model).observe(max(0.0, metrics.finished_time
                                               - metrics.arrival_time))
        if metrics.queue_time is not None:
            self.queue.labels(model).observe(max(0.0, metrics.queue_time))

    def render(self, core_stats=None) -> bytes:
        """The Prometheus text page: this server's request metrics plus the core's snapshot."""
        if self._multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            page = generate_latest(registry)
        else:
            page = generate_latest(self._registry)
        if core_stats is not None:
            core = CollectorRegistry()
            core.register(_CoreStatsCollector(core_stats, self.model_name, self.prefix))
            page += generate_latest(core)
        return with_vllm_names(page, self.prefix)


def with_vllm_names(page: bytes, prefix: str = "tidal:") -> bytes:
    """`page` followed by every one of its series again under vLLM's prefix, and those of
    VLLM_ALIASES under vLLM's older names too."""
    text = page.decode()
    name = re.compile(rf"^(# (?:HELP|TYPE) )?{re.escape(prefix)}", re.MULTILINE)
    vllm = name.sub(r"\1vllm:", text)
    older = [_renamed(vllm, f"vllm:{new}", f"vllm:{old}") for new, old in VLLM_ALIASES.items()]
    return (text + vllm + "".join(older)).encode()


def _renamed(text: str, name: str, new_name: str) -> str:
    """The lines of metric `name` (its HELP, TYPE and samples) in `text`, renamed."""
    pattern = re.compile(rf"^(?:# (?:HELP|TYPE) )?{re.escape(name)}(?:_bucket|_sum|_count)?"
                         r"[ {].*$", re.MULTILINE)
    return "".join(m.group(0).replace(name, new_name, 1) + "\n"
                   for m in pattern.finditer(text))

