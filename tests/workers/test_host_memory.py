"""Committing the CPU KV cache (workers/host_memory.py): every page ends up resident, the
committing thread runs at the lowest priority, and the process can map new memory while it
runs (one madvise over the whole cache held the memory-map lock for all of it: a step's fresh
tensor waited 21.6 s on an AMD VM)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from tidal.workers import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the resident set size from /proc")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_every_page_resident_after_the_thread_in_chunks_at_nice_19(monkeypatch):
    calls, priorities = [], []
    populate = host_memory._populate_write

    def spy(address, nbytes):
        if threading.current_thread() is not threading.main_thread():
            calls.append(nbytes)
            priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return populate(address, nbytes)

    monkeypatch.setattr(host_memory, "_populate_write", spy)
    size = 6 * host_memory.CHUNK_BYTES + 4096
    tensors = [torch.empty(size // 4, dtype=torch.float32) for _ in range(2)]
    before, own_priority = _rss_bytes(), os.getpriority(os.PRIO_PROCESS, 0)
    thread = host_memory.commit_pages(tensors, "test cache")
    if thread is None:  # no MADV_POPULATE_WRITE: zero-filled instead, resident already
        assert all(bool((t == 0).all()) for t in tensors)
        return
    thread.join(60)
    assert not thread.is_alive()
    assert _rss_bytes() - before >= 2 * size - 2 * host_memory.CHUNK_BYTES
    assert max(calls) <= host_memory.CHUNK_BYTES and sum(calls) >= 2 * size
    assert set(priorities) == {19}
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_priority  # the calling thread keeps its own
