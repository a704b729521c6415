"""The KV cache manager under a sliding window (every layer windowed, Mistral v0.1): a request
gives back the blocks that fall wholly out of the window of its next query, so a long one holds
about its window; freed blocks are reused; prefix hits and preemption stay token-exact.

The fake worker here reads, as a windowed model does, only the window of each query: before
a step writes its KV it checks the positions its first query sees, and before sampling those
of the last query. A block freed too early and reused by another request fails the check;
a block freed out of the window holds anything (or the null block's place) unchecked.
"""

from __future__ import annotations

import math

import pytest

from sched_utils import (
    FakeWorker, make_config, make_request, output_tokens, reference_tokens, step,
)
from tidal.engine_core.scheduler import Scheduler

BLOCK = 16
WINDOW = 40  # not a multiple of the block size


class WindowedFakeWorker(FakeWorker):
    """A worker whose queries see the last `window` positions only."""

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(block_size)
        self.window = window

    def _write_kv(self, state, start: int, end: int) -> None:
        self._check_positions(state, max(0, start - self.window + 1), start)
        super()._write_kv(state, start, end)

    def _check_kv(self, req_id: str, state) -> None:
        last = len(state.tokens) - 1
        self._check_positions(state, max(0, last - self.window + 1), last + 1, req_id)

    def _check_positions(self, state, lo: int, hi: int, req_id: str = "") -> None:
        bs = self.block_size
        for pos in range(lo, hi):
            block_id = state.table[pos // bs]
            assert block_id != 0, f"{req_id}: position {pos} in the window is the null block"
            got = self.kv.get(block_id, [None] * bs)[pos % bs]
            assert got == state.tokens[pos], (
                f"{req_id}: KV at position {pos} holds {got}, expected {state.tokens[pos]}")


def windowed_scheduler(num_blocks: int, max_model_len: int, window: int | None = WINDOW,
                       **config) -> Scheduler:
    return Scheduler(make_config(block_size=BLOCK, **config), num_blocks, max_model_len,
                     sliding_window=window)


def held_blocks(sched: Scheduler, req_id: str) -> int:
    return sum(1 for b in sched.kv_cache_manager.req_blocks.get(req_id, ()) if b.block_id)


def run(sched: Scheduler, worker: FakeWorker, requests, on_step=None) -> dict[str, list[int]]:
    for request in requests:
        sched.add(request)
    out: dict[str, list[int]] = {r.req_id: [] for r in requests}
    while sched.has_unfinished_requests():
        _, outputs = step(sched, worker)
        for req_id in out:
            out[req_id] += output_tokens(outputs, req_id)
        if on_step is not None:
            on_step()
    return out


def expected(request, max_model_len: int) -> list[int]:
    return reference_tokens(list(request.prompt_token_ids), max_tokens=request.max_tokens,
                            max_model_len=max_model_len)


@pytest.mark.parametrize("budget", [8192, 24])  # the prompt whole, or in 24-token chunks
def test_a_long_request_holds_only_its_window(budget):
    sched = windowed_scheduler(1000, 1024, max_num_batched_tokens=budget)
    worker = WindowedFakeWorker(BLOCK, WINDOW)
    request = make_request("long", 100, max_tokens=400)
    bound = math.ceil((WINDOW - 1) / BLOCK) + 1  # blocks from the window's start to the end
    most = []

    def check():
        if sched.requests.get("long") is not None and request.num_computed_tokens > 100:
            most.append(held_blocks(sched, "long"))
            assert most[-1] <= bound, (request.num_computed_tokens, most[-1])

    out = run(sched, worker, [request], check)
    assert out["long"] == expected(request, 1024)
    assert max(most) >= bound - 1  # the window is held, not less
    assert sched.kv_cache_manager.num_free_blocks() == 999  # all back at the end


def test_freed_blocks_are_reused_so_windowed_requests_need_no_preemption():
    # 15 usable blocks: each request reaches 170 tokens (11 blocks with full attention), so
    # the three preempt one another without a window; with one each holds at most 4
    requests = lambda: [make_request(f"r{i}", 20 + i, max_tokens=150) for i in range(3)]
    for window, preempts in [(WINDOW, False), (None, True)]:
        sched = windowed_scheduler(16, 176, window)
        worker = WindowedFakeWorker(BLOCK, window or 10**9)
        reqs = requests()
        out = run(sched, worker, reqs)
        for request in reqs:
            assert out[request.req_id] == expected(request, 176), window
        assert (sched.num_preemptions > 0) == preempts, (window, sched.num_preemptions)
    assert len(worker.kv) <= 15  # the same few blocks, written again and again


def test_prefix_hit_after_freeing_is_token_exact():
    """A freed block keeps its hash until it is reused: a later request with the same prefix
    hits it (the first blocks of a conversation's next turn); once early blocks are reused,
    what is left of the window's blocks still hits; token-exact either way."""
    sched = windowed_scheduler(64, 1000)
    worker = WindowedFakeWorker(BLOCK, WINDOW)
    first = make_request("turn1", 90, max_tokens=60)
    out = run(sched, worker, [first])
    conversation = list(first.prompt_token_ids) + out["turn1"]
    second = make_request("turn2", conversation + [7, 8, 9], max_tokens=30)
    out = run(sched, worker, [second])
    assert out["turn2"] == expected(second, 1000)
    assert sched.prefix_cache_hits >= 144  # 9 of the 10 full blocks of turn 1
    assert held_blocks(sched, "turn2") == 0

    # fill the pool so turn 1's early blocks are reused, then ask again
    run(sched, worker, [make_request(f"filler{i}", 200, max_tokens=40) for i in range(4)])
    hits_before = sched.prefix_cache_hits
    third = make_request("turn3", conversation + [5, 6], max_tokens=30)
    out = run(sched, worker, [third])
    assert out["turn3"] == expected(third, 1000)
    sched.check_invariants()


def test_a_hit_needs_only_the_window_blocks():
    """Under a window the prefix lookup takes the longest prefix whose next query's window is
    cached: with the first block's entry gone (reused), a contiguous walk from the first block
    would hit nothing; here the prefix hits, its early blocks as the null block, and the
    continuation is token-exact (the hash chain covers every earlier token)."""
    sched = windowed_scheduler(64, 1000)
    worker = WindowedFakeWorker(BLOCK, WINDOW)
    first = make_request("a", 150, max_tokens=1)
    run(sched, worker, [first])
    pool = sched.block_pool
    pool._evict(pool.cached[first.block_hashes[0]])  # as when block 0 is handed out again
    second = make_request("b", list(first.prompt_token_ids) + [4, 5, 6, 7], max_tokens=20)
    hits, num_hit = sched.kv_cache_manager.get_computed_blocks(second)
    assert num_hit == 144  # 9 full blocks of the 154 tokens, the first 6 not needed
    need = math.ceil((WINDOW - 1) / BLOCK)
    assert [b.block_id == 0 for b in hits] == [True] * (9 - need) + [False] * need
    out = run(sched, worker, [second])
    assert out["b"] == expected(second, 1000)
    assert second.num_cached_tokens == 144
    sched.check_invariants()
    assert sched.kv_cache_manager.num_free_blocks() == 63

    # a window whose blocks are not all cached: the longest prefix that is
    pool._evict(pool.cached[first.block_hashes[7]])
    third = make_request("c", list(first.prompt_token_ids) + [9], max_tokens=5)
    hits, num_hit = sched.kv_cache_manager.get_computed_blocks(third)
    assert num_hit == 7 * BLOCK  # blocks 4..6 hold the window of the query at 112
    out = run(sched, worker, [third])
    assert out["c"] == expected(third, 1000)


def test_preemption_under_a_window_resumes_token_exact():
    """Three requests admitted on one block each outgrow a 6-block pool even with a window
    (3 blocks each): they preempt, and each resumes from its tokens (recompute), windowed
    again, with the reference's tokens."""
    sched = windowed_scheduler(7, 96, window=30, max_num_batched_tokens=32)
    worker = WindowedFakeWorker(BLOCK, 30)
    reqs = [make_request(f"p{i}", 8 + i, max_tokens=70) for i in range(3)]
    out = run(sched, worker, reqs)
    for request in reqs:
        assert out[request.req_id] == expected(request, 96)
    assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.num_free_blocks() == 6


def test_no_window_frees_nothing():
    sched = windowed_scheduler(100, 1024, window=None)
    request = make_request("full", 100, max_tokens=60)
    held = []
    run(sched, FakeWorker(BLOCK), [request],
        lambda: held.append(held_blocks(sched, "full")))
    assert max(held) == math.ceil(159 / BLOCK)
