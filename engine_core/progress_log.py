"""The engine core's progress line (vLLM's wording), every `LOG_INTERVAL_S` seconds while it is
busy: prompt and generation throughput since the last line, running and waiting requests, KV
cache usage, prefix cache hit rate, preemptions. Quiet while nothing runs. No IO but the log.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..ipc.frontend_messages import SchedulerStats

LOG_INTERVAL_S = 10.0
"""Seconds between two progress lines while the engine is busy."""


class ProgressLog:
    """Call `tick` as often as you like; it logs at most once per `interval_s`."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._last_log = clock()
        self._last_stats: SchedulerStats | None = None

    def tick(self, stats: Callable[[], SchedulerStats]) -> None:
        """Log one line if `interval_s` passed and steps ran since the last one (`stats()`
        is asked only then)."""
        now = self._clock()
        if now - self._last_log < self.interval_s:
            return
        current, prev = stats(), self._last_stats
        elapsed, self._last_log, self._last_stats = now - self._last_log, now, current
        if prev is not None and current.num_steps == prev.num_steps:
            return  # nothing happened: stay quiet while idle
        prompt = current.prompt_tokens - (prev.prompt_tokens if prev else 0)
        gen = current.generation_tokens - (prev.generation_tokens if prev else 0)
        hit_rate = (current.prefix_cache_hits / current.prefix_cache_queries
                    if current.prefix_cache_queries else 0.0)
        self.logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d", prompt / elapsed, gen / elapsed,
            current.num_running, current.num_waiting, 100 * current.kv_cache_usage,
            100 * hit_rate, current.num_preemptions)
