"""Heartbeats between a side that beats and a peer that echoes every beat: a frontend and its
engine core, the data-parallel router and each of its cores. The echoes tell the beating
side how long the peer has been silent; past the peer's --frontend-timeout it is stopped or
hung. No IO: the caller sends the beats and reports what it heard.
"""

from __future__ import annotations

import time


class HeartbeatClock:
    """The heartbeats one side sends every `interval` seconds to a peer that echoes each one
    (an engine core, the `-dp` router), and what came back: how long the peer has been
    silent. Silence is judged only while this side keeps beating: after a stall of its own
    (missed beats: its loop was held up) the clock starts again, since the peer had nothing
    to echo. Shared by `AsyncEngineClient`, `CoreLiveness` and the router's cores."""

    def __init__(self, interval: float, now: float | None = None):
        self.interval = interval
        self.last_heard = self.last_beat = time.monotonic() if now is None else now

    def heard(self, now: float) -> None:
        """A frame came from the peer."""
        self.last_heard = now

    def beat_due(self, now: float) -> bool:
        return now - self.last_beat >= self.interval

    def beat(self, now: float) -> None:
        """A heartbeat goes out now."""
        if stalled_since_last_beat(now, self.last_beat, self.interval):
            self.last_heard = now  # we went quiet ourselves: nothing was there to echo
        self.last_beat = now

    def silent_for(self, now: float) -> float:
        """Seconds since the peer's last frame (or since this side's last stall)."""
        return now - self.last_heard


def stalled_since_last_beat(now: float, last_beat: float, interval: float) -> bool:
    """Whether this side missed beats (its loop was held up) since `last_beat`: then the
    core had nothing to echo, and its silence so far says nothing about it."""
    return now - last_beat > 2 * interval + 0.5
