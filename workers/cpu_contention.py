"""A CPU worker that notices when other processes take its cores, gives way, and says so.

Linux counts, per thread, the time it spent runnable but waiting for a CPU
(`/proc/self/task/*/schedstat`, second field, nanoseconds). While a step runs every OpenMP
thread of the worker should be running; time they wait on a run queue is time another
process had the core. Each window of steps (`ADAPT_WINDOW_S` of step time; `WINDOW_S` where
the rank does not adapt) the worker sums that wait and divides it by what its threads could
have run (step time x threads): the window's *share*.

Why the thread count, and not the wait policy: libgomp reads OMP_WAIT_POLICY and
GOMP_SPINCOUNT once, when the process starts, and spinning is what makes a quiet machine fast
(`engine_core/cpu_threads.py`: twice PASSIVE's throughput on 2 cores). Beside a busy
neighbour, though, a spinning thread burns its turn waiting at a barrier for a partner the
scheduler has parked, and the step waits for both: the demo model's inter-token latency went
from ~8 ms to 85-230 ms beside two busy loops on a 2-core VM (docs/performance.md, "A shared
CPU"). `torch.set_num_threads` can change between steps, and a team of one thread has no
partner to wait for; the threads left out sleep in libgomp's pool after their spin count.

The `cpu_wait_policy=auto` rule (`CpuContention.step`):

- share > `DROP_SHARE` on n threads: halve n (at least 1), and log a warning (at most one
  per `REPEAT_S`) that says what takes the cores and what the user can do;
- on fewer than the full count, once `probe_after_s` have passed since the last change and
  the cores it gave up were idle over that time (at least `FREE_SHARE` of each, from
  /proc/stat's idle time of the cores this process may use): try the full count again. Its
  own run-queue wait says nothing here: beside one busy loop on 2 cores the one thread
  waits for nobody, yet two threads would. A try that is contended at once doubles
  `probe_after_s` (from `FIRST_PROBE_S` up to `MAX_PROBE_S`); one that holds resets it.

Changing the count keeps tokens bit-exact: every parallel loop of the CPU path splits rows or
requests among threads, never one reduction (tests/workers/test_cpu_contention.py runs the
same steps on 1 and on 2 threads and compares logits bit for bit). With `spin` or
`passive` the rank keeps its count and only warns, over `WINDOW_S` windows.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from typing import Callable, MutableMapping

logger = logging.getLogger(__name__)

WINDOW_S = 10.0
"""Seconds of step time between two looks at the run-queue wait (a rank that does not adapt)."""
ADAPT_WINDOW_S = 0.1
"""Seconds of step time between two looks where the rank adapts (`cpu_wait_policy=auto`):
short, so that a neighbour, or a try of the full count while it is still there, costs
about this much slow decoding (at least one step: spinning beside two busy loops, one step
of the demo model took 0.1-1 s). A look reads one small file per thread (~0.1 ms for a
worker's ~20 threads: 0.1% of its time)."""
WARN_SHARE = 0.25
"""Share of the threads' step time spent waiting for a CPU above which it warns."""
DROP_SHARE = WARN_SHARE
"""... and above which an adapting rank halves its threads."""
FREE_SHARE = 0.75
"""Share of the time each core a rank gave up must have been idle before it tries them again."""
FIRST_PROBE_S = 2.0
"""Seconds the cores must look free before a rank tries its full thread count again."""
MAX_PROBE_S = 60.0
"""The most that wait grows to after tries that found the cores taken at once."""
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


def idle_cores_s() -> float | None:
    """Seconds the cores this process may run on have been idle since boot, summed over
    them (/proc/stat's idle and iowait of each; None where Linux does not say)."""
    try:
        cores = os.sched_getaffinity(0)
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except (AttributeError, OSError):
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks += int(fields[3]) + int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


def apply_wait_policy(policy: str, env: MutableMapping[str, str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE in `env` for `cpu_wait_policy=passive` (the worker process's
    own environment, before torch loads libgomp, which reads it once); auto and spin leave
    libgomp's default (spin a while, then sleep). A value the user set is kept."""
    if policy == "passive":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def set_intra_op_threads(threads: int) -> None:
    """Run the next steps on `threads` OpenMP threads: torch's ops and the C kernels
    (`omp_set_num_threads` of the calling thread, under torch.set_num_threads) and numba's
    decode attention when it is loaded (numba keeps its count per calling thread, so this
    runs on the thread that runs the steps, as `WorkerProcess._execute` does)."""
    import torch

    torch.set_num_threads(threads)
    numba_attention = sys.modules.get(
        __name__.rpartition(".workers.")[0] + ".kernels.attention.numba_attention")
    if numba_attention is not None:
        numba_attention._match_torch_threads()


class CpuContention:
    """Fed each step's wall time; warns when the threads waited for CPUs and, where
    `set_threads` is given (`cpu_wait_policy=auto`), changes the thread count (see above)."""

    def __init__(self, rank: int, threads: int,
                 read_wait: Callable[[], float | None] = runqueue_wait_s,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None,
                 read_idle: Callable[[], float | None] = idle_cores_s) -> None:
        self.rank = rank
        self.full = max(1, threads)  # the rank's configured count
        self.threads = self.full  # the count its steps run on now
        self.read_wait = read_wait
        self.clock = clock
        self.set_threads = set_threads
        self.window_s = ADAPT_WINDOW_S if set_threads is not None else WINDOW_S
        self.step_s = 0.0  # step time in the current window
        self.wait_at_start = read_wait()
        self.warned_at: float | None = None
        self.last_share: float | None = None  # the last window's, for tests and logs
        self.read_idle = read_idle
        self.probe_after_s = FIRST_PROBE_S
        self.probing = False  # the full count was just tried again
        self._watch_idle(clock())

    def step(self, seconds: float) -> None:
        """One step took `seconds` (wall clock)."""
        if self.wait_at_start is None:
            return  # no schedstat here
        self.step_s += seconds
        if self.step_s < self.window_s:
            return
        wait = self.read_wait()
        if wait is None:
            return
        share = min(1.0, max(0.0, wait - self.wait_at_start) / (self.step_s * self.threads))
        self.last_share = share
        self.step_s, self.wait_at_start = 0.0, wait
        now = self.clock()
        if share > WARN_SHARE:
            self._warn(share, now)
        if self.set_threads is not None:
            self._adapt(share, now)

    def _adapt(self, share: float, now: float) -> None:
        if share > DROP_SHARE and self.threads > 1:
            if self.probing:  # the cores were taken as soon as it tried: wait longer next time
                self.probe_after_s = min(MAX_PROBE_S, 2 * self.probe_after_s)
            self.probing = False
            self._change(max(1, self.threads // 2), now)
        elif self.probing:  # the full count held for a window: the neighbour is gone
            self.probing = False
            self.probe_after_s = FIRST_PROBE_S
        elif self.threads < self.full and now - self.since >= self.probe_after_s:
            idle = self.read_idle()
            given_up = self.full - self.threads
            if (idle is not None and self.idle_at is not None
                    and idle - self.idle_at >= FREE_SHARE * given_up * (now - self.since)):
                self.probing = True
                self._change(self.full, now)
            else:
                self._watch_idle(now)  # still taken: look again over the next period

    def _watch_idle(self, now: float) -> None:
        """Count the cores' idle time from `now` on."""
        self.since = now
        self.idle_at = self.read_idle()

    def _change(self, threads: int, now: float) -> None:
        logger.debug("rank %d: %d -> %d thread(s) (run-queue wait %.0f%% of step time)",
                     self.rank, self.threads, threads, 100 * (self.last_share or 0.0))
        self.threads = threads
        self.set_threads(threads)
        self._watch_idle(now)

    def _warn(self, share: float, now: float) -> None:
        if self.warned_at is not None and now - self.warned_at <= REPEAT_S:
            return
        self.warned_at = now
        if self.set_threads is not None:
            logger.warning(
                "rank %d: other processes are taking these cores: the worker's %d thread(s) "
                "waited for a CPU %.0f%% of their step time, so it runs on fewer threads "
                "until the cores are free (--cpu-wait-policy auto). On a machine that is "
                "always shared, --cpu-wait-policy passive (idle threads sleep at once) or "
                "fewer --cpu-threads keep more for both; `nice` on the other work helps only "
                "in tidal's own session (engine_core/cpu_threads.py); --cpu-wait-policy spin "
                "keeps every thread", self.rank, self.threads, 100 * share)
        else:
            logger.warning(
                "rank %d: steps are slowed by other processes on these cores: the worker's "
                "%d thread(s) waited for a CPU %.0f%% of their step time over the last %.0f s "
                "of steps. --cpu-wait-policy auto (the default: fewer threads while the cores "
                "are taken) or passive (idle threads sleep instead of spinning), or fewer "
                "--cpu-threads, keep more of the machine for both; so does running the other "
                "work with nice in tidal's session (engine_core/cpu_threads.py)", self.rank,
                self.threads, 100 * share, self.window_s)
