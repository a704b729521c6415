"""Random paged-attention batches for the kernel tests (small shapes: Triton is interpreted).

A case is a packed batch in the layout of `tidal.kernels.attention.reference`. Every cache element no
request may read is NaN: unreferenced blocks (the null block 0 included) and the slots past
each request's `seq_len` in its last block, so a kernel that reads outside its range fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {
    # (atol, rtol) of kernel output vs the reference, per dtype. The reference accumulates in
    # float32 from the same inputs; bf16/fp16 errors come from rounding the softmax
    # probabilities to the cache dtype before P·V (as on tensor cores) and the final store.
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedCase:
    """One attention call's inputs (see `kernels/attention/reference.py` for the layouts)."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale)

    def owned_rows(self) -> slice:
        qsl = self.query_start_loc
        return slice(int(qsl[0]), int(qsl[-1]))


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_pad_tokens: int = 0,
    extra_table_cols: int = 1,
) -> PagedCase:
    """A batch whose request i has q_lens[i] new tokens and seq_lens[i] cached tokens in
    total; blocks are handed out in random order. `num_pad_tokens` query rows past the last
    request belong to nobody (a kernel must leave their output alone)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # null block + used + two never referenced
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + extra_table_cols,
                               dtype=torch.int32)
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids, order = order[:n], order[n:]
        block_tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        for j, block_id in enumerate(ids):
            used = min(block_size, seq_len - j * block_size)
            kv = torch.randn(2, used, num_kv_heads, head_dim, generator=gen).to(dtype)
            key_cache[block_id, :used], value_cache[block_id, :used] = kv[0], kv[1]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1] + num_pad_tokens, num_heads, head_dim, generator=gen)
    return PagedCase(
        query=query.to(dtype), key_cache=key_cache, value_cache=value_cache,
        block_tables=block_tables, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), scale=head_dim ** -0.5,
    )


def windowed(case: PagedCase, window: int) -> PagedCase:
    """The case with every block table entry wholly before its request's first visible
    position under a sliding `window` naming the null block 0 (all NaN), as the engine core's
    tables do once it has freed those blocks: a kernel that reads them fails."""
    tables = case.block_tables.clone()
    block_size = case.key_cache.shape[1]
    qsl = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        first = max(0, seq_len - (qsl[i + 1] - qsl[i]) - window + 1)
        tables[i, :first // block_size] = 0
    case.block_tables = tables
    return case


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A NaN-filled buffer shaped like `t`: every element a kernel fails to write stays NaN."""
    return torch.full_like(t, float("nan"))


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, owned: slice) -> None:
    """Owned rows equal within the dtype's tolerance; the rest stay NaN (unwritten)."""
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual[owned], expected[owned], atol=atol, rtol=rtol)
    untouched = torch.ones(actual.shape[0], dtype=torch.bool)
    untouched[owned] = False
    assert torch.isnan(actual[untouched]).all(), "kernel wrote rows no request owns"
