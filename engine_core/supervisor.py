"""One rule for every process tidal keeps running: start it, tie it to its parent's life, notice
when it dies or hangs, start it again within a restart budget, and say why with its last words.

    engines = Supervisor("the engine core", start=lambda: DaemonProcess(config, address=a),
                         max_restarts=3, flag="--max-engine-restarts",
                         how="starting it again at the same address")
    engines.start()
    ...
    engines.kill_hung("echoed no heartbeat for 12.0 s")   # liveness: a probe said so
    if not engines.alive():
        if engines.restart(then="; the HTTP servers re-attach"):  # budget spent, logged, new child
            ...
        else:
            give_up(engines.final_reason)

Used by all four supervisors (docs/architecture.md §1.8): the engine core for its workers
(the child is the executor, which starts every rank), `tidal serve` for its engine core and
each HTTP process, `LLM` / `AsyncLLM` for their private engine core, and the data-parallel
router for each of its cores. So the rules cannot disagree:

- **Budget.** At most `max_restarts` restarts within any `window_s` (10 minutes by default,
  `restart_budget.py`): a rare fault is survived, a repeating one ends. A replacement that
  fails to start counts as one more fault.
- **Last words.** The cause of a restart or of giving up is the child's own account
  (`failure_message`: how it ended and the last lines it wrote), unless the caller knows
  better (a worker's error).
- **One message each.** A restart is logged as a warning "CAUSE: HOW (restart i of at most n
  in W min)THEN"; giving up gives `final_reason`, "CAUSE; restarted n times already within W
  min (FLAG n)", for the caller to log or raise with what it means there.
- **Liveness.** Death is the child's `alive()`; a child that is stopped or hung (its
  heartbeat probe, a step timeout) is killed by `kill_hung`, and is then restarted as after
  any death.
- **What is left** of a dead child (its process group: workers it started) is stopped
  before the next one starts.

`ChildProcess` is the usual child: `python ARGS...` in a process group of its own, in
the caller's session, with a lifeline (`ipc/lifeline.py`: it dies with this process, SIGKILL
included), its stderr echoed line by line and the last lines kept as its last words. No
torch: the engine core and the frontends both use this module.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable, Generic, Protocol, TypeVar

from .restart_budget import RESTART_WINDOW_S, RestartBudget
from ..ipc.lifeline import lifeline_fd

logger = logging.getLogger(__name__)

_NUM_KEPT_LINES = 60


class Child(Protocol):
    """What a supervisor needs of what it supervises."""

    def alive(self) -> bool:
        """Whether it is still running."""
        ...

    def kill(self) -> None:
        """SIGKILL it (and what it started) now: stopped or hung, it cannot act on SIGTERM."""
        ...

    def stop(self) -> object:
        """End it in order, or what is left of it once dead."""
        ...

    def failure_message(self, what: str) -> str:
        """`what`, how it ended, and the last lines it wrote."""
        ...


C = TypeVar("C")


class Supervisor(Generic[C]):
    """One supervised child and its restart budget (see the module docstring)."""

    def __init__(self, what: str, start: Callable[..., C], max_restarts: int, *,
                 flag: str | None = None, how: str = "starting it again",
                 window_s: float = RESTART_WINDOW_S,
                 stop: Callable[[C], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`what` names the child in messages ("the engine core"); `start(*args, **kw)`
        makes a running one; `flag` names the limit for the user ("--max-engine-restarts");
        `how` says what a restart does ("replacing the workers"); `stop(child)` ends what is
        left of a dead child (default: its `stop()`)."""
        self.what = what
        self.flag = flag
        self.how = how
        self.budget = RestartBudget(max_restarts, window_s, clock)
        self.child: C | None = None
        self.final_reason: str | None = None  # why it is not restarted, once given up
        self._start = start
        self._stop = stop or (lambda child: child.stop())

    # -- the child ---------------------------------------------------------------------------

    def start(self, *args, **kwargs) -> C:
        """Start a child (`start(*args, **kwargs)`); it is `self.child` from now on. A start
        that raises leaves nothing running (that is `start`'s to ensure) and `self.child`
        as it was."""
        self.child = self._start(*args, **kwargs)
        return self.child

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def stop(self) -> None:
        """End the child, or what is left of it."""
        if self.child is not None:
            self._stop(self.child)

    def kill_hung(self, why: str) -> None:
        """Liveness: `why` (its heartbeats unanswered, say) shows the child is stopped or
        hung: SIGKILL it. The caller then restarts it as after any death."""
        if not self.alive():
            return
        pid = getattr(self.child, "pid", None)
        who = f"{self.what} (pid {pid})" if pid is not None else self.what
        logger.warning("%s %s: stopped or hung; killing it", who, why)
        self.child.kill()

    def last_words(self, what: str | None = None) -> str:
        """`what` (default: "<what> exited") with how the child ended and its last lines."""
        what = what or f"{self.what} exited"
        words = getattr(self.child, "failure_message", None)
        return words(what) if words is not None else what

    # -- restarts ----------------------------------------------------------------------------

    def may_restart(self, cause: str | None = None, then: str = "") -> bool:
        """The child died of `cause` (default: its last words). Spend one restart and log
        "CAUSE: HOW (restart i of at most n in W min)THEN" as a warning: True. With the
        budget spent: False, and `final_reason` says so (the caller logs or raises it)."""
        cause = cause or self.last_words()
        budget = self.budget
        if budget.spend():
            logger.warning("%s: %s (%s)%s", cause, self.how, budget.describe(), then)
            return True
        limit = f"{self.flag} {budget.limit}" if self.flag else f"at most {budget.limit}"
        if budget.limit == 0:
            self.final_reason = f"{cause} (not restarted: {limit})"
        else:
            recent = budget.recent()
            self.final_reason = (f"{cause}; restarted {recent} time{'s' * (recent != 1)} "
                                 f"already within {budget.window_s / 60:g} min ({limit})")
        return False

    def respawn(self, *args, **kwargs) -> C:
        """Stop what is left of the dead child, start a new one (`start`'s arguments)."""
        self.stop()
        return self.start(*args, **kwargs)

    def restart(self, cause: str | None = None, then: str = "") -> bool:
        """`may_restart`, then `respawn` (`start` takes no arguments here): whether a new
        child runs."""
        if not self.may_restart(cause, then):
            return False
        self.respawn()
        return True


class ChildProcess:
    """`python ARGS` (`-m MODULE ...`) with a lifeline, in a process group of its own (so a
    Ctrl-C in the terminal reaches only its parent, which stops it in order) but in the caller's
    session (with autogroup scheduling the kernel weighs `nice` values only within one
    session: in a session of its own the child's workers shared the CPU half and half with
    a `nice -n 19` job of the user's). Its stderr is echoed (unless `echo=False`) and the last
    lines kept. Stopped when collected or at interpreter exit, if its owner forgets."""

    def __init__(self, args: list[str], *, name: str, echo: bool = True,
                 env: dict[str, str] | None = None):
        """`args` follow the interpreter; `name` names it in messages ("engine core"); `env`:
        its environment (None: this process's). It gets `--lifeline-fd N` after `args` and
        must watch it (`ipc.lifeline.watch_parent`)."""
        self.name = name
        self._lines: collections.deque[str] = collections.deque(maxlen=_NUM_KEPT_LINES)
        self._echo = echo
        lifeline = lifeline_fd()
        argv = [sys.executable, *args, "--lifeline-fd", str(lifeline)]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            process_group=0, pass_fds=(lifeline,), env=env)
        self._reader = threading.Thread(target=self._read_stderr, name="tidal-child-stderr",
                                        daemon=True)
        self._reader.start()
        # weakref.finalize runs pending finalizers at interpreter exit too
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, 10.0, name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal)."""
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for it to exit; its status, or None if still up."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self, num_lines: int = 30) -> str:
        """The last lines it wrote to stderr."""
        if not self.alive():
            self._reader.join(timeout=0.5)  # let the reader take the last lines
        return "\n".join(list(self._lines)[-num_lines:])

    def failure_message(self, what: str) -> str:
        """`what`, the exit status and its last stderr lines, for a log or an exception."""
        code = self.returncode()
        status = "still running" if code is None else f"exit status {code}"
        tail = self.stderr_tail()
        return f"{what} ({self.name} pid {self.pid}, {status}); its last output:\n{tail}" \
            if tail else f"{what} ({self.name} pid {self.pid}, {status}; it printed nothing)"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout` s, then SIGKILL its process group; its status."""
        code = _stop_process(self.proc, timeout, self.name)
        self._finalizer.detach()
        self._reader.join(timeout=1.0)
        return code

    def kill(self) -> None:
        """SIGKILL its process group (it and what it started) now. `alive()` turns False once
        it is gone."""
        _kill_group(self.proc.pid)

    def _read_stderr(self) -> None:
        stream = self.proc.stderr
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._lines.append(line)
            if self._echo:
                try:
                    sys.stderr.write(line + "\n")
                except (ValueError, OSError):  # stderr closed at interpreter exit
                    pass
        stream.close()


def _stop_process(proc: subprocess.Popen, timeout: float, name: str) -> int | None:
    if proc.poll() is not None:
        _kill_group(proc.pid)  # what it may have left behind
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", name, proc.pid,
                       timeout)
        _kill_group(proc.pid)
        return proc.wait(timeout=5.0)
    finally:
        _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
