"""A CPU worker that notices when other processes take its cores, gives way, and says so.

Linux counts, per thread, the time it spent runnable but waiting for a CPU
(`/proc/self/task/*/schedstat`, second field, nanoseconds). While a step runs every OpenMP
thread of the worker should be running; time they wait on a run queue is time another
process had the core. Each window of steps (`ADAPT_WINDOW_S` of step time; `WINDOW_S` where
the rank does not adapt) the worker sums that wait and divides it by what its threads could
have run (step time x threads): the window's *share*.

How the wait policy changes after start: libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT
once, when the process starts, and spinning is what makes a quiet machine fast
(`engine_core/cpu_threads.py`: twice PASSIVE's throughput on 2 cores). Beside a busy
neighbour, though, a spinning thread burns its turn waiting at a barrier for a partner the
scheduler has parked: the demo model's decode went from ~5 ms a token to 0.4-1 s on this
project's 2-core VM. But libgomp spins only ~100 times instead of ~300,000 (about PASSIVE)
whenever it manages more threads than the process has cores (`do_spin` in its
config/linux/wait.h: `gomp_managed_threads > gomp_available_cpus`); so `OpenMPThrottle`
makes it manage more: a helper thread opens one parallel region of a few threads, whose
threads then sleep in that thread's pool, counted, until the helper ends.

Why the thread count halves too (`ContendedMode`): beside two un-niced busy loops in sessions
of their own, Linux's autogroup gives each session an equal share, so the worker's session
gets 2/3 of a core of the 2-core VM whatever its thread count. Split over two threads that
meet at every barrier of every layer, each third of a core waits for the other's turn;
one thread computes in its share undisturbed. SmolLM2-135M decode, 2026-12-04 12:35 UTC
(`benchmarks/shared_cpu.py`, quiet -> busy): two sleeping threads 9.9 -> 58-69 ms a token,
one thread 15-17.5 -> 21-27 ms. On SmolLM2 1 and 2 threads gave bit-identical logprobs
(24 greedy tokens of 6 prompts); a kernel that split a sum across threads (oneDNN may, for
long products) could change the last bits, as a change of machine can.
The `cpu_wait_policy=auto` rule (`CpuContention.step`):

- share > `DROP_SHARE` while spinning: throttle (half the threads, the idle ones sleeping
  at once), and log a warning (at most one per `REPEAT_S`) that says what takes the cores
  and what the user can do;
- share < `RESTORE_SHARE` in every window for `probe_after_s` while throttled, and the cores
  idle `FREE_CORES` on average meanwhile: every thread, spinning, again. A
  try that is contended at once doubles `probe_after_s` (from `FIRST_PROBE_S` up to
  `MAX_PROBE_S`); one that holds resets it.

With `spin` or `passive`, or where the process has no libgomp, the rank only warns, over
`WINDOW_S` windows.

The start is judged too (`LoadThreads`, `cpu_wait_policy=auto`): a rank whose import of torch
waited for a CPU more than `LOAD_DROP_SHARE` of the time loads its model on one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import sys
import threading
import time
from typing import Callable, MutableMapping

logger = logging.getLogger(__name__)

WINDOW_S = 10.0
"""Seconds of step time between two looks at the run-queue wait (a rank that does not adapt)."""
ADAPT_WINDOW_S = 0.1
"""Seconds of step time between two looks where the rank adapts (`cpu_wait_policy=auto`):
short, so that a neighbour, or a try at spinning while it is still there, costs
about this much slow decoding (at least one step: spinning beside two busy loops, one step
of the demo model took 0.1-1 s). A look reads one small file per thread (~0.1 ms for a
worker's ~20 threads: 0.1% of its time)."""
WARN_SHARE = 0.25
"""Share of the threads' step time spent waiting for a CPU above which it warns."""
DROP_SHARE = WARN_SHARE
"""... and above which an adapting rank's idle threads stop spinning."""
RESTORE_SHARE = 0.10
"""Share below which a throttled rank counts the cores as free ..."""
FREE_CORES = 0.25
"""... provided the cores this process may use were also idle this many cores' worth on
average over the period (/proc/stat): threads that sleep at once wait little on a run
queue even on a busy machine (they are not runnable), so their wait alone tried spinning
again under load, and each try cost a step of 0.4-1 s."""
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


class OpenMPThrottle:
    """Switches this process's libgomp between its own spin count and its throttled one
    (~100 spins: about PASSIVE) while the process runs (see above). `engage(True)` starts a
    helper thread that opens one parallel region of `extra + 1` threads (each calls libc's
    free(NULL): nothing) and then waits; its `extra` threads stay in its pool, counted, so
    libgomp manages more threads than `cores`. `engage(False)` ends the helper; its pool, and
    the count, go with it (libgomp's thread destructor)."""

    def __init__(self, threads: int, cores: int | None = None) -> None:
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        # libgomp counts the first thread and each pool thread: `threads` for the steps' team;
        # `extra` more makes the count exceed the cores
        self.extra = max(1, cores - threads + 1)
        self.gomp = _loaded_libgomp()
        self.helper: threading.Thread | None = None
        self.held = threading.Event()  # the helper's region has run: its threads are counted
        self.release = threading.Event()

    @property
    def available(self) -> bool:
        """Whether this process runs libgomp (torch's CPU builds on Linux do)."""
        return self.gomp is not None

    def engage(self, on: bool) -> None:
        if on and self.helper is None and self.gomp is not None:
            self.held.clear()
            self.release.clear()
            self.helper = threading.Thread(target=self._hold, name="tidal-omp-throttle",
                                           daemon=True)
            self.helper.start()
            self.held.wait()
        elif not on and self.helper is not None:
            self.release.set()
            self.helper.join()
            self.helper = None

    def _hold(self) -> None:
        free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
        self.gomp.GOMP_parallel(free, None, self.extra + 1, 0)
        self.held.set()
        self.release.wait()


class ContendedMode:
    """What an adapting rank (`cpu_wait_policy=auto`) changes while other processes take its
    cores: its steps run on half its threads (at least one), and libgomp's idle threads sleep
    at once (`OpenMPThrottle`, where the process runs libgomp). `engage` is called on the
    thread that runs the steps (OpenMP's and numba's thread counts are per calling thread)
    and returns the threads the steps now run on."""

    def __init__(self, threads: int, omp: OpenMPThrottle | None = None,
                 set_threads: Callable[[int], None] | None = None) -> None:
        self.threads = max(1, threads)
        self.contended_threads = max(1, self.threads // 2)
        self.omp = omp if omp is not None and omp.available else None
        self.set_threads = set_threads or set_step_threads

    def engage(self, on: bool) -> int:
        if self.omp is not None:
            self.omp.engage(on)
        threads = self.contended_threads if on else self.threads
        self.set_threads(threads)
        return threads


def set_step_threads(threads: int) -> None:
    """The threads this thread's parallel regions use from now on: torch's (and, through its
    libgomp, the C kernels'), and numba's where its pool runs already."""
    import torch

    torch.set_num_threads(threads)
    numba = sys.modules.get("numba")
    if numba is not None:
        try:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        except Exception:  # noqa: BLE001 - numba without a threading layer: nothing to set
            pass


LOAD_DROP_SHARE = 0.5
"""Share of its start a rank's thread spent waiting for a CPU above which it loads on one
thread (`LoadThreads`). Higher than the steps' `DROP_SHARE`: a start shares the cores with
tidal's own frontend and engine core starting beside it (about 0.6 s of a frontend's CPU
time overlaps a worker's ~1.5 s import of torch on 2 cores: a share near 0.2 on an otherwise
idle machine, estimated, not measured here), while beside other sessions' benchmarks (load
average ~5 on 2 vCPUs, 2026-12-04) the demo model's starts waited 0.67-0.78."""


class LoadThreads:
    """Whether a rank loads its model on one thread: where its start so far (one thread
    importing torch and tidal) waited for a CPU more than `LOAD_DROP_SHARE` of the time.
    Loading is a few thousand short parallel regions (a copy per weight,
    the panel kernel's block search and packing), and beside busy neighbours each waits at
    its barrier for a partner the scheduler has parked; on one thread nothing waits. The load
    computes the same bytes on any number of threads (copies, packing, exact checks).

    SmolLM2-135M's load on the 2-vCPU EPYC beside other sessions' benchmarks (load average
    5-7, 2026-12-04): 6.5 s of a worker's 10.3 s under cProfile, of which copying the weights
    2.1 s, the block search 2.0 s and packing panels 1.8 s, where one thread does the search
    in 0.2 s.

        threads = LoadThreads()      # at the process's start
        ...                          # import torch
        with threads.loading():      # one thread if the start was contended
            worker.load()
    """

    def __init__(self, read_wait: Callable[[], float | None] = runqueue_wait_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read_wait, self.clock = read_wait, clock
        self.started, self.wait_at_start = clock(), read_wait()
        self.share: float | None = None  # the start's run-queue wait share, once judged

    @property
    def was_contended(self) -> bool:
        """What the last `contended()` found (False before it looked)."""
        return self.share is not None and self.share > LOAD_DROP_SHARE

    def contended(self) -> bool:
        """Whether the start so far waited for a CPU more than `LOAD_DROP_SHARE` of its
        time."""
        wait, elapsed = self.read_wait(), self.clock() - self.started
        if wait is None or self.wait_at_start is None or elapsed <= 0:
            return False
        self.share = max(0.0, wait - self.wait_at_start) / elapsed
        return self.was_contended

    @contextlib.contextmanager
    def loading(self, set_threads: Callable[[int], None] | None = None):
        """Run the body on one thread if `contended()`, and restore torch's count after."""
        import torch

        threads = torch.get_num_threads()
        if threads <= 1 or not self.contended():
            yield
            return
        set_threads = set_threads or set_step_threads
        logger.info("loading on 1 thread of %d: the start waited for a CPU %.0f%% of its time "
                    "(other processes take these cores)", threads, 100 * self.share)
        set_threads(1)
        try:
            yield
        finally:
            set_threads(threads)


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), from /proc/self/maps; None if none."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            gomp = ctypes.CDLL(path)
            gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                           ctypes.c_uint]
            return gomp
        except (OSError, AttributeError):
            continue
    return None


class CpuContention:
    """Fed each step's wall time; warns when the threads waited for CPUs and, where
    `throttle` is given (`cpu_wait_policy=auto`: `ContendedMode.engage`), engages it while
    they do and releases it once they stop (see above). A throttle that returns a number
    says how many threads the steps run on from then (the share's denominator)."""

    def __init__(self, rank: int, threads: int,
                 read_wait: Callable[[], float | None] = runqueue_wait_s,
                 clock: Callable[[], float] = time.monotonic,
                 throttle: Callable[[bool], int | None] | None = None,
                 read_idle: Callable[[], float | None] = idle_cores_s) -> None:
        self.rank = rank
        self.threads = max(1, threads)
        self.read_wait = read_wait
        self.clock = clock
        self.throttle = throttle
        self.throttled = False
        self.window_s = ADAPT_WINDOW_S if throttle is not None else WINDOW_S
        self.step_s = 0.0  # step time in the current window
        self.wait_at_start = read_wait()
        self.warned_at: float | None = None
        self.last_share: float | None = None  # the last window's, for tests and logs
        self.probe_after_s = FIRST_PROBE_S
        self.probing = False  # spinning was just tried again
        self.read_idle = read_idle
        self._watch(clock())  # from the last change, or the last contended look, on

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
        if self.throttle is not None:
            self._adapt(share, now)

    def start_throttled(self, share: float) -> None:
        """The rank's start waited for a CPU `share` of its time (`LoadThreads`): throttle
        before the first step rather than after its first window (the first steps are the
        first token's), and look for free cores as after any throttle."""
        if self.throttle is None or self.throttled:
            return
        self.last_share = share
        self._change(True, self.clock(), of="its start")

    def _adapt(self, share: float, now: float) -> None:
        if share > DROP_SHARE and not self.throttled:
            if self.probing:  # the cores were taken as soon as it tried: wait longer next time
                self.probe_after_s = min(MAX_PROBE_S, 2 * self.probe_after_s)
            self.probing = False
            self._change(True, now)
        elif self.probing:  # spinning held for a window: the neighbour is gone
            self.probing = False
            self.probe_after_s = FIRST_PROBE_S
        elif self.throttled and share >= RESTORE_SHARE:
            self._watch(now)  # still taken: the cores must look free for a whole period
        elif self.throttled and now - self.since >= self.probe_after_s:
            idle = self.read_idle()
            if (idle is not None and self.idle_at is not None
                    and idle - self.idle_at >= FREE_CORES * (now - self.since)):
                self.probing = True
                self._change(False, now)
            else:
                self._watch(now)  # the machine is busy: look again over the next period

    def _watch(self, now: float) -> None:
        """Judge whether the cores are free from `now` on."""
        self.since = now
        self.idle_at = self.read_idle()

    def _change(self, throttled: bool, now: float, of: str = "step time") -> None:
        self.throttled = throttled
        self._watch(now)
        threads = self.throttle(throttled)
        if threads is not None:
            self.threads = threads
        logger.info("rank %d: %s (run-queue wait %.0f%% of %s)", self.rank,
                    f"steps on {self.threads} thread(s), idle ones sleeping at once" if throttled
                    else f"steps on {self.threads} thread(s), idle ones spinning again",
                    100 * (self.last_share or 0.0), of)

    def _warn(self, share: float, now: float) -> None:
        if self.warned_at is not None and now - self.warned_at <= REPEAT_S:
            return
        self.warned_at = now
        if self.throttle is not None:
            logger.warning(
                "rank %d: other processes are taking these cores: the worker's %d thread(s) "
                "waited for a CPU %.0f%% of their step time, so its steps run on half its threads "
                "and idle threads sleep at once instead of spinning until the cores are free "
                "(--cpu-wait-policy auto). On a machine that is "
                "always shared, --cpu-wait-policy passive (sleep from the start) or "
                "fewer --cpu-threads keep more for both; `nice` on the other work helps only "
                "in tidal's own session (engine_core/cpu_threads.py); --cpu-wait-policy spin "
                "always spins", self.rank, self.threads, 100 * share)
        else:
            logger.warning(
                "rank %d: steps are slowed by other processes on these cores: the worker's "
                "%d thread(s) waited for a CPU %.0f%% of their step time over the last %.0f s "
                "of steps. --cpu-wait-policy auto (the default: idle threads sleep while the "
                "cores are taken) or passive (idle threads sleep instead of spinning), or fewer "
                "--cpu-threads, keep more of the machine for both; so does running the other "
                "work with nice in tidal's session (engine_core/cpu_threads.py)", self.rank,
                self.threads, 100 * share, self.window_s)
