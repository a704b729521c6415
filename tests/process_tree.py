"""Processes by pid, read from /proc (Linux): a process's descendants, and waiting until a set
of pids is gone. A zombie counts as gone: it holds no memory, port or file, and an orphan's
zombie waits on whatever reaps for pid 1 here, which may be slow or never."""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def is_worker(pid: int) -> bool:
    """Whether `pid` is a tidal worker process (`python -m tidal.workers.proc`)."""
    return _runs_module(pid, "tidal.workers.proc")


def is_gguf_converter(pid: int) -> bool:
    """Whether `pid` is tidal's GGUF converter (`python -m tidal.workers.gguf`)."""
    return _runs_module(pid, "tidal.workers.gguf")


def _runs_module(pid: int, module: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return module.encode() in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid: int) -> list[int]:
    """The living processes whose parent is `pid`."""
    return [p for p in descendants(pid) if (stat := _stat(p)) is not None and stat[1] == pid]


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` s for every pid to be gone; the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_for(predicate, timeout: float, what: str):
    """Poll `predicate()` until it returns something truthy; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
