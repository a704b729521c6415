"""Start and stop a private engine-core daemon for one owner (`LLM(model)`, `AsyncLLM`,
`tidal serve MODEL`, the data-parallel router for each of its cores).

    python -m tidal.engine_core.daemon --engine-config <the EngineConfig as msgspec JSON>
        --listen <new private address> --lifeline-fd <read end of this process's lifeline pipe>

(With `data_parallel_size` > 1 in the config that process is the data-parallel router.)

The daemon runs in its own process group (so a Ctrl-C in the terminal reaches the frontend,
which then stops the daemon in order) but in the caller's session: with autogroup scheduling
the kernel weighs `nice` values only within one session, and in a session of its own the
daemon's workers shared the CPU half and half with a `nice -n 19` job of the user's
(`engine_core/cpu_threads.py`) and never outlives its owner: when this process dies without
closing it, SIGKILL included, the daemon reads end-of-file on its lifeline, stops as on
SIGTERM (its workers with it) and is SIGKILLed if still there 15 s later
(`ipc/lifeline.py`). Its stderr is echoed line by line (to this process's stderr, unless
`echo=False`) and the last lines are kept, to be quoted when it fails to start.

Stopping: SIGTERM, wait `stop_timeout` seconds, then SIGKILL the daemon's whole process
group (the daemon and any worker it left behind).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref

from .config import EngineConfig, encode_engine_config
from ..ipc.lifeline import lifeline_fd
from ..ipc.transport import new_private_address

logger = logging.getLogger(__name__)

_NUM_KEPT_LINES = 60


class DaemonProcess:
    """A private `tidal core` subprocess listening on a fresh private address."""

    def __init__(self, config: EngineConfig, *, address: str | None = None,
                 echo: bool = True, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`env`: the daemon's environment (None: this process's)."""
        self.config = config
        self.address = address or new_private_address()
        self._lines: collections.deque[str] = collections.deque(maxlen=_NUM_KEPT_LINES)
        self._echo = echo
        self._extra_args = list(extra_args or [])
        self._env = env
        lifeline = lifeline_fd()
        argv = [sys.executable, "-m", "tidal.engine_core.daemon",
                "--engine-config", encode_engine_config(config), "--listen", self.address,
                "--lifeline-fd", str(lifeline), *(extra_args or [])]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            process_group=0, pass_fds=(lifeline,), env=env)
        self._reader = threading.Thread(target=self._read_stderr, name="tidal-core-stderr",
                                        daemon=True)
        self._reader.start()
        # stop the daemon when this object is collected or at interpreter exit, even if the
        # owner forgets to close() (weakref.finalize runs pending finalizers at exit)
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, 10.0)
        logger.info("started engine core (pid %d) on %s", self.proc.pid, self.address)

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the daemon process is still running."""
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal)."""
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for the daemon to exit; its status, or None if still up."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self, num_lines: int = 30) -> str:
        """The last lines the daemon wrote to stderr."""
        if not self.alive():
            self._reader.join(timeout=0.5)  # let the reader take the last lines
        return "\n".join(list(self._lines)[-num_lines:])

    def failure_message(self, what: str) -> str:
        """`what`, the exit status and the daemon's last stderr lines, for an exception."""
        code = self.returncode()
        status = "still running" if code is None else f"exit status {code}"
        tail = self.stderr_tail()
        return f"{what} (engine core pid {self.pid}, {status}); its last output:\n{tail}" \
            if tail else f"{what} (engine core pid {self.pid}, {status}; it printed nothing)"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout` s, then SIGKILL its process group; returns the status."""
        code = _stop_process(self.proc, timeout)
        self._finalizer.detach()
        self._reader.join(timeout=1.0)
        return code

    def kill(self) -> None:
        """SIGKILL its process group (the daemon and its workers) now: a stopped or hung
        daemon cannot act on SIGTERM. `alive()` turns False once it is gone."""
        _kill_group(self.proc.pid)

    def respawn(self) -> "DaemonProcess":
        """A new daemon with the same config and flags at the same address, after this one
        died (call `stop()` first: it kills what is left in its process group).

        The new daemon gets a lifeline of its own (`ipc/lifeline.py`): it dies with this
        process, whichever thread starts it."""
        return DaemonProcess(self.config, address=self.address, echo=self._echo,
                             extra_args=self._extra_args, env=self._env)

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


def _stop_process(proc: subprocess.Popen, timeout: float) -> int | None:
    if proc.poll() is not None:
        _kill_group(proc.pid)  # workers it may have left behind
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.warning("engine core (pid %d) ignored SIGTERM for %.0f s; killing it",
                       proc.pid, timeout)
        _kill_group(proc.pid)
        return proc.wait(timeout=5.0)
    finally:
        _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
