"""Per-request KV blocks on top of the block pool, and the prefix-cache lookup.

A request's blocks cover its computed (or scheduled) tokens; the last one may be partly full:

    tokens:  | block 0 | block 1 | ... | block k-1 | block k (partial) |
             [ prefix-cache hit  ][ computed ][ new this step ][ free slots ]
             0            num_computed_tokens            + num_new_tokens
    blocks [0, num_cached_blocks) are registered in the prefix cache (full, hashes known)

A block is published to the prefix cache as soon as it is full of known tokens that are
scheduled, i.e. at schedule time, before the forward pass: two identical prompts admitted in the
same step share blocks (the worker writes a step's KV before its attention reads it).

Sliding window (every attention layer of the model sees the last W positions, Mistral v0.1):
the next query of a request sits at position c = num_computed_tokens (prefix hits included)
and every later one further on, so tokens before c - W + 1 are never read again. Whenever the
request gets new blocks, the blocks wholly before that are given back to the pool and their
place in the request's list is taken by the null block (0), so block indices still match
token positions and the workers' block tables need no change (the kernels never read those
entries):

    blocks:  [ null | null | block k | ... | block m (partial) ]
                            ^ holds position c - W + 1

A long request then holds about ceil(W / block_size) + 1 blocks. Freed blocks keep their hash
(they are full and published) and go to the free list's LRU end, so a later request with
the same prefix can still hit them until they are reused. The prefix lookup under a window
needs only the blocks the first computed query sees (vLLM's sliding-window hit): the longest
prefix whose last ceil((W - 1) / block_size) blocks are all cached (or which is cached whole)
hits, its earlier blocks taken as the null block, whether they were reused or not; the block
hashes chain over every earlier token, so such a hit is exact. A model with any global layer (Gemma 2/3 interleave them)
reads every block with one block table per request: nothing can be freed, `sliding_window`
is None (a hybrid allocator with a table per layer kind is not built).
"""

from __future__ import annotations

from typing import Sequence

from .block_pool import NONE_HASH, BlockPool, KVBlock, hash_request_blocks
from .request import Request


class KVCacheManager:
    """Allocates, publishes and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        """The window every attention layer shares, or None: blocks wholly before a request's
        next query's window are freed (see the module docstring)."""
        self.block_pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        """req_id -> the request's blocks, in token order."""
        self.num_cached_blocks: dict[str, int] = {}
        """req_id -> how many leading blocks of the request are published (hashed)."""

    # -- prefix cache -------------------------------------------------------------------------

    def ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend `request.block_hashes` to its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        start = len(hashes)
        if start >= num_blocks:
            return
        parent = hashes[-1] if hashes else NONE_HASH
        salt = request.cache_salt.encode() if request.cache_salt else b""
        if request.lora is not None:  # KV computed with an adapter is that adapter's alone
            salt += b"\x00lora\x00%d" % request.lora.lora_int_id
        hashes.extend(hash_request_blocks(request.all_token_ids, self.block_size, start, parent,
                                          num_blocks, salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix: blocks and their token count.

        Walks the chained block hashes from the first block and stops at the first miss. At
        most `num_tokens - 1` tokens can hit: the last token is always computed, for its
        logits (a block-aligned prompt of 32 tokens with block 16 hits 16, not 32).
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (len(request.all_token_ids) - 1) // self.block_size
        self.ensure_block_hashes(request, max_hit_blocks)
        if self.sliding_window is not None:
            hits = self._window_hits(request.block_hashes[:max_hit_blocks])
            return hits, len(hits) * self.block_size
        lookup = self.block_pool.cached.get
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: list[bytes]) -> list[KVBlock]:
        """Under a sliding window: the blocks of the longest prefix of `hashes` whose next
        query's window is cached, that is whose last `need` blocks are (or which is cached
        from its first block), the blocks before those as the null block."""
        need = max(1, -(-(self.sliding_window - 1) // self.block_size))
        lookup = self.block_pool.cached.get
        found = [lookup(block_hash) for block_hash in hashes]
        run = best = 0  # run: cached blocks ending at i
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            if run >= need or run == i + 1:
                best = i + 1
        start = max(0, best - need)
        return [self.block_pool.null_block] * start + found[start:best]

    # -- allocation ---------------------------------------------------------------------------

    def num_blocks_needed(self, request: Request, num_tokens: int,
                          new_computed_blocks: Sequence[KVBlock] = ()) -> int:
        """Free blocks an allocation covering `num_tokens` tokens in all would take: new
        blocks plus prefix hits that currently sit on the free list."""
        held = len(self.req_blocks.get(request.req_id, ()))
        num_new = -(-num_tokens // self.block_size) - held - len(new_computed_blocks)
        num_new_hits_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b.block_id)
        return max(num_new, 0) + num_new_hits_free

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (),
                       publish: bool = True) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (and after the
        prefix hits `new_computed_blocks`, which are attached first). Returns the ids of the
        blocks added to the request (hits included), or None without side effects when the
        free list is too short. `publish=False` defers publishing full blocks to the caller
        (`publish_full_blocks`), for a step that may still be rolled back."""
        req_id = request.req_id
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        pool = self.block_pool
        first_query = request.num_computed_tokens + num_hit_tokens
        self.free_out_of_window(req_id, request.num_computed_tokens)  # room for the new ones
        if num_new_blocks > 0 or new_computed_blocks:
            num_hits_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b.block_id)
            if max(num_new_blocks, 0) + num_hits_free > pool.free_queue.num_free:
                return None
        num_held = len(blocks)
        if new_computed_blocks:
            pool.touch(b for b in new_computed_blocks if b.block_id)  # not the window's nulls
            blocks.extend(new_computed_blocks)
            # hits are published already
            self.num_cached_blocks[req_id] = len(blocks)
        if num_new_blocks > 0:
            blocks.extend(pool.get_new_blocks(num_new_blocks))
        if new_computed_blocks:
            self.free_out_of_window(req_id, first_query)  # hits the next query cannot see
        if publish and self.enable_caching:
            self.publish_full_blocks(request, total)
        return [b.block_id for b in blocks[num_held:]]

    def free_out_of_window(self, req_id: str, first_query: int) -> None:
        """Under a sliding window, give back the request's blocks wholly before the window of
        its query at `first_query` (and so of every later one), tail first, putting the null
        block in their place. Nothing without a window."""
        window = self.sliding_window
        if window is None:
            return
        blocks = self.req_blocks.get(req_id)
        end = min(max(first_query - window + 1, 0) // self.block_size, len(blocks or ()))
        null = self.block_pool.null_block
        freed = []
        for i in range(end - 1, -1, -1):  # back to the first already freed one
            if blocks[i] is null:
                break
            freed.append(blocks[i])
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)

    def publish_full_blocks(self, request: Request, num_scheduled_tokens: int) -> None:
        """Register in the prefix cache every block full of known tokens among the first
        `num_scheduled_tokens` (computed or scheduled) tokens of the request."""
        req_id = request.req_id
        num_full = min(num_scheduled_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks[req_id]
        if num_full <= start:
            return
        self.ensure_block_hashes(request, num_full)
        blocks = self.req_blocks[req_id]
        hashes = request.block_hashes
        cache_block, null = self.block_pool.cache_block, self.block_pool.null_block
        for i in range(start, num_full):
            if blocks[i] is not null:  # freed out of the window before it was published
                cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks, tail first (its tail is evicted before its
        prefix, which other requests are more likely to share)."""
        blocks = self.req_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        if blocks:
            null = self.block_pool.null_block
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block ids in token order."""
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def num_free_blocks(self) -> int:
        return self.block_pool.free_queue.num_free

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def block_counts(self) -> tuple[int, int]:
        """(blocks held by requests, free blocks still holding a prefix-cache entry); for
        snapshots, not every step (the second walks the cache)."""
        pool = self.block_pool
        return pool.num_blocks - 1 - pool.num_free_blocks, pool.num_cached_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants plus: reference counts equal the number of holders."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                if block.block_id:  # the null block: a place freed out of the window
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block}: ref_cnt {block.ref_cnt} but held by {holders.get(block.block_id, 0)}")
        for req_id, blocks in self.req_blocks.items():
            held = [b for b in blocks if b.block_id != 0]
            assert len(set(id(b) for b in held)) == len(held), f"{req_id} holds a block twice"
            num_null = len(blocks) - len(held)
            assert all(b.block_id == 0 for b in blocks[:num_null]), (
                f"{req_id} holds the null block past its freed prefix")
            assert num_null == 0 or self.sliding_window is not None, (
                f"{req_id} holds the null block without a sliding window")
