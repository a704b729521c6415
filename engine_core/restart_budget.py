"""How often a supervisor may restart what it supervises: at most `limit` restarts within any
`window_s` seconds (10 minutes by default), so that a server running for weeks survives a
rare fault now and then, while a fault that repeats (a model that cannot load, a worker that
crashes on every step) still ends in a final failure instead of a restart loop.

Every `Supervisor` (supervisor.py) keeps one: --max-worker-restarts (the daemon's worker
healing), --max-engine-restarts (`tidal serve` and `LLM` / `AsyncLLM` restarting their core),
`tidal serve`'s HTTP processes and the data-parallel router's cores. No IO and no torch.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

RESTART_WINDOW_S = 600.0
"""Restarts older than this no longer count against the limit."""


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds (`limit` 0: none)."""

    def __init__(self, limit: int, window_s: float = RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 0:
            raise ValueError(f"a restart limit must be >= 0, got {limit}")
        self.limit = limit
        self.window_s = window_s
        self.total = 0
        """Restarts over the whole lifetime (for metrics and logs)."""
        self._clock = clock
        self._recent: deque[float] = deque()

    def recent(self) -> int:
        """Restarts within the last `window_s` seconds."""
        cutoff = self._clock() - self.window_s
        while self._recent and self._recent[0] <= cutoff:
            self._recent.popleft()
        return len(self._recent)

    def spend(self) -> bool:
        """Record one restart now and return True, or return False (nothing recorded) when
        `limit` restarts were made within the window already."""
        if self.recent() >= self.limit:
            return False
        self._recent.append(self._clock())
        self.total += 1
        return True

    def describe(self) -> str:
        """'restart 2 of at most 3 in 10 min' for the restart just spent."""
        return f"restart {self.recent()} of at most {self.limit} in {self.window_s / 60:g} min"
