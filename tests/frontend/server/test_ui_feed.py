"""The live page's feed in one HTTP process (frontend/server/ui.py's ViewFeed), on a fake
engine: it polls only while someone watches, a viewer that never reads holds at most
VIEWER_QUEUE snapshots, and the MAX_VIEWERS+1st stream is refused with 503."""

import asyncio

import pytest

from tidal.frontend.server import ui
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.metrics import RecentLatencies
from tidal.ipc.batch_view import BatchView, StepRecord
from tidal.ipc.frontend_messages import SchedulerStats


class Engine:
    def __init__(self):
        self.queries = []
        self.step = 0

    async def get_stats(self, view_since=-1):
        self.queries.append(view_since)
        self.step += 3
        steps = [StepRecord(i, 0.0, 0.01, 1, []) for i in range(view_since + 1, self.step + 1)]
        return SchedulerStats(num_steps=self.step, view=BatchView(steps, 0, 8, 64, 100))


def test_polls_only_while_watched_and_bounds_every_viewer(monkeypatch):
    monkeypatch.setattr(ui, "POLL_S", 0.01)

    async def run():
        engine = Engine()
        feed = ui.ViewFeed(engine, RecentLatencies(), "m")
        stalled = feed.subscribe()
        reader = feed.subscribe()
        got = [await reader.get() for _ in range(20)]
        assert stalled.qsize() == ui.VIEWER_QUEUE  # never read: the oldest were dropped
        assert engine.queries[0] == 0 and engine.queries[1:] == sorted(engine.queries[1:])
        assert all(b"data: " in g for g in got)
        feed.unsubscribe(stalled)
        feed.unsubscribe(reader)
        await asyncio.sleep(0.05)
        polled = len(engine.queries)
        await asyncio.sleep(0.05)
        assert len(engine.queries) == polled  # nobody watches: no more queries

    asyncio.run(run())


def test_too_many_viewers_get_503():
    async def run():
        feed = ui.ViewFeed(Engine(), RecentLatencies(), "m")
        queues = [feed.subscribe() for _ in range(ui.MAX_VIEWERS)]
        with pytest.raises(APIError) as refused:
            feed.subscribe()
        assert refused.value.status == 503
        for q in queues:
            feed.unsubscribe(q)
        feed.subscribe()  # room again

    asyncio.run(run())


def test_latency_percentiles_over_the_last_minute():
    now = [1000.0]
    recent = RecentLatencies(clock=lambda: now[0])
    recent.add(5.0, [1.0])
    now[0] += 120  # out of the window
    for i in range(1, 11):
        recent.add(i / 10, [i / 100, i / 100])
    p = recent.percentiles()
    assert p["ttft"]["n"] == 10 and p["ttft"]["p50"] == pytest.approx(0.6)
    assert p["itl"]["n"] == 20 and p["itl"]["p90"] == pytest.approx(0.10)
