"""SIGTERM and SIGINT as a request to stop, for a process that runs a loop (the engine core,
the data-parallel router). The handler only records which signal came; the loop looks at
`reason` between two pieces of work and stops in order. A loop that waits in a poll adds `fd`,
which becomes readable when a signal arrives (`signal.set_wakeup_fd`), so an idle wait ends at
once (`clear()` it then).
"""

from __future__ import annotations

import signal
import socket

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered (`with`), SIGTERM / SIGINT set `reason` ("SIGTERM"); main thread only."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._read = self._write = None  # a socket pair while entered
        self._old = None

    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.reason is not None

    @property
    def fd(self) -> int:
        """Readable once a signal arrived, until `clear()` (while entered)."""
        return self._read.fileno()

    def clear(self) -> None:
        """Read what the signals wrote to `fd`."""
        try:
            while self._read.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def __enter__(self) -> "StopSignals":
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._old = old_fd, {s: signal.signal(s, self._on_signal) for s in _SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        old_fd, old = self._old
        signal.set_wakeup_fd(old_fd)
        for s, handler in old.items():
            signal.signal(s, handler)
        self._read.close()
        self._write.close()

    def _on_signal(self, signum, frame) -> None:
        if self.reason is None:
            self.reason = signal.Signals(signum).name
