"""Stop signals (engine_core/stop_signals.py): while entered, SIGTERM / SIGINT only record a
reason and wake a poll; the previous handlers come back on exit."""

from __future__ import annotations

import os
import select
import signal

from tidal.engine_core.stop_signals import StopSignals


def test_a_signal_records_its_name_wakes_a_poll_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    with signals:
        assert not signals.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert select.select([signals.fd], [], [], 2.0)[0] == [signals.fd]
        signals.clear()
        assert select.select([signals.fd], [], [], 0)[0] == []
        os.kill(os.getpid(), signal.SIGINT)  # the first reason stays
    assert signals.requested() and signals.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
