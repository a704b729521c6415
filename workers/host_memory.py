"""A worker's host memory: the CPU KV cache committed (every page resident right after
start-up, not at first use), and freed step temporaries kept for the next step
(`keep_freed_memory`, whose docstring says why).

Why: a CPU KV cache left to fault in page by page does not stay small. The prefix cache hands
out every never-used block before it evicts a cached one (`engine_core/block_pool.py`), so
under steady load each round of requests writes blocks no earlier round touched, and the
worker's RSS climbs until the whole cache is resident. Measured (the demo model, default
4 GiB cache, `LLM()` with rounds of 2,000 short requests): worker RSS 391 → 655 → 873 →
1091 → 1305 → 1515 MB, the KV mapping's resident part being that growth; with prefix caching
off it stayed at 490-570 MB. It looked like a leak, and a cache too large for the machine
was found by the OOM killer hours into serving instead of at start.

How: madvise(MADV_POPULATE_WRITE) (Linux 5.14+) faults the pages in without writing them,
1.5 s for 4 GiB on this project's 2-core Xeon VM. It runs on a thread so that start-up does
not wait for it (committing first delayed `tidal serve`'s first answer by about 2 s):
populating never changes a page's contents, and the kernel serialises it with the steps'
own faults on the same pages, so steps may read and write the cache meanwhile. Where the
call is missing the cache is zero-filled before use instead (2.2 s for 4 GiB, by torch).

The thread populates `CHUNK_BYTES` per call. One call holds the process's memory-map lock
for as long as it runs, and every mmap waits behind it, torch's allocations of large tensors
included: on an AMD EPYC VM whose memory the host backs at first touch, populating 4 GiB took
21.6 s in one call, and a step's fresh 4 MB tensor waited all of it (`LLM`'s ready time went
from 2-3 s to 39 s). In 4 MB calls the longest wait was 40 ms, for 23.8 s in all.

Each chunk is first advised MADV_HUGEPAGE, so what the thread commits is 2 MB pages where the
kernel has them (THP "madvise" mode): the decode attention reads a KV head's 4 KB block rows
from all over the cache, a page walk each with 4 KB pages. Measured on the 2-vCPU Xeon, the
7M model's decode step at 192 requests x 256 positions, attention 12.2-12.8 -> 11.0 ms (the
kernel alone, 256 requests: 4.3 -> 3.0 ms a layer). Only chunk by chunk, ahead of the commit:
a cache faulted in by use (an offline run whose worker is never idle) keeps 4 KB pages,
because on this VM a 2 MB page first touched cost 4 ms (the host backs it then; 0.9 ms for
512 4 KB pages) and advising the whole cache up front made an offline 7M run 5-10% slower.

The thread works only while `idle` is set: the worker process sets it once no plan has come
for `IDLE_AFTER_MS` and clears it when one does (`workers/proc.py`), so committing never
competes with the steps, nor with the engine core planning the next one, for the CPU or the
lock.
Beside the steps it did: at nice 19, next to the steps' spinning OpenMP threads, it got the
CPU so rarely that it held the lock for up to a second per chunk, and SmolLM2's decode steps
at batch 5-12 took 0.3-1.5 s until it was done (113 s for 4 GiB); at the worker's priority
it was a third runnable thread on two cores and prefill ran at half its rate. A worker that
is never idle (offline, saturated) faults its cache in by use instead; an in-process `Worker`
(tests, benchmarks) leaves `idle` set.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20
"""Blocks at least this large get pages of their own from the kernel (mmap), returned when
freed; smaller ones come from the heap (glibc's largest setting: 32 MB on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""Free memory at the top of the heap kept, not returned to the kernel, up to this much."""
TOP_PAD = 16 << 20
"""Extra heap asked of the kernel each time the heap grows."""

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE_PAGE = 2 << 20
CHUNK_BYTES = 4 << 20
"""Bytes made resident per madvise call (the longest an mmap of the steps waits for one)."""


def commit_pages(tensors: list[torch.Tensor], what: str,
                 idle: threading.Event | None = None) -> threading.Thread | None:
    """Make every page of these CPU tensors resident: on a thread when the kernel can
    populate pages (returned, to join), one chunk at a time while `idle` is set (always,
    when None); else by zero-filling them now (None)."""
    if not tensors:
        return None
    if not _populate_write(tensors[0].data_ptr(), 1):  # probe: is the call there?
        for tensor in tensors:
            tensor.zero_()
        return None
    thread = threading.Thread(target=_populate_all, args=(tensors, what, idle), daemon=True,
                              name="tidal-commit-pages")
    thread.start()
    return thread


def _populate_all(tensors: list[torch.Tensor], what: str,
                  idle: threading.Event | None) -> None:
    start = time.perf_counter()
    nbytes = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        first, end = tensor.data_ptr(), tensor.data_ptr() + size
        address = first
        while address < end:  # chunks end on multiples of CHUNK_BYTES: whole 2 MB pages
            if idle is not None:
                idle.wait()
            chunk = min(end, (address | (CHUNK_BYTES - 1)) + 1) - address
            _advise_huge_pages(address, chunk)
            if not _populate_write(address, chunk):
                logger.warning("%s: could not make %d bytes resident (errno %d); they fault "
                               "in at first use", what, end - address, ctypes.get_errno())
                break
            address += chunk
        nbytes += size
    logger.info("%s: %.2f GiB resident in %.2f s", what, nbytes / 2**30,
                time.perf_counter() - start)


def keep_freed_memory() -> bool:
    """Have this process's allocator keep the memory of freed step temporaries for the next
    step (glibc's mallopt; False where the C library has none, and nothing changes).

    Why: a step's activations (a 2048-token step of the 7M model: [2048, 1536] gate/up
    products, 12.6 MB, and a dozen more) are freed at the step's end and allocated again by
    the next one. glibc gives blocks of 128 KB and up pages of their own and returns them
    when freed (its threshold adapts upward, but not reliably), so a step faulted its
    temporaries in afresh, ~3 us a 4 KB page on this project's Xeon VM: in an offline run of
    the 7M model (200 requests) the worker's steps took 251k minor faults, 12.2k in each
    2048-token step (~35 ms of a 100-140 ms step); with this, 82k, 3.3k a step (what is left:
    the KV cache faulted in by first use, `commit_pages`); whole worker processes of three such
    runs each, loading included, 164k-329k faults without and 148k-151k with. Blocks up to
    MMAP_THRESHOLD now come from the heap, and up to TRIM_THRESHOLD of its top is kept. What
    stays resident is the largest step's temporaries (tens of MB); the KV cache and anything
    over 32 MB keep pages of their own. (SmolLM2's offline run, whose faults are its loading,
    was level with and without it.)
    """
    mallopt = getattr(_linux_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return all([mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1,
                mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1,
                mallopt(_M_TOP_PAD, TOP_PAD) == 1])


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) over the whole 2 MB pages inside [address, address + nbytes),
    so that populating them makes 2 MB pages where the kernel has them (best effort)."""
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (address + nbytes) & ~(_HUGE_PAGE - 1)
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)


def _populate_write(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the pages holding [address, address + nbytes)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address & ~(page - 1)
    return _madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE)


def _madvise(start: int, nbytes: int, advice: int) -> bool:
    """madvise(start, nbytes, advice) == 0 (False where there is no such call)."""
    libc = _linux_libc()
    if libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), advice) == 0


@functools.cache
def _linux_libc() -> ctypes.CDLL | None:
    """This process's C library on Linux (errno kept for ctypes.get_errno), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
