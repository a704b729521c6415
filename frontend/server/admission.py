"""Admission control: reject with 503 before any work starts, for `--max-num-queued-reqs`
(too many unfinished requests) and `--max-queue-delay` (too long an estimated wait).

The count is the whole server's, with any number of HTTP server processes:

    unfinished = sum(slots) + others

- `slots` is one integer per HTTP server process of this `tidal serve`, in shared memory
  (a `multiprocessing.RawArray` made by the parent before it starts the servers). Each process
  writes only its own slot and reads all of them, so the sum is exact and immediate, without
  locks: a request counts from the moment it is admitted until its response is over (finished,
  failed or aborted), which covers its whole life in the engine core. A request with n
  completions counts n, as the engine core runs n requests for it.
- `others` is the engine core's running + waiting count that is not ours: requests of other
  frontends attached to the same daemon (a Python `LLM`, another `tidal serve --engine`). It
  comes from `AsyncLLM.get_stats()`, refreshed in the background (`refresh_loop`), as
  max(0, core_count - our_count_at_that_moment). Since each of our requests counts from before
  it reaches the core until after it leaves, that difference is 0 when we are the only
  frontend: stale snapshots never make us reject our own traffic wrongly.

Check and increment run in one synchronous step on the event loop, so within a process there
is no race; across processes two requests admitted in the same microsecond may both pass (the
same lock-free trade-off vLLM's admission_control.py makes).

`--max-queue-delay`: the engine core estimates the wait from the work it has queued
(`engine_core/queue_estimate.py`, through the step cost model) and reports it in each stats
snapshot; here the new request's own prompt is added, and what this process admitted since
the snapshot's query was sent (other processes' admissions show in the next snapshot):

    wait = est_queue_delay_s + (prompt + admitted since) tokens * est_s_per_prompt_token
           + (admitted since) requests * est_s_per_queued_request

Above the limit the answer is 503 with `Retry-After: ceil(wait - limit)` (at least 1 s): the
queue drains about a second of work per second.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
from typing import Awaitable, Callable

from tidal.frontend.server.errors import QUEUE_FULL_MESSAGE, APIError

logger = logging.getLogger("tidal.serve")

STATS_REFRESH_SECONDS = 0.5
"""How often each server process refreshes the core's count of other frontends' requests."""
DELAY_REFRESH_SECONDS = 0.25
"""How often it refreshes the core's queue estimate under --max-queue-delay."""


def make_shared_slots(num_servers: int):
    """One int64 slot per HTTP server process, in shared memory (pass to each child)."""
    return multiprocessing.RawArray("q", num_servers)


class Ticket:
    """An admitted request's share of the count; `release()` once it is over (idempotent)."""

    __slots__ = ("_controller", "num_reqs")

    def __init__(self, controller: "AdmissionController", num_reqs: int):
        self._controller = controller
        self.num_reqs = num_reqs

    def release(self) -> None:
        if self._controller is not None:
            self._controller._add(-self.num_reqs)
            self._controller = None


class AdmissionController:
    """Counts unfinished requests and enforces `limit` (None = unlimited) and
    `max_queue_delay` (seconds; None = off).

    `slots` is shared memory from `make_shared_slots` (several processes) or None (this
    process alone); `slot` is this process's index in it. `on_reject(reason)` is called for
    each 503 (reason: max_num_queued_reqs or max_queue_delay).
    """

    def __init__(self, limit: int | None, slots=None, slot: int = 0,
                 on_reject: Callable[[str], None] | None = None,
                 max_queue_delay: float | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"max_num_queued_reqs must be at least 1, got {limit}")
        if max_queue_delay is not None and not max_queue_delay > 0:
            raise ValueError(f"max_queue_delay must be positive, got {max_queue_delay}")
        self.limit = limit
        self.max_queue_delay = max_queue_delay
        self._slots = slots if slots is not None else [0]
        self._slot = slot
        self._on_reject = on_reject
        self.others = 0  # the core's unfinished requests that are not ours (see module doc)
        self._estimate = (0.0, 0.0, 0.0)
        """The core's (queue delay s, s per prompt token, s per queued request)."""
        self._admitted = [0, 0]
        """Prompt tokens and requests this process ever admitted."""
        self._mark = (0, 0)
        """`_admitted` when the query of the snapshot in `_estimate` was sent."""

    def _add(self, delta: int) -> None:
        self._slots[self._slot] += delta

    def num_local(self) -> int:
        """Unfinished requests admitted by this process."""
        return int(self._slots[self._slot])

    def num_ours(self) -> int:
        """Unfinished requests admitted by every HTTP server process of this server."""
        return int(sum(self._slots))

    def num_unfinished(self) -> int:
        """The whole server's estimate: ours (exact) plus other frontends' (from the core)."""
        return self.num_ours() + self.others

    def estimated_wait(self, num_prompt_tokens: int) -> float:
        """Seconds a new request with this many prompt tokens would wait for its first token
        (see the module docstring; 0 before the first snapshot)."""
        delay, per_token, per_request = self._estimate
        tokens = self._admitted[0] - self._mark[0] + num_prompt_tokens
        return delay + tokens * per_token + (self._admitted[1] - self._mark[1]) * per_request

    def admit(self, num_reqs: int, num_prompt_tokens: int = 0) -> Ticket:
        """Admit `num_reqs` engine requests holding `num_prompt_tokens` prompt tokens in all,
        or raise a 503 APIError (nothing is counted)."""
        if self.limit is not None and self.num_unfinished() + num_reqs > self.limit:
            self._reject("max_num_queued_reqs")
            raise APIError(503, QUEUE_FULL_MESSAGE, err_type="Service Unavailable")
        if self.max_queue_delay is not None:
            wait = self.estimated_wait(num_prompt_tokens)
            if wait > self.max_queue_delay:
                self._reject("max_queue_delay")
                retry = max(1, math.ceil(wait - self.max_queue_delay))
                raise APIError(
                    503, f"The engine is busy: a new request would wait about {wait:.1f} s for "
                    f"its first token, more than the server's limit of "
                    f"{self.max_queue_delay:g} s. Please retry after {retry} s or on a "
                    "different instance.", err_type="Service Unavailable",
                    headers={"Retry-After": str(retry)})
        self._add(num_reqs)
        self._admitted[0] += num_prompt_tokens
        self._admitted[1] += num_reqs
        return Ticket(self, num_reqs)

    def _reject(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)

    def note_core_count(self, core_unfinished: int, ours_before: int, ours_after: int) -> None:
        """Update `others` from a core snapshot taken between two reads of our own count."""
        self.others = max(0, core_unfinished - max(ours_before, ours_after))

    def note_core_estimate(self, stats, mark: tuple[int, int]) -> None:
        """Take the core's queue estimate from a snapshot whose query was sent when
        `_admitted` was `mark`."""
        self._estimate = (getattr(stats, "est_queue_delay_s", 0.0),
                          getattr(stats, "est_s_per_prompt_token", 0.0),
                          getattr(stats, "est_s_per_queued_request", 0.0))
        self._mark = mark

    async def refresh_loop(self, get_stats: Callable[[], Awaitable]) -> None:
        """Keep `others` and the queue estimate fresh while the server runs (only needed
        when a limit is set)."""
        interval = (DELAY_REFRESH_SECONDS if self.max_queue_delay is not None
                    else STATS_REFRESH_SECONDS)
        while True:
            try:
                before = self.num_ours()
                mark = (self._admitted[0], self._admitted[1])
                stats = await asyncio.wait_for(get_stats(), timeout=5.0)
                self.note_core_count(stats.num_running + stats.num_waiting, before,
                                     self.num_ours())
                self.note_core_estimate(stats, mark)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is slow or gone: keep the last value
                logger.debug("admission: stats refresh failed: %s", exc)
            await asyncio.sleep(interval)
