"""The supervisor, as a specification: the one restart rule of every process tidal keeps running
(engine_core/supervisor.py). Children are small `python -c` processes; the restart window runs
on a fake clock where time matters."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tidal.engine_core.supervisor import ChildProcess, Supervisor

SUPERVISOR_LOG = "tidal.engine_core.supervisor"


def script(code: str) -> list[str]:
    return ["-c", textwrap.dedent(code)]


DIES = script("""
    import sys
    print("loading the model", file=sys.stderr)
    print("boom: out of memory", file=sys.stderr)
    sys.exit(3)
""")
SLEEPS = script("import time; time.sleep(60)")


def child(args=SLEEPS) -> ChildProcess:
    return ChildProcess(args, name="test child", echo=False)


def wait_dead(proc: ChildProcess, timeout: float = 5.0) -> None:
    assert proc.wait(timeout) is not None, "the child did not exit"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeChild:
    """A child without a process, for the budget's arithmetic."""

    def __init__(self) -> None:
        self.running, self.stopped = True, False

    def alive(self) -> bool:
        return self.running

    def kill(self) -> None:
        self.running = False

    def stop(self) -> None:
        self.running, self.stopped = False, True

    def failure_message(self, what: str) -> str:
        return f"{what} (fake)"


@pytest.fixture
def supervised():
    made = []

    def make(start=lambda: child(DIES), **options):
        options.setdefault("flag", "--max-test-restarts")
        sup = Supervisor("the test child", start, options.pop("max_restarts", 2), **options)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop()


# -- a child that dies -----------------------------------------------------------------------------


def test_a_child_that_dies_is_started_again_and_its_last_words_are_logged(supervised, caplog):
    sup = supervised()
    first = sup.start()
    wait_dead(first)
    assert not sup.alive()
    with caplog.at_level(logging.WARNING, logger=SUPERVISOR_LOG):
        assert sup.restart(then="; 2 requests wait for it")
    assert sup.child is not first and sup.budget.total == 1
    (record,) = caplog.records
    assert record.getMessage() == (
        f"the test child exited (test child pid {first.pid}, exit status 3); its last output:\n"
        "loading the model\nboom: out of memory: starting it again "
        "(restart 1 of at most 2 in 10 min); 2 requests wait for it")


def test_past_its_budget_a_child_is_not_started_again_and_the_reason_says_why(supervised):
    sup = supervised(max_restarts=1)
    wait_dead(sup.start())
    assert sup.restart()
    second = sup.child
    wait_dead(second)
    assert not sup.restart()
    assert sup.child is second  # nothing new started
    assert sup.final_reason.startswith("the test child exited (test child pid ")
    assert sup.final_reason.endswith(
        "boom: out of memory; restarted 1 time already within 10 min (--max-test-restarts 1)")


def test_with_no_restarts_allowed_the_first_death_is_final(supervised):
    sup = supervised(start=FakeChild, max_restarts=0)
    sup.start().kill()
    assert not sup.may_restart("worker rank 0 (pid 7) was killed by signal 9")
    assert sup.final_reason == ("worker rank 0 (pid 7) was killed by signal 9 "
                                "(not restarted: --max-test-restarts 0)")


def test_restarts_older_than_the_window_no_longer_count():
    clock = Clock()
    sup = Supervisor("the test child", FakeChild, 2, flag="--max-test-restarts", clock=clock)
    sup.start()
    for _ in range(2):
        sup.child.kill()
        assert sup.restart()
        clock.now += 60
    sup.child.kill()
    assert not sup.restart()  # two within the last 10 minutes
    clock.now += 600 - 2 * 60 + 1  # the first one ages out
    assert sup.restart() and sup.budget.total == 3


def test_the_caller_may_name_the_cause(supervised, caplog):
    """The engine core knows why its workers failed better than their exit status."""
    sup = supervised(start=FakeChild, how="replacing the workers")
    sup.start()
    with caplog.at_level(logging.WARNING, logger=SUPERVISOR_LOG):
        assert sup.restart("worker rank 0 did not answer within 2 s")
    assert caplog.records[0].getMessage() == (
        "worker rank 0 did not answer within 2 s: replacing the workers "
        "(restart 1 of at most 2 in 10 min)")


def test_a_replacement_that_fails_to_start_counts_as_one_more_fault(supervised):
    """As the engine core heals: the caller decides, then starts; a start that raises is
    the next cause, until the budget ends it."""
    starts = []

    def start():
        starts.append(1)
        if len(starts) > 1:
            raise RuntimeError(f"rank 0 failed to load (start {len(starts)})")
        return FakeChild()

    sup = supervised(start=start, max_restarts=2)
    sup.start().kill()
    cause = "rank 0 died"
    while sup.may_restart(cause):
        try:
            sup.respawn()
        except RuntimeError as e:
            cause = str(e)
    assert len(starts) == 3 and sup.budget.total == 2
    assert sup.final_reason.startswith("rank 0 failed to load (start 3); restarted 2 times")


# -- what is left, and liveness --------------------------------------------------------------------


def test_what_a_dead_child_left_in_its_process_group_is_stopped_before_the_next_starts(
        supervised, tmp_path):
    pid_file = tmp_path / "orphan.pid"
    leaves_an_orphan = script(f"""
        import subprocess, sys
        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(orphan.pid))
        sys.exit(1)
    """)
    sup = supervised(start=lambda: child(leaves_an_orphan))
    wait_dead(sup.start())
    orphan = int(pid_file.read_text())
    assert alive(orphan)
    assert sup.restart()
    deadline = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(orphan)


def test_a_hung_child_is_killed_and_then_restarted_as_after_any_death(supervised, caplog):
    sup = supervised(start=child)
    hung = sup.start()
    os.kill(hung.pid, signal.SIGSTOP)  # stopped: it cannot act on SIGTERM
    with caplog.at_level(logging.WARNING, logger=SUPERVISOR_LOG):
        sup.kill_hung("echoed no heartbeat for 12.0 s")
    wait_dead(hung)
    assert caplog.records[0].getMessage() == (
        f"the test child (pid {hung.pid}) echoed no heartbeat for 12.0 s: stopped or hung; "
        "killing it")
    assert sup.restart() and sup.alive() and sup.child is not hung


# -- the child process -----------------------------------------------------------------------------


def test_stop_asks_with_sigterm_then_kills():
    polite = child()
    assert polite.stop(timeout=5) == -signal.SIGTERM
    stubborn = child(script("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", file=sys.stderr, flush=True)
        time.sleep(60)
    """))
    deadline = time.monotonic() + 5
    while "ready" not in stubborn.stderr_tail() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stubborn.stop(timeout=0.3) == -signal.SIGKILL


def test_a_child_process_dies_with_its_parent_sigkill_included():
    """The lifeline: the child is given `--lifeline-fd N` and, watching it, stops when the
    process that started it dies."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from tidal.engine_core.supervisor import ChildProcess
        watcher = ChildProcess(["-c", (
            "import sys, time\\n"
            "from tidal.ipc.lifeline import watch_parent\\n"
            "watch_parent(int(sys.argv[sys.argv.index('--lifeline-fd') + 1]), 0)\\n"
            "time.sleep(60)\\n")], name="watcher", echo=False)
        print(watcher.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert alive(grandchild)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(grandchild)
    finally:
        parent.kill()
        parent.stdout.close()
