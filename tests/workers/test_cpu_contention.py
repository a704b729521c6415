"""Issue 38 item 3 (the warning part): a worker says in its log when its steps slow down
because other processes take its cores (run-queue wait from /proc/self/task/*/schedstat)."""

import logging

from tidal.workers.cpu_contention import WINDOW_S, CpuContention, runqueue_wait_s


def test_this_process_wait_is_readable():
    wait = runqueue_wait_s()
    assert wait is None or wait >= 0.0  # None only where Linux keeps no schedstat


def test_it_warns_once_when_threads_wait_for_cpus(caplog):
    waits = iter([0.0, 2.0, 2.0 + 0.9 * 2 * WINDOW_S, 100.0, 200.0])
    clock = iter([0.0, 1.0, 2.0])
    monitor = CpuContention(rank=0, threads=2, read_wait=lambda: next(waits),
                            clock=lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger="tidal.workers.cpu_contention"):
        monitor.step(WINDOW_S / 2)
        monitor.step(WINDOW_S / 2)  # window 1: 2 s of waiting over 2 x 10 s: 10%, quiet
        assert monitor.last_share == 0.1 and not caplog.records
        monitor.step(WINDOW_S)  # window 2: 90% of the threads' time spent waiting
        assert monitor.last_share == 0.9
        monitor.step(WINDOW_S)  # again, but within REPEAT_S: no second warning
    (record,) = caplog.records
    assert "steps are slowed by other processes on these cores" in record.getMessage()
    assert "waited for a CPU 90% of their step time" in record.getMessage()
    assert "OMP_WAIT_POLICY=PASSIVE" in record.getMessage()


def test_nothing_where_linux_keeps_no_schedstat():
    monitor = CpuContention(rank=0, threads=2, read_wait=lambda: None)
    monitor.step(2 * WINDOW_S)
    assert monitor.last_share is None
