"""Admission control for `--max-num-queued-reqs`: reject with 503 before any work starts.

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
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from typing import Awaitable, Callable

from tidal.frontend.server.errors import QUEUE_FULL_MESSAGE, APIError

logger = logging.getLogger("tidal.serve")

STATS_REFRESH_SECONDS = 0.5
"""How often each server process refreshes the core's count of other frontends' requests."""


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
    """Counts unfinished requests and enforces `limit` (None = unlimited, never rejects).

    `slots` is shared memory from `make_shared_slots` (several processes) or None (this
    process alone); `slot` is this process's index in it.
    """

    def __init__(self, limit: int | None, slots=None, slot: int = 0,
                 on_reject: Callable[[], None] | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"max_num_queued_reqs must be at least 1, got {limit}")
        self.limit = limit
        self._slots = slots if slots is not None else [0]
        self._slot = slot
        self._on_reject = on_reject
        self.others = 0  # the core's unfinished requests that are not ours (see module doc)

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

    def admit(self, num_reqs: int) -> Ticket:
        """Admit `num_reqs` engine requests or raise a 503 APIError (nothing is counted)."""
        if self.limit is not None and self.num_unfinished() + num_reqs > self.limit:
            if self._on_reject is not None:
                self._on_reject()
            raise APIError(503, QUEUE_FULL_MESSAGE, err_type="Service Unavailable")
        self._add(num_reqs)
        return Ticket(self, num_reqs)

    def note_core_count(self, core_unfinished: int, ours_before: int, ours_after: int) -> None:
        """Update `others` from a core snapshot taken between two reads of our own count."""
        self.others = max(0, core_unfinished - max(ours_before, ours_after))

    async def refresh_loop(self, get_stats: Callable[[], Awaitable]) -> None:
        """Keep `others` fresh while the server runs (only needed when a limit is set)."""
        while True:
            try:
                before = self.num_ours()
                stats = await asyncio.wait_for(get_stats(), timeout=5.0)
                self.note_core_count(stats.num_running + stats.num_waiting, before,
                                     self.num_ours())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is slow or gone: keep the last value
                logger.debug("admission: stats refresh failed: %s", exc)
            await asyncio.sleep(STATS_REFRESH_SECONDS)
