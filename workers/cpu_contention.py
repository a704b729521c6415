"""A warning when a worker's steps slow down because other processes take its cores.

Linux counts, per thread, the time it spent runnable but waiting for a CPU
(`/proc/self/task/*/schedstat`, second field, nanoseconds). While a step runs every OpenMP
thread of the worker should be running; time they wait on a run queue is time another
process had the core. Over a window of steps (`WINDOW_S` of step time at least) the worker
sums that wait and compares it with what its threads could have run (step time x threads);
past `WARN_SHARE` it logs one warning (at most one per `REPEAT_S`), which says what helps: a
busy neighbour turns spinning OpenMP waits into lost turns (engine_core/cpu_threads.py says
why the default spins and what PASSIVE costs on a quiet machine).
"""

from __future__ import annotations

import glob
import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

WINDOW_S = 10.0
"""Seconds of step time between two looks at the run-queue wait."""
WARN_SHARE = 0.25
"""Share of the threads' step time spent waiting for a CPU above which it warns."""
REPEAT_S = 300.0
"""Least seconds between two warnings."""


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have waited for a CPU in all (None where Linux does
    not say: no schedstat)."""
    total = 0
    found = False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
            found = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9 if found else None


class CpuContention:
    """Fed each step's wall time; warns when the threads waited for CPUs (see above)."""

    def __init__(self, rank: int, threads: int,
                 read_wait: Callable[[], float | None] = runqueue_wait_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self.threads = max(1, threads)
        self.read_wait = read_wait
        self.clock = clock
        self.step_s = 0.0  # step time in the current window
        self.wait_at_start = read_wait()
        self.warned_at: float | None = None
        self.last_share: float | None = None  # the last window's, for tests and logs

    def step(self, seconds: float) -> None:
        """One step took `seconds` (wall clock)."""
        if self.wait_at_start is None:
            return  # no schedstat here
        self.step_s += seconds
        if self.step_s < WINDOW_S:
            return
        wait = self.read_wait()
        if wait is None:
            return
        share = min(1.0, (wait - self.wait_at_start) / (self.step_s * self.threads))
        self.last_share = share
        self.step_s, self.wait_at_start = 0.0, wait
        now = self.clock()
        if share > WARN_SHARE and (self.warned_at is None or now - self.warned_at > REPEAT_S):
            self.warned_at = now
            logger.warning(
                "rank %d: steps are slowed by other processes on these cores: the worker's "
                "%d thread(s) waited for a CPU %.0f%% of their step time over the last %.0f s "
                "of steps. OMP_WAIT_POLICY=PASSIVE in tidal's environment (idle threads "
                "sleep instead of spinning) or fewer --cpu-threads keep more of the machine "
                "for both; so does running the other work with nice in tidal's session "
                "(engine_core/cpu_threads.py)", self.rank, self.threads, 100 * share,
                WINDOW_S)
