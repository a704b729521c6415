"""Restart limits count a window, not a lifetime: at most `limit` restarts within any
10 minutes, so a server that runs for weeks survives rare faults while a fault that repeats
still ends in a final failure."""

import pytest

from tidal.engine_core.restart_budget import RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limit_within_the_window_then_old_restarts_stop_counting():
    clock = Clock()
    budget = RestartBudget(2, window_s=600, clock=clock)
    assert budget.spend() and budget.describe() == "restart 1 of at most 2 in 10 min"
    clock.now += 300
    assert budget.spend() and budget.recent() == 2
    clock.now += 299
    assert not budget.spend()  # a third within 10 minutes of the first: final
    assert budget.total == 2 and budget.recent() == 2
    clock.now += 2  # the first is now 601 s old
    assert budget.spend() and budget.total == 3 and budget.recent() == 2


def test_zero_allows_no_restart_and_a_negative_limit_is_refused():
    assert not RestartBudget(0).spend()
    with pytest.raises(ValueError, match=">= 0"):
        RestartBudget(-1)
