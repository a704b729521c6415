"""The engine core's side of the live batch view (`tidal serve`'s page, `tidal top`): an
observer of the step loop that keeps the last steps as `StepRecord`s, and a logging handler
that keeps the last warnings. Both cost nothing until a frontend asks: steps are recorded only
for `ACTIVE_S` seconds after the last `StatsQuery` with `view_since` (then a reference to
each plan; the records are made, and the queue and the cache walked, at the query, a few
times a second, for the newest steps only).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from ..ipc.batch_view import MAX_STEPS_PER_VIEW, BatchView, StepRecord, StepRequest
from ..ipc.worker_messages import BatchPlan
from .core import EngineObserver
from .scheduler import Scheduler

ACTIVE_S = 5.0
"""Seconds after a view query during which steps are recorded (a page polls 4 times a
second; a closed page stops the recording within this)."""
KEPT_STEPS = 128
"""Steps kept between two queries (the ring's size: plans held by reference, a few MB at
most with 256 requests a step)."""
KEPT_WARNINGS = 20


class WarningTail(logging.Handler):
    """Keeps the message of the last `KEPT_WARNINGS` records at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: deque[str] = deque(maxlen=KEPT_WARNINGS)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            self.messages.append(f"{stamp} {record.getMessage()}")
        except Exception:  # a bad format string must not break the engine's logging
            self.handleError(record)


class BatchViewObserver(EngineObserver):
    """Records steps while a view is being watched; answers `view(since)`."""

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self.wall_clock = wall_clock
        self.scheduler: Scheduler | None = None
        self.steps: deque[tuple[BatchPlan, float, float, int]] = deque(maxlen=KEPT_STEPS)
        """(plan, its seconds at the workers, wall-clock time it ended, KV blocks held)."""
        self.warnings = WarningTail()
        self._watched_until = -1.0  # on the core's clock
        self._prompt_lens: dict[str, int] = {}
        """Prompt length of each request seen in a plan while watched (to tell a prefill
        chunk from a decode); cleared when the view is left alone."""

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def watched(self, now: float) -> bool:
        return now <= self._watched_until

    def step_ran(self, plan: BatchPlan, seconds: float, now: float) -> None:
        """Keep the plan itself (a reference: the StepRecord is made at the query, for the
        few steps a view sends), its time and the blocks held after it. Measured per step
        (benchmarks/batch_view_cost.py): well under a microsecond unwatched, a few watched."""
        if not self.watched(now):
            if self._prompt_lens:
                self._prompt_lens.clear()
            return
        prompt_lens = self._prompt_lens
        for req_id in plan.finished_req_ids:
            prompt_lens.pop(req_id, None)
        for new in plan.new_requests:
            prompt_lens[new.req_id] = new.prompt_len
        used = self.scheduler.kv_blocks_used() if self.scheduler is not None else 0
        self.steps.append((plan, seconds, self.wall_clock(), used))

    def _record(self, plan: BatchPlan, seconds: float, wall: float, used: int) -> StepRecord:
        prompt_lens = self._prompt_lens
        requests = [StepRequest(new.req_id, new.num_scheduled_tokens,
                                new.num_computed_tokens < new.prompt_len)
                    for new in plan.new_requests]
        for cached in plan.cached_requests:
            prompt_len = prompt_lens.get(cached.req_id)
            prefill = (cached.num_scheduled_tokens > 1 if prompt_len is None
                       else cached.num_computed_tokens < prompt_len)
            requests.append(StepRequest(cached.req_id, cached.num_scheduled_tokens, prefill))
        return StepRecord(plan.step_id, wall, seconds, plan.total_num_scheduled_tokens,
                          requests, list(plan.preempted_req_ids), used)

    def view(self, since: int, now: float) -> BatchView | None:
        """The steps after step id `since` (the newest `MAX_STEPS_PER_VIEW`) and the state
        now; keeps recording for `ACTIVE_S` more seconds."""
        self._watched_until = now + ACTIVE_S
        if self.scheduler is None:
            return None
        newer = [step for step in self.steps if step[0].step_id > since]
        skipped = max(0, len(newer) - MAX_STEPS_PER_VIEW)
        if since > 0 and self.steps and self.steps[0][0].step_id > since + 1:
            skipped += self.steps[0][0].step_id - since - 1  # fell out of the ring meanwhile
        records = [self._record(*step) for step in newer[-MAX_STEPS_PER_VIEW:]]
        return self.scheduler.batch_view(records, skipped, list(self.warnings.messages))
