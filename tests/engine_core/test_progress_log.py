"""The engine core's progress line (engine_core/progress_log.py): at most one per interval,
rates since the last line, quiet while nothing runs."""

from __future__ import annotations

import logging

from tidal.engine_core.progress_log import ProgressLog
from tidal.ipc.frontend_messages import SchedulerStats

LOGGER = logging.getLogger("test.progress")


def test_one_line_per_interval_with_rates_since_the_last_and_none_while_idle(caplog):
    now = [0.0]
    log = ProgressLog(LOGGER, interval_s=10.0, clock=lambda: now[0])
    stats = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_steps=5,
                           prompt_tokens=300, generation_tokens=100,
                           prefix_cache_queries=200, prefix_cache_hits=50)
    asked = []

    def snapshot():
        asked.append(now[0])
        return stats

    with caplog.at_level(logging.INFO, logger="test.progress"):
        now[0] = 5.0
        log.tick(snapshot)  # too soon: not even asked
        now[0] = 10.0
        log.tick(snapshot)
        now[0] = 20.0
        log.tick(snapshot)  # no step since: quiet
    assert asked == [10.0, 20.0]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: "
                    "10.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%, Preemptions: 0")
