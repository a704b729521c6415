"""Prefix caching and block allocation (docs/architecture.md §7, items 19-29), block size 16."""

import subprocess
import sys

from sched_utils import (
    FakeWorker, make_request, make_scheduler, output_tokens, reference_tokens,
    scheduled_tokens, step,
)

from tidal.engine_core.block_pool import NONE_HASH, BlockPool, hash_block_tokens
from tidal.engine_core.kv_cache_manager import KVCacheManager


def test_identical_prompts_share_blocks_in_the_same_step():
    """§7.19: two identical 100-token prompts submitted together: the first schedules 100;
    its 6 full blocks (96 tokens) are published at schedule time, so the second hits 96 and
    schedules only 4; a later identical request also schedules 4."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", [7] * 100))
    sched.add(make_request("b", [7] * 100))
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 100, "b": 4}
    assert plan.new_requests[1].num_computed_tokens == 96
    assert plan.new_requests[1].block_ids[:6] == plan.new_requests[0].block_ids[:6]
    sched.add(make_request("c", [7] * 100))
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan)["c"] == 4


def test_multi_turn_hits_all_but_the_last_partial_block():
    """§7.20: turn 1 has 40 prompt tokens and 10 outputs (50 tokens; positions 0..48 were
    computed, so 3 full blocks = 48 tokens are published). Turn 2's prompt is turn 1's 50
    tokens plus 7 new ones (57): it hits 48 tokens and computes 9."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    prompt = [4] * 40
    sched.add(make_request("t1", prompt, max_tokens=10))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += output_tokens(step(sched, worker)[1], "t1")
    sched.add(make_request("t2", prompt + outputs + [5] * 7))
    plan = sched.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 48 and new.num_scheduled_tokens == 9


def test_prefix_hit_reuses_blocks_and_allocates_only_the_tail():
    """§7.21: A (55 tokens) holds blocks [1,2,3,4] with 1-3 full and published. B shares A's
    first 48 tokens then differs (55 tokens): num_computed_tokens 48, blocks [1,2,3] shared
    (ref_cnt 2), one new block (5) for its 7-token tail."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    shared = list(range(1, 49))
    sched.add(make_request("a", shared + [100] * 7))
    step(sched, worker)
    sched.add(make_request("b", shared + [200] * 7))
    plan = sched.schedule()
    (nb,) = plan.new_requests
    assert nb.num_computed_tokens == 48 and nb.block_ids == [1, 2, 3, 5]
    pool = sched.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]


def test_eviction_order_after_frees():
    """§7.22: A [1,2,3,4] and B [1,2,3,5] (shared 3-block prefix, partial tails 4 and 5).
    Freeing A then B (each tail first) gives the free list [5,4,6,7,8,9,10,3,2,1]: uncached
    tails first (most recent first), then never-used blocks, then cached blocks, LRU and tail
    before head. A 159-token miss then takes 10 blocks in exactly that order, evicting the
    old hashes (they are cleared, §7.25)."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    shared = list(range(1, 49))
    sched.add(make_request("a", shared + [100] * 7))
    sched.add(make_request("b", shared + [200] * 7))
    step(sched, worker)
    sched.abort(["a"])
    sched.abort(["b"])
    pool = sched.block_pool
    assert pool.free_queue.ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    old_hashes = {pool.blocks[i].block_hash for i in (1, 2, 3)}
    sched.add(make_request("c", [999] * 159))
    (nc,) = sched.schedule().new_requests
    assert nc.block_ids == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert not old_hashes & set(pool.cached)
    sched.check_invariants()


def test_a_block_is_made_when_first_handed_out():
    """A pool of a million blocks holds one block object (the null block) until asked; blocks
    come out in id order and count as free before they exist."""
    pool = BlockPool(1_000_000)
    assert len(pool.blocks) == 1 and pool.num_free_blocks == 999_999
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and len(pool.blocks) == 4
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.ids()[:5] == [3, 2, 1, 4, 5] and pool.num_free_blocks == 999_999
    pool.check_invariants()


def test_hit_on_free_block_does_not_evict_it():
    """§7.23: after A (55 tokens, [1,2,3,4]) is freed, its published blocks 1-3 sit on the
    free list. C shares the 48-token prefix: the hit takes 1-3 back from the free list and the
    tail gets a different block (4, the free-list head), not one of the hit blocks."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    shared = list(range(1, 49))
    sched.add(make_request("a", shared + [100] * 7))
    step(sched, worker)
    sched.abort(["a"])
    sched.add(make_request("c", shared + [300] * 7))
    (nc,) = sched.schedule().new_requests
    assert nc.num_computed_tokens == 48 and nc.block_ids == [1, 2, 3, 4]
    assert all(sched.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3))


def test_decode_allocates_a_block_only_when_the_last_fills():
    """§7.24: a 31-token prompt takes 2 blocks (block 0 published). Step 2 computes position
    31: block 1 is now full and gets its hash, no new block. Step 3 computes position 32 and
    takes a third, unhashed block."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", 31))
    kv = sched.kv_cache_manager

    def hashed():
        return [b.block_hash is not None for b in kv.req_blocks["a"]]

    step(sched, worker)
    assert hashed() == [True, False]
    plan, _ = step(sched, worker)
    assert plan.cached_requests[0].new_block_ids == [] and hashed() == [True, True]
    plan, _ = step(sched, worker)
    assert len(plan.cached_requests[0].new_block_ids) == 1 and hashed() == [True, True, False]


def test_caching_disabled_never_hits_and_over_allocation_fails():
    """§7.25: without prefix caching identical prompts share nothing, nothing is hashed, and
    asking for more blocks than are free (11 > 10 usable) returns None without side effects."""
    sched = make_scheduler(caching=False)
    worker = FakeWorker(16)
    sched.add(make_request("a", [7] * 100))
    sched.add(make_request("b", [7] * 100))
    plan, _ = step(sched, worker)
    assert scheduled_tokens(plan) == {"a": 100, "b": 100}
    assert not sched.block_pool.cached and sched.stats().prefix_cache_queries == 0
    kv = KVCacheManager(11, 16, enable_caching=False)
    req = make_request("x", 170)
    assert kv.allocate_slots(req, 170) is None and kv.num_free_blocks() == 10
    assert kv.allocate_slots(req, 160) is not None and kv.num_free_blocks() == 0


def test_prefix_cache_stats_once_per_admission():
    """§7.27: stats are counted at admission only: a request blocked for blocks is not counted
    on each retry. queries = request tokens, hits = cached tokens; a preempted request's
    re-lookup goes to the preempted counters. Pool: 11 blocks (10 usable); A takes 6 (90
    tokens of 1s). B (80 1s then 70 2s: 150 tokens, 10 blocks) would hit A's 5 full blocks
    but needs 5 new ones with only 4 free, so it waits over several steps."""
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    worker = FakeWorker(16)
    sched.add(make_request("a", [1] * 90, max_tokens=3))
    step(sched, worker)
    sched.add(make_request("b", [1] * 80 + [2] * 70, max_tokens=2))
    step(sched, worker)
    step(sched, worker)
    assert "b" in [r.req_id for r in sched.waiting]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (90, 0)
    while sched.has_unfinished_requests():
        step(sched, worker)
    # B admitted once A finished: 150 tokens looked up, A's 5 full blocks of 1s hit (80).
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (240, 80)
    stats = sched.stats()
    assert stats.prefix_cache_queries == 240 and stats.prefix_cache_hits == 80
    assert sched.preempted_prefix_cache_queries == 0


def test_reset_prefix_cache():
    """§7.28: resetting the prefix cache fails while a request holds blocks and succeeds once
    none does, clearing every hash."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", 40, max_tokens=2))
    step(sched, worker)
    assert not sched.reset_prefix_cache()
    while sched.has_unfinished_requests():
        step(sched, worker)
    assert sched.block_pool.cached
    assert sched.reset_prefix_cache()
    assert not sched.block_pool.cached
    assert all(b.block_hash is None for b in sched.block_pool.blocks)


def test_reset_prefix_cache_with_running_requests():
    """§7.28: reset_prefix_cache(reset_running_requests=True) sends every running request
    back to waiting in its original order (the workers drop them in the next plan), then
    succeeds; the requests resume with nothing cached (3 × 40 tokens recomputed) and produce
    the same tokens as an unconstrained run."""
    sched = make_scheduler()
    worker = FakeWorker(16)
    for name in "abc":
        sched.add(make_request(name, [ord(name)] * 40, max_tokens=4))
    _, out = step(sched, worker)
    tokens = {n: output_tokens(out, n) for n in "abc"}
    sched.add(make_request("d", 10))
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert [r.req_id for r in sched.waiting] == ["a", "b", "c", "d"] and not sched.running
    sched.check_invariants()
    plan, out = step(sched, worker)
    assert sorted(plan.preempted_req_ids) == ["a", "b", "c"]
    assert {n.req_id: n.num_computed_tokens for n in plan.new_requests} == {
        "a": 0, "b": 0, "c": 0, "d": 0}
    for n in "abc":
        tokens[n] += output_tokens(out, n)
    while sched.has_unfinished_requests():
        _, out = step(sched, worker)
        for n in "abc":
            tokens[n] += output_tokens(out, n)
    for n in "abc":
        assert tokens[n] == reference_tokens([ord(n)] * 40, max_tokens=4, max_model_len=4096)


def test_no_leaks_after_everything_finishes():
    """§7.29: after all requests finish (some aborted mid-prefill, some preempted), no
    request, queue entry or block map remains, free blocks == total - 1, every ref_cnt is 0
    (hashes may remain: lazy eviction). 16 blocks, 12 requests of 20-60 tokens."""
    sched = make_scheduler(num_blocks=16, max_model_len=128, max_num_batched_tokens=64)
    worker = FakeWorker(16)
    for i in range(12):
        sched.add(make_request(i, 20 + 4 * i, max_tokens=5 + i))
    n = 0
    while sched.has_unfinished_requests():
        step(sched, worker)
        n += 1
        if n == 3:
            sched.abort(["5", "6"])
    assert not sched.requests and not sched.running and not sched.waiting
    assert not sched.kv_cache_manager.req_blocks and not sched.kv_cache_manager.num_cached_blocks
    assert sched.block_pool.num_free_blocks == 15
    assert all(b.ref_cnt == 0 for b in sched.block_pool.blocks)
    sched.check_invariants()


def test_salt_isolates_and_hashes_are_stable_across_processes():
    """Block hashes are BLAKE2b-128 chained over parent hash, little-endian token bytes and the
    salt (first block only): the same in another interpreter with another PYTHONHASHSEED; a
    salted request does not hit an unsalted one's blocks."""
    h = hash_block_tokens(NONE_HASH, list(range(16)))
    code = ("from tidal.engine_core.block_pool import NONE_HASH, BlockPool, hash_block_tokens;"
            "print(hash_block_tokens(NONE_HASH, list(range(16))).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}, check=True)
    assert other.stdout.strip() == h.hex() and len(h) == 16
    assert hash_block_tokens(NONE_HASH, list(range(16)), b"tenant") != h
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add(make_request("a", [7] * 40))
    step(sched, worker)
    sched.add(make_request("b", [7] * 40, cache_salt="tenant-b"))
    sched.add(make_request("c", [7] * 40))
    plan = sched.schedule()
    assert {n.req_id: n.num_computed_tokens for n in plan.new_requests} == {"b": 0, "c": 32}


def test_recompute_all_after_the_workers_are_replaced():
    """The engine core replaced its workers (one died) while two plans were in flight: their
    tokens never come back. `recompute_all` sends every running request back to waiting in
    running order and forgets every cached hash (the KV died with the workers); the next
    plan owes the fresh worker nothing (no finished or preempted ids), re-sends each request
    from token 0, and every request ends with the tokens of a fault-free run, the tokens it
    had before the fault included."""
    sched = make_scheduler(async_scheduling=True)
    worker = FakeWorker(16)
    for name in "abc":
        sched.add(make_request(name, [ord(name)] * 40, max_tokens=6))
    tokens = {n: [] for n in "abc"}
    for _ in range(2):
        _, out = step(sched, worker)
        for n in "abc":
            tokens[n] += output_tokens(out, n)
    assert all(len(t) == 2 for t in tokens.values()) and sched.block_pool.cached
    sched.add(make_request("d", 10, max_tokens=2))
    sched.schedule(), sched.schedule()  # in flight when the worker dies: lost
    assert sched.recompute_all() == 4
    assert [r.req_id for r in sched.waiting] == ["a", "b", "c", "d"] and not sched.running
    assert not sched.block_pool.cached
    sched.check_invariants()
    fresh = FakeWorker(16)
    plan, out = step(sched, fresh)
    assert plan.preempted_req_ids == [] and plan.finished_req_ids == []
    assert {n.req_id: n.num_computed_tokens for n in plan.new_requests} == {
        "a": 0, "b": 0, "c": 0, "d": 0}
    for n in "abc":
        tokens[n] += output_tokens(out, n)
    while sched.has_unfinished_requests():
        _, out = step(sched, fresh)
        for n in "abc":
            tokens[n] += output_tokens(out, n)
    for n in "abc":
        assert tokens[n] == reference_tokens([ord(n)] * 40, max_tokens=6, max_model_len=4096)
