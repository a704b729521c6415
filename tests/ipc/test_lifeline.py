"""ipc/lifeline.py: a child dies with the process that started it, however that one dies.

Each test runs a parent process that starts one child with its lifeline, then SIGKILLs the
parent and watches the child by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from process_tree import alive, descendants, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# argv: CHILD source, mode, marker path. The child is started from a thread that returns at
# once (PR_SET_PDEATHSIG, used before, killed a child when that thread exited). In mode
# "fork" the parent then forks a plain copy of itself that lives on after the parent dies.
PARENT = r"""
import os, subprocess, sys, threading, time
from tidal.ipc.lifeline import lifeline_fd
child_src, mode, marker = sys.argv[1:4]
box = {}
def start():
    fd = lifeline_fd()
    box["child"] = subprocess.Popen([sys.executable, "-c", child_src, str(fd), mode, marker],
                                    pass_fds=(fd,), stdout=subprocess.DEVNULL)
thread = threading.Thread(target=start)
thread.start()
thread.join()
if mode == "fork" and os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print(box["child"].pid, flush=True)
time.sleep(60)
"""

# modes: "kill" (grace 0: SIGKILL at once), "term" (SIGTERM handled: writes the marker),
# "stubborn" (SIGTERM ignored: SIGKILL after a 1 s grace), "fork" (as "kill")
CHILD = r"""
import os, signal, sys, time
from tidal.ipc.lifeline import watch_parent
fd, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def on_term(*_):
    open(marker, "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else on_term)
watch_parent(fd, grace_s={"term": 10.0, "stubborn": 1.0}.get(mode, 0.0), what="test child")
time.sleep(60)
"""


def _start(mode: str, marker: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, marker],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    return parent, child


def _kill(parent: subprocess.Popen) -> None:
    parent.kill()
    parent.wait(10)
    parent.stdout.close()


@pytest.mark.parametrize("mode", ["kill", "term"])
def test_child_outlives_its_starting_thread_and_dies_with_its_parent(mode, tmp_path):
    marker = str(tmp_path / "sigterm")
    parent, child = _start(mode, marker)
    try:
        assert wait_gone([child], timeout=0.5) == [child], "the child died with its thread"
        _kill(parent)
        assert wait_gone([child], timeout=5.0) == [], "the child outlived its parent"
        assert os.path.exists(marker) == (mode == "term")  # SIGTERM first when grace > 0
    finally:
        _clean_up(parent, child)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    marker = str(tmp_path / "sigterm")
    parent, child = _start("stubborn", marker)
    try:
        _kill(parent)
        assert alive(child)  # ignoring SIGTERM, for the 1 s grace
        assert wait_gone([child], timeout=6.0) == []
        assert not os.path.exists(marker)
    finally:
        _clean_up(parent, child)


def test_a_forked_copy_of_the_parent_does_not_keep_the_child_alive(tmp_path):
    parent, child = _start("fork", str(tmp_path / "sigterm"))
    copies = [pid for pid in descendants(parent.pid) if pid != child]
    try:
        assert len(copies) == 1
        _kill(parent)
        assert wait_gone([child], timeout=5.0) == [], "the forked copy kept the child alive"
        assert alive(copies[0])
    finally:
        _clean_up(parent, child, *copies)


def _clean_up(parent: subprocess.Popen, *pids: int) -> None:
    """After a failure: the parent (if not reaped yet), then whatever it left alive."""
    if parent.poll() is None:
        _kill(parent)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
