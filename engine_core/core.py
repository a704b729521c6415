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

Whatever watches the loop without steering it is an `EngineObserver`, the one interface the
core offers: told each request added, each preemption, each plan's time at the workers, each
stats snapshot going out (to add to it) and each turn of the daemon's loop, on the core's
clock (injected: a test's is virtual). The advisory wing's queue estimate and preemption
advisor are observers (`advice/observers.py`, which the daemon calls once to build them); the
core knows none of them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from .request import Request
from .scheduler import Outputs, Scheduler
from ..ipc.frontend_messages import SchedulerStats
from ..ipc.worker_messages import BatchPlan, SampledTokens

if TYPE_CHECKING:
    import zmq

    from .config import EngineConfig
    from .executor import MultiprocExecutor


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


class EngineObserver(Protocol):
    """Told what the step loop does; nothing it says goes back into the loop. Every event
    carries the core's clock. Subclass it and override what you need: the rest are no-ops."""

    def attach(self, scheduler: Scheduler) -> None:
        """The loop starts over `scheduler` (its KV blocks known: the workers are up)."""

    def request_added(self, request: Request, now: float) -> None:
        """The scheduler took `request`."""

    def preempted(self, num_requests: int, now: float) -> None:
        """Planning a step preempted `num_requests` running requests."""

    def step_ran(self, plan: BatchPlan, seconds: float, now: float) -> None:
        """`plan`'s tokens arrived, `seconds` after the later of its submission and the
        previous plan's tokens (its own time at the workers, when several are in flight).
        Not told of a plan that only drops requests or polls grammars."""

    def stats(self, stats: SchedulerStats, now: float) -> None:
        """A stats snapshot is going out: fill in what this observer estimates."""

    def tick(self, now: float) -> None:
        """The daemon's loop went round (about once a second at least, idle or not)."""

    def close(self) -> None:
        """The engine core is stopping: end whatever this observer started."""


def make_executor(config: EngineConfig, max_model_len: int, ctx: zmq.Context | None = None,
                  **options) -> MultiprocExecutor:
    """The executor `config.parallel.distributed_executor_backend` names, not yet started:
    `MultiprocExecutor` (mp, `executor.py`) or `RayExecutor` (ray, `ray_executor.py`, a
    subclass; imported only then, so ray stays optional). `options` are MultiprocExecutor's
    keyword arguments. It lives here, beside the protocol, so that neither executor module
    imports the other's."""
    if config.parallel.distributed_executor_backend == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(config, max_model_len, ctx, **options)
    from .executor import MultiprocExecutor

    return MultiprocExecutor(config, max_model_len, ctx, **options)


class EngineCore:
    """Schedules, submits and collects plans, up to `depth` of them in flight."""

    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int,
                 observers: Sequence[EngineObserver] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.in_flight: deque[BatchPlan] = deque()  # submitted, not yet updated; oldest first
        self.observers = list(observers)
        self.clock = clock
        for observer in self.observers:
            observer.attach(scheduler)
        self._submitted: deque[float] = deque()  # clock() at each in-flight plan's submit
        self._last_collected = float("-inf")
        self.stalled = False
        """The last step had nothing to run and nothing in flight (every waiting request
        lacks blocks, say): the caller should wait for news rather than spin."""

    def add(self, request: Request) -> None:
        """Queue `request` (the scheduler's checks may raise ValueError: then nobody is
        told)."""
        self.scheduler.add(request)
        if self.observers:
            now = self.clock()
            for observer in self.observers:
                observer.request_added(request, now)

    def stats(self) -> SchedulerStats:
        """The scheduler's snapshot, with what the observers estimate."""
        stats = self.scheduler.stats()
        if self.observers:
            now = self.clock()
            for observer in self.observers:
                observer.stats(stats, now)
        return stats

    def tick(self) -> None:
        """Tell the observers the daemon's loop went round."""
        if self.observers:
            now = self.clock()
            for observer in self.observers:
                observer.tick(now)

    def close(self) -> None:
        """Tell the observers the core is stopping."""
        for observer in self.observers:
            observer.close()

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
            num_preemptions = self.scheduler.num_preemptions
            plan = self.scheduler.schedule()
            if self.observers and self.scheduler.num_preemptions > num_preemptions:
                now = self.clock()
                for observer in self.observers:
                    observer.preempted(self.scheduler.num_preemptions - num_preemptions, now)
            if has_work(plan):
                self.executor.submit(plan)
                self.in_flight.append(plan)
                self._submitted.append(self.clock())
                if len(self.in_flight) < self.depth:
                    return {}  # room for another plan before waiting on a result
            else:  # nothing runnable now: wait for the plans in flight, if any
                self.stalled = not self.in_flight
        if not self.in_flight:
            return {}
        sampled = self.executor.collect(timeout)
        if sampled is None:
            return None
        plan = self.in_flight.popleft()
        now = self.clock()
        submitted = self._submitted.popleft()
        if plan.total_num_scheduled_tokens:  # not a plan that only drops or polls
            seconds = now - max(submitted, self._last_collected)
            self.scheduler.step_ran(plan, seconds)  # speculation's measured step costs
            for observer in self.observers:
                observer.step_ran(plan, seconds, now)
        self._last_collected = now
        return self.scheduler.update(plan, sampled)

    def replace_executor(self, executor: Executor) -> None:
        """Run plans on `executor` from now on (healing: the old one's workers are gone and
        `drop_in_flight` forgot their plans)."""
        self.executor = executor

    def drop_in_flight(self) -> None:
        """Forget every plan in flight (their workers are gone; `Scheduler.recompute_all`
        recomputes what they would have produced)."""
        self.in_flight.clear()
        self._submitted.clear()


def has_work(plan: BatchPlan) -> bool:
    """A plan the workers must see: tokens to compute, requests to drop from their batch,
    grammars to compile, or requests waiting for a compile (the plan is the poll)."""
    return bool(plan.new_requests or plan.cached_requests or plan.finished_req_ids
                or plan.preempted_req_ids or plan.grammars or plan.awaits_grammars)
