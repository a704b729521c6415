"""Committing the CPU KV cache (workers/host_memory.py): every page ends up resident, in
chunks, so the process can map new memory while the committing thread runs (one madvise over the whole cache held the memory-map lock for all of it: a step's fresh
tensor waited 21.6 s on an AMD VM)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest
import torch

from tidal.workers import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads page residency (mincore) and /proc")


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under `tensor` that are resident (mincore): the tensor's own pages,
    not the process's RSS, which other memory freed meanwhile can lower (a whole-suite run
    once saw RSS grow by 25 MB while 50 MB were committed)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() & ~(page - 1)
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (length + page - 1) // page
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags) == 0
    return sum(f & 1 for f in flags) * page


def test_every_page_resident_after_the_thread_in_chunks_at_the_callers_priority(monkeypatch):
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
    own_priority = os.getpriority(os.PRIO_PROCESS, 0)
    thread = host_memory.commit_pages(tensors, "test cache")
    if thread is None:  # no MADV_POPULATE_WRITE: zero-filled instead, resident already
        assert all(bool((t == 0).all()) for t in tensors)
        return
    thread.join(60)
    assert not thread.is_alive()
    assert sum(_resident_bytes(t) for t in tensors) >= 2 * size  # every page
    assert max(calls) <= host_memory.CHUNK_BYTES and sum(calls) >= 2 * size
    assert set(priorities) == {own_priority}  # nice 19 starved it while it held the lock


def test_pages_are_committed_only_while_the_worker_is_idle(monkeypatch):
    """A step runs (idle cleared): no chunk is committed; once idle again the rest is."""
    calls = []
    populate = host_memory._populate_write

    def spy(address, nbytes):
        if threading.current_thread() is not threading.main_thread():
            calls.append(nbytes)
        return populate(address, nbytes)

    monkeypatch.setattr(host_memory, "_populate_write", spy)
    idle = threading.Event()  # a step is running
    tensor = torch.empty(3 * host_memory.CHUNK_BYTES // 4, dtype=torch.float32)
    thread = host_memory.commit_pages([tensor], "test cache", idle)
    if thread is None:
        pytest.skip("no MADV_POPULATE_WRITE here: the cache is zero-filled at once")
    thread.join(0.5)
    assert thread.is_alive() and calls == []
    idle.set()
    thread.join(60)
    assert not thread.is_alive() and sum(calls) >= 3 * host_memory.CHUNK_BYTES


def _huge_page_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        line = next(line for line in f if line.startswith("AnonHugePages:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
                    or "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
                    reason="no transparent huge pages on this kernel")
def test_committed_pages_are_2_mb_pages_and_untouched_ones_are_not_advised():
    """What the thread commits it asks 2 MB pages for, chunk by chunk (the decode attention's
    page walks); a cache nobody commits (a worker never idle) keeps the kernel's default."""
    size = 16 * host_memory.CHUNK_BYTES
    before = _huge_page_bytes()
    untouched = torch.empty(size // 4, dtype=torch.float32)
    untouched.zero_()  # faulted in by use: 4 KB pages (THP "madvise" mode)
    committed = torch.empty(size // 4, dtype=torch.float32)
    thread = host_memory.commit_pages([committed], "test cache")
    if thread is None:
        pytest.skip("no MADV_POPULATE_WRITE here: the cache is zero-filled at once")
    thread.join(60)
    grown = _huge_page_bytes() - before
    if "[always]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        assert grown <= size  # none of `untouched`
    assert grown >= size // 2, grown  # the kernel may be short of 2 MB pages for a few


_STEP_TEMPORARIES = """
import resource, torch
from tidal.workers.host_memory import keep_freed_memory
assert keep_freed_memory()
def step():  # a prefill step's activations: allocated, used, freed
    gate_up = torch.ones(2048, 1536)
    hidden = torch.ones(2048, 768) * gate_up[:, :768]
    return float(hidden[-1, -1])
for _ in range(10):  # the heap grows to fit them, once
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_step_temporaries_are_reused_without_page_faults():
    """With keep_freed_memory, once the heap has grown to fit them, steps of 12.6 MB + 2 x 6.3
    MB temporaries fault in no fresh pages (glibc 2.36's defaults: 6,112 faults every step,
    ~3 us each on this project's Xeon VM)."""
    faults = int(subprocess.run([sys.executable, "-c", _STEP_TEMPORARIES], check=True,
                                capture_output=True, text=True).stdout)
    assert faults < 100  # a few for Python's own objects; one step's tensors are 6,144 pages
