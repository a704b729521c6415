"""What the live page costs the engine core's step loop (issue 37): the time the batch view's
observer adds to one step, watched and unwatched, for plans of 1-256 requests, against the
step times of the same sizes (measured on SmolLM2 elsewhere: docs/performance.md).

    python benchmarks/batch_view_cost.py

A plan of N requests: N-1 decodes and one 512-token prefill chunk, as the scheduler sends it.
The query side (a snapshot: the queue walked, the prefix cache's free blocks counted) runs
four times a second per HTTP process, not per step; its time is printed too.
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, "tests/engine_core")

from sched_utils import make_request, make_scheduler  # noqa: E402

from tidal.engine_core.batch_view import BatchViewObserver  # noqa: E402
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData


def plan(step_id: int, n: int) -> BatchPlan:
    cached = [CachedRequestData(f"r{i}", [], 100 + step_id, 1) for i in range(n - 1)]
    new = [NewRequestData(f"p{step_id}", b"", 2048, [1, 2, 3], 0, 512, None)]
    return BatchPlan(step_id, new, cached, total_num_scheduled_tokens=n - 1 + 512)


def per_step_us(observer: BatchViewObserver, n: int, repeat: int = 2000) -> float:
    plans = [plan(i, n) for i in range(repeat)]
    start = time.perf_counter()
    for p in plans:
        observer.step_ran(p, 0.01, 0.0)
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    sched = make_scheduler(num_blocks=20_000, policy="priority")
    for i in range(500):
        sched.add(make_request(f"w{i}", 100, priority=i % 3))
    print(f"{'requests/step':>14} {'unwatched µs':>13} {'watched µs':>11}")
    for n in (1, 8, 32, 128, 256):
        idle = BatchViewObserver()
        idle.attach(sched)
        watched = BatchViewObserver()
        watched.attach(sched)
        watched.view(0, -1e9)  # watched from the start of time ...
        watched._watched_until = float("inf")  # ... for good
        print(f"{n:>14} {per_step_us(idle, n):>13.2f} {per_step_us(watched, n):>11.2f}")
    view = BatchViewObserver()
    view.attach(sched)
    start = time.perf_counter()
    for _ in range(100):
        view.view(0, 0.0)
    print(f"one snapshot with 500 waiting requests: "
          f"{(time.perf_counter() - start) / 100 * 1e6:.0f} µs (4 a second while watched)")


if __name__ == "__main__":
    main()
