"""An in-process executor for unit tests of `EngineCore`: the scheduler tests' `FakeWorker`
behind the `Executor` protocol, on a virtual clock.

Each plan runs through `num_stages` pipeline stages, `stage_latency` virtual seconds each; a
stage takes the next plan when it is free and the plan has left the stage before. `collect`
moves the clock to when the oldest plan leaves the last stage (the core itself takes no
time). `busy[s]` records the (start, end) of every plan on stage s, so a test can read how
much of the run each stage spent working.
"""

from __future__ import annotations

from collections import deque

from sched_utils import FakeWorker
from tidal.ipc.worker_messages import BatchPlan, SampledTokens


class FakeExecutor:
    def __init__(self, worker: FakeWorker, num_stages: int = 1,
                 stage_latency: float = 1.0) -> None:
        self.worker = worker
        self.stage_latency = stage_latency
        self.now = 0.0
        self.stage_free_at = [0.0] * num_stages
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
        self.pending: deque[tuple[float, SampledTokens]] = deque()  # (done at, tokens)
        self.max_pending = 0  # most plans ever in flight at once

    def submit(self, plan: BatchPlan) -> None:
        sampled = self.worker.execute(plan)  # in order, as the real stages run plans
        t = self.now
        for stage, free_at in enumerate(self.stage_free_at):
            start = max(t, free_at)
            t = start + self.stage_latency
            self.stage_free_at[stage] = t
            self.busy[stage].append((start, t))
        self.pending.append((t, sampled))
        self.max_pending = max(self.max_pending, len(self.pending))

    def collect(self, timeout: float | None = None) -> SampledTokens | None:
        done_at, sampled = self.pending.popleft()
        self.now = max(self.now, done_at)
        return sampled

    def utilization(self, stage: int) -> float:
        """The share of the run (first start to last end on any stage) stage `stage` worked."""
        start = min(b[0][0] for b in self.busy if b)
        end = max(b[-1][1] for b in self.busy if b)
        return sum(e - s for s, e in self.busy[stage]) / (end - start)

    def check_alive(self) -> None:
        pass

    def wait_fds(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    def kill(self) -> None:
        pass
