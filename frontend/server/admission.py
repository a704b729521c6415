"""Admission control for `--max-num-queued-reqs`, `--max-num-queued-tokens` and
`--max-queue-delay`: reject with 503 before any work starts.

Two counts, each the whole server's, with any number of HTTP server processes:

    unfinished requests = sum(request slots) + others
    queued prompt tokens = sum(token slots) + other_tokens

- The slots are two integers per HTTP server process of this `tidal serve`, in shared memory
  (a `multiprocessing.RawArray` made by the parent before it starts the servers). Each process
  writes only its own slots and reads all of them, so the sums are exact and immediate,
  without locks. A request counts from the moment it is admitted until its response is over
  (finished, failed or aborted), which covers its whole life in the engine core; a request
  with n completions counts n, as the engine core runs n requests for it. Its prompt tokens
  (n times, likewise) count until each completion's first token comes back: from then on
  it decodes and its prompt no longer delays anyone's first token (vLLM's rule; a prefix-
  cache hit is not subtracted, as the frontend cannot know it).
- `others` / `other_tokens` are the engine core's counts that are not ours: requests of other
  frontends attached to the same daemon (a Python `LLM`, another `tidal serve --engine`).
  They come from `AsyncLLM.get_stats()`, refreshed in the background (`refresh_loop`), as
  max(0, core_count - our_count_at_that_moment). Since each of our requests counts from before
  it reaches the core until after the core stops counting it, that difference is 0 when we
  are the only frontend: stale snapshots never make us reject our own traffic wrongly.

The token limit admits a request whose prompt alone is over it when no prompt tokens are
queued (else a long prompt would get a 503 however often it is retried); vLLM admits while
the queued tokens are under the limit, whatever the new prompt's size.

`--max-queue-delay`: the engine core estimates the wait from the work it has queued
(`engine_core/advice/queue_estimate.py`, through the step cost model) and reports it in each
stats snapshot; here the new request's own prompt is added, and what this process admitted since
the snapshot's query was sent (other processes' admissions show in the next snapshot):

    wait = waited + max(0, est_queue_delay_s - age of the snapshot)
           + (prompt + admitted since) tokens * est_s_per_prompt_token
           + (admitted since) requests * est_s_per_queued_request + margin

`waited` is the time since the request reached this process: under a burst requests wait
here too (up to 3.2 s of a 1 s limit at 300 requests at once,
benchmarks/archive/BENCHMARKS.md: for their turn
in the tokenizer pool, and for CPU the workers share), and the client's time to first token
counts it. Before
its prompt is tokenized, a request is checked once with its own prompt left out (`check_wait`,
a lower bound of the final estimate): one that cannot make it anyway is answered at once
instead of after its turn in the tokenizer, and costs no tokenizing.

`est_queue_delay_s` is the core's figure when the snapshot came back; the queue it counts
drains at a second per second, so what has passed since is taken off it (down to 0): the
snapshot is refreshed every `DELAY_REFRESH_SECONDS`, and without this every estimate was up
to that much high just after a refresh.

The estimate is then checked against what happens: each admitted request's actual wait for
its first token here (arrival to the first token reaching this process) is compared with its
estimate, and the 90th percentile of how far the last `ERROR_WINDOW` ran over their
estimates (never below 0) is added before comparing with the limit. What the model cannot
see lands there: CPU the HTTP processes and the client take from the workers on shared cores,
whole steps, snapshots a few hundred ms old. The issue asks that accepted requests meet the
limit at p90: this margin is that p90 of the error, measured on the live server.

Above the limit the answer is 503 with `Retry-After: ceil(wait - limit)` (at least 1 s): the
queue drains about a second of work per second. The 503s of the two count limits carry a
Retry-After too: `RETRY_AFTER_S` for `--max-num-queued-reqs` (when a running request ends
cannot be known here), and for `--max-num-queued-tokens` the time the core's estimate gives
the excess tokens to drain (`s per prompt token`, known under --max-queue-delay), else
`RETRY_AFTER_S`.

Check and increment run in one synchronous step on the event loop, so within a process there
is no race; across processes two requests admitted in the same microsecond may both pass (the
same lock-free trade-off vLLM's admission_control.py makes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import time
from collections import deque
from typing import Awaitable, Callable

from .errors import QUEUE_FULL_MESSAGE, RETRY_AFTER_S, TOKENS_FULL_MESSAGE, APIError

logger = logging.getLogger("tidal.serve")

STATS_REFRESH_SECONDS = 0.5
"""How often each server process refreshes the core's count of other frontends' requests."""
DELAY_REFRESH_SECONDS = 0.05
"""How long it waits after each answer before asking for the core's queue estimate again under
--max-queue-delay. The core answers between steps, so under load this is one snapshot a step.
At 0.25 s a 150 req/s burst's first half second was priced with the snapshot from before it
(benchmarks/archive/BENCHMARKS.md, admission, fifth round)."""
ERROR_WINDOW = 100
"""How many of the last admitted requests' (actual - estimated) waits the margin is taken
from; fewer than `ERROR_MIN_SAMPLES` give no margin."""
ERROR_MIN_SAMPLES = 10


def make_shared_slots(num_servers: int):
    """Two int64 slots per HTTP server process (requests, then prompt tokens), in shared
    memory (pass to each child)."""
    return multiprocessing.RawArray("q", 2 * num_servers)


class Ticket:
    """An admitted request's share of the counts; `prefill_done()` as each completion's first
    token arrives, `release()` once it is over (idempotent)."""

    __slots__ = ("_controller", "num_reqs", "num_tokens", "_estimate")

    def __init__(self, controller: "AdmissionController", num_reqs: int, num_tokens: int,
                 estimate: tuple[float, float] | None = None):
        self._controller = controller
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        """Prompt tokens still counted as queued."""
        self._estimate = estimate
        """(arrival, estimated wait) in monotonic seconds under --max-queue-delay, until the
        first token is seen."""

    def prefill_done(self, num_tokens: int) -> None:
        """One completion produced its first token: its `num_tokens` prompt tokens are no
        longer queued (and, the first time, the estimate of its wait is checked)."""
        if self._estimate is not None and self._controller is not None:
            arrival, estimate = self._estimate
            self._controller.note_first_token(time.monotonic() - arrival, estimate)
            self._estimate = None
        num_tokens = min(num_tokens, self.num_tokens)
        if self._controller is not None and num_tokens > 0:
            self._controller._add(0, -num_tokens)
            self.num_tokens -= num_tokens

    def release(self) -> None:
        if self._controller is not None:
            self._controller._add(-self.num_reqs, -self.num_tokens)
            self._controller = None
            self.num_tokens = 0


class AdmissionController:
    """Counts unfinished requests and their queued prompt tokens; enforces `limit`,
    `token_limit` and `max_queue_delay` (seconds; None = off, never rejects).

    `slots` is shared memory from `make_shared_slots` (several processes) or None (this
    process alone); `slot` is this process's index among the processes. `on_reject(reason)`
    is called for each 503 (max_num_queued_reqs, max_num_queued_tokens or max_queue_delay).
    """

    def __init__(self, limit: int | None, slots=None, slot: int = 0,
                 on_reject: Callable[[str], None] | None = None,
                 token_limit: int | None = None, max_queue_delay: float | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"max_num_queued_reqs must be at least 1, got {limit}")
        if token_limit is not None and token_limit < 1:
            raise ValueError(f"max_num_queued_tokens must be at least 1, got {token_limit}")
        if max_queue_delay is not None and not max_queue_delay > 0:
            raise ValueError(f"max_queue_delay must be positive, got {max_queue_delay}")
        self.limit = limit
        self.token_limit = token_limit
        self.max_queue_delay = max_queue_delay
        self._slots = slots if slots is not None else [0, 0]
        self._num_servers = len(self._slots) // 2
        self._slot = slot
        self._on_reject = on_reject
        self.others = 0  # the core's unfinished requests that are not ours (see module doc)
        self.other_tokens = 0  # the core's queued prompt tokens that are not ours
        self._estimate = (0.0, 0.0, 0.0)
        """The core's (queue delay s, s per prompt token, s per queued request)."""
        self._admitted = [0, 0]
        """Prompt tokens and requests this process ever admitted."""
        self._mark = (0, 0)
        """`_admitted` when the query of the snapshot in `_estimate` was sent."""
        self._estimate_at = 0.0
        """time.monotonic() when the snapshot in `_estimate` came back."""
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        """Actual minus estimated wait of the last admitted requests (seconds)."""

    @property
    def limited(self) -> bool:
        """Whether any limit is set (then `refresh_loop` should run)."""
        return (self.limit is not None or self.token_limit is not None
                or self.max_queue_delay is not None)

    def _add(self, num_reqs: int, num_tokens: int) -> None:
        self._slots[self._slot] += num_reqs
        self._slots[self._num_servers + self._slot] += num_tokens

    def num_local(self) -> int:
        """Unfinished requests admitted by this process."""
        return int(self._slots[self._slot])

    def num_ours(self) -> int:
        """Unfinished requests admitted by every HTTP server process of this server."""
        return int(sum(self._slots[:self._num_servers]))

    def num_our_tokens(self) -> int:
        """Queued prompt tokens of the requests every HTTP server process admitted."""
        return int(sum(self._slots[self._num_servers:]))

    def num_unfinished(self) -> int:
        """The whole server's estimate: ours (exact) plus other frontends' (from the core)."""
        return self.num_ours() + self.others

    def num_queued_tokens(self) -> int:
        """The whole server's queued prompt tokens: ours plus other frontends'."""
        return self.num_our_tokens() + self.other_tokens

    def estimated_wait(self, num_prompt_tokens: int, waited_s: float = 0.0,
                       now: float | None = None) -> float:
        """Seconds a new request with this many prompt tokens, which reached this process
        `waited_s` ago, would wait for its first token, counted from its arrival (see the
        module docstring; only `waited_s` before the first snapshot). `now`: monotonic
        seconds (default: the clock)."""
        delay, per_token, per_request = self._estimate
        now = time.monotonic() if now is None else now
        drained = max(0.0, delay - max(0.0, now - self._estimate_at))
        tokens = self._admitted[0] - self._mark[0] + num_prompt_tokens
        return (waited_s + drained + tokens * per_token
                + (self._admitted[1] - self._mark[1]) * per_request)

    def note_first_token(self, actual_s: float, estimated_s: float) -> None:
        """An admitted request's first token came `actual_s` after its arrival; it had been
        estimated at `estimated_s`."""
        self._errors.append(actual_s - estimated_s)

    def margin(self) -> float:
        """Seconds added to every estimate: the 90th percentile of the recent errors, never
        below 0 (0 with fewer than ERROR_MIN_SAMPLES)."""
        if len(self._errors) < ERROR_MIN_SAMPLES:
            return 0.0
        ordered = sorted(self._errors)
        return max(0.0, ordered[int(0.9 * (len(ordered) - 1))])

    def check_wait(self, num_tokens: int = 0, waited_s: float = 0.0) -> float:
        """Raise the `max_queue_delay` 503 (with Retry-After) if the estimated wait plus the
        margin exceeds the limit; else the estimate (0 without the limit). Called with
        `num_tokens` 0 before a prompt is tokenized (see the module docstring)."""
        if self.max_queue_delay is None:
            return 0.0
        estimate = self.estimated_wait(num_tokens, waited_s)
        wait = estimate + self.margin()
        if wait > self.max_queue_delay:
            retry = max(1, math.ceil(wait - self.max_queue_delay))
            self._reject("max_queue_delay",
                         f"The engine is busy: a new request would wait about {wait:.1f} s "
                         f"for its first token, more than the server's limit of "
                         f"{self.max_queue_delay:g} s. Please retry after {retry} s or on "
                         "a different instance.", {"Retry-After": str(retry)})
        return estimate

    def admit(self, num_reqs: int, num_tokens: int = 0, waited_s: float = 0.0) -> Ticket:
        """Admit `num_reqs` engine requests holding `num_tokens` prompt tokens in all, which
        reached this process `waited_s` ago, or raise a 503 APIError (nothing is counted)."""
        if self.limit is not None and self.num_unfinished() + num_reqs > self.limit:
            self._reject("max_num_queued_reqs", QUEUE_FULL_MESSAGE, _retry_after(RETRY_AFTER_S))
        if self.token_limit is not None:
            queued = self.num_queued_tokens()
            if queued and queued + num_tokens > self.token_limit:
                self._reject("max_num_queued_tokens", TOKENS_FULL_MESSAGE, _retry_after(
                    self._drain_seconds(queued + num_tokens - self.token_limit)))
        estimate = self.check_wait(num_tokens, waited_s)
        self._add(num_reqs, num_tokens)
        self._admitted[0] += num_tokens
        self._admitted[1] += num_reqs
        checked = ((time.monotonic() - waited_s, estimate) if self.max_queue_delay is not None
                   else None)
        return Ticket(self, num_reqs, num_tokens, checked)

    def _drain_seconds(self, num_tokens: int) -> float:
        """Seconds the core needs to prefill `num_tokens` more, by its estimate (known under
        --max-queue-delay); RETRY_AFTER_S without one."""
        per_token = self._estimate[1]
        return num_tokens * per_token if per_token > 0 else RETRY_AFTER_S

    def _reject(self, reason: str, message: str, headers: dict[str, str] | None = None):
        if self._on_reject is not None:
            self._on_reject(reason)
        raise APIError(503, message, err_type="Service Unavailable", headers=headers)

    def note_core_count(self, core_unfinished: int, ours_before: int, ours_after: int,
                        core_tokens: int = 0, our_tokens_before: int = 0,
                        our_tokens_after: int = 0) -> None:
        """Update `others` and `other_tokens` from a core snapshot taken between two reads
        of our own counts."""
        self.others = max(0, core_unfinished - max(ours_before, ours_after))
        self.other_tokens = max(0, core_tokens - max(our_tokens_before, our_tokens_after))

    def note_core_estimate(self, stats, mark: tuple[int, int],
                           now: float | None = None) -> None:
        """Take the core's queue estimate from a snapshot whose query was sent when
        `_admitted` was `mark` and which came back at `now` (monotonic; default: the
        clock)."""
        self._estimate = (stats.est_queue_delay_s, stats.est_s_per_prompt_token,
                          stats.est_s_per_queued_request)
        self._mark = mark
        self._estimate_at = time.monotonic() if now is None else now

    async def refresh_loop(self, get_stats: Callable[[], Awaitable]) -> None:
        """Keep `others`, `other_tokens` and the queue estimate fresh while the server runs
        (only needed when a limit is set)."""
        interval = (DELAY_REFRESH_SECONDS if self.max_queue_delay is not None
                    else STATS_REFRESH_SECONDS)
        while True:
            try:
                before, tokens_before = self.num_ours(), self.num_our_tokens()
                mark = (self._admitted[0], self._admitted[1])
                stats = await asyncio.wait_for(get_stats(), timeout=5.0)
                self.note_core_count(stats.num_running + stats.num_waiting, before,
                                     self.num_ours(), stats.queued_prompt_tokens,
                                     tokens_before, self.num_our_tokens())
                self.note_core_estimate(stats, mark)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is slow or gone: keep the last value
                logger.debug("admission: stats refresh failed: %s", exc)
            await asyncio.sleep(interval)


def _retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header of a 503: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
