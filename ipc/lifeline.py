"""Every process tidal starts dies with the process that started it, SIGKILL included.

    parent:  fd = lifeline_fd()                  # a pipe's read end; this process alone
             Popen([..., "--lifeline-fd", str(fd)], pass_fds=(fd,))    # holds the write end
    child:   watch_parent(fd, grace_s)           # first thing in main()

Nothing is ever written to the pipe. When the parent dies, however it dies, the kernel closes
its write end and the child's blocking read returns end-of-file; a thread in the child then
stops it: SIGTERM (the process's own handlers shut it down in order), and SIGKILL if it is
still alive `grace_s` seconds later (`grace_s=0`: SIGKILL at once). Used by the engine core
(for its workers), `tidal serve` and `LLM` (for the engine core they start); `tidal serve`'s
HTTP processes, started by multiprocessing, watch the same kind of pipe multiprocessing
already gives them (`multiprocessing.parent_process().sentinel`).

Why a pipe, not prctl(PR_SET_PDEATHSIG) (used before): the death signal is sent when the
*thread* that forked the child exits, not the process. Measured here: a child started from a
short-lived thread got its SIGTERM the moment that thread returned, while the parent process
lived on, and `LLM` starts its engine core from its event-loop thread, `AsyncLLM.create`
from whatever thread runs it. A pipe belongs to the process. It also leaves no fork race to
close with a parent-pid check: the pipe exists before the child does, so a parent that dies
before the child starts watching still leaves an end-of-file to read. The price is one
thread per child, blocked in read(), which needs the GIL for a moment to act.

The write end must not reach any other process, or the child would wait for that one too:
os.pipe() is close-on-exec, subprocess passes only `pass_fds`, and a plain fork() of the
parent closes its copy in the child (os.register_at_fork).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pipe: tuple[int, int] | None = None  # (read end for children, write end kept here)


def lifeline_fd() -> int:
    """The read end to hand to a child (pass_fds); it reads end-of-file once this process
    has exited. One pipe per process, shared by all its children, never closed."""
    global _pipe
    with _lock:
        if _pipe is None:
            _pipe = os.pipe()
        return _pipe[0]


def _forget_in_forked_child() -> None:
    global _pipe
    if _pipe is not None:
        os.close(_pipe[1])  # else this child would keep its parent's children alive
        _pipe = None  # its own children get a pipe of their own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


def watch_parent(fd: int, grace_s: float, what: str = "this process") -> threading.Thread:
    """Stop this process when the process holding the other end of `fd` dies (see the
    module docstring); returns the watching thread."""
    os.set_inheritable(fd, False)  # this process's own children get their own lifeline
    thread = threading.Thread(target=_wait_and_stop, args=(fd, grace_s, what), daemon=True,
                              name="tidal-lifeline")
    thread.start()
    return thread


def _wait_and_stop(fd: int, grace_s: float, what: str) -> None:
    try:
        while os.read(fd, 64):  # nothing is written; data would only be skipped
            pass
    except OSError as e:  # a bad fd: a caller's bug, but never a reason to die
        logger.error("%s: cannot watch its parent through fd %d: %s", what, fd, e)
        return
    logger.warning("%s: its parent process is gone; stopping", what)
    if grace_s > 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("%s: still running %.0f s after SIGTERM; killing it", what, grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
