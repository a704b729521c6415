"""The engine core's step loop, apart from every socket, signal and clock: a scheduler, an
executor and the plans in flight between them.

    core = EngineCore(scheduler, executor, depth)
    outputs = core.step(timeout)     # client_id -> outputs; None: the oldest plan is not back

`depth` is how many plans may be in flight at once: 1 runs schedule → run → update in turn;
2 (async scheduling) plans step N+1 while the workers run step N; a pipeline of P stages
takes P (P + 1 with async scheduling), so every stage has a plan to run while the others run
theirs. Plans leave the deque in the order they entered it, which is the order the workers
answer them.

The daemon (`daemon.py`) owns the IO around it: frontends, signals, heartbeats, worker
healing (`drop_in_flight` and a fresh executor) and the progress log.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from tidal.engine_core.scheduler import Outputs, Scheduler
from tidal.ipc.messages import BatchPlan, SampledTokens


class Executor(Protocol):
    """What the core needs from whatever runs the plans (worker processes, Ray actors, a
    fake in a unit test). Plans are answered in the order they were submitted."""

    def submit(self, plan: BatchPlan) -> None:
        """Send `plan` to every worker; return at once."""

    def collect(self, timeout: float | None = None) -> SampledTokens | None:
        """The oldest submitted plan's tokens, or None when not back within `timeout` s.
        Raises WorkerError when a worker died, failed or hung."""

    def check_alive(self) -> None:
        """Raise WorkerError when a worker is gone."""

    def wait_fds(self) -> list[int]:
        """File descriptors that become readable when a worker exits (for an idle poll)."""

    def shutdown(self) -> None:
        """Stop every worker politely; idempotent."""

    def kill(self) -> None:
        """Stop every worker at once (after a failure); idempotent."""


class EngineCore:
    """Schedules, submits and collects plans, up to `depth` of them in flight."""

    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.in_flight: deque[BatchPlan] = deque()  # submitted, not yet updated; oldest first
        self.stalled = False
        """The last step had nothing to run and nothing in flight (every waiting request
        lacks blocks, say): the caller should wait for news rather than spin."""

    def has_work(self) -> bool:
        """Plans in flight or unfinished requests: `step()` has something to do."""
        return bool(self.in_flight) or self.scheduler.has_unfinished_requests()

    def step(self, timeout: float | None = None) -> Outputs | None:
        """Schedule one plan if the pipeline has room; while it still has room return at
        once (fill it first); else collect the oldest plan's tokens and update the scheduler.

        Returns the outputs per client ({} when nothing came back yet), or None when the
        oldest plan's tokens did not arrive within `timeout` s (call again: nothing is lost).
        """
        self.stalled = False
        if len(self.in_flight) < self.depth and self.scheduler.has_unfinished_requests():
            plan = self.scheduler.schedule()
            if has_work(plan):
                self.executor.submit(plan)
                self.in_flight.append(plan)
                if len(self.in_flight) < self.depth:
                    return {}  # room for another plan before waiting on a result
            else:  # nothing runnable now: wait for the plans in flight, if any
                self.stalled = not self.in_flight
        if not self.in_flight:
            return {}
        sampled = self.executor.collect(timeout)
        if sampled is None:
            return None
        return self.scheduler.update(self.in_flight.popleft(), sampled)

    def replace_executor(self, executor: Executor) -> None:
        """Run plans on `executor` from now on (healing: the old one's workers are gone and
        `drop_in_flight` forgot their plans)."""
        self.executor = executor

    def drop_in_flight(self) -> None:
        """Forget every plan in flight (their workers are gone; `Scheduler.recompute_all`
        recomputes what they would have produced)."""
        self.in_flight.clear()


def has_work(plan: BatchPlan) -> bool:
    """A plan the workers must see: tokens to compute, or requests to drop from their batch."""
    return bool(plan.new_requests or plan.cached_requests or plan.finished_req_ids
                or plan.preempted_req_ids)
