"""What a sliding window saves in the CPU attention backends: one layer's decode step and one
prefill chunk over long contexts, full attention against a window, per backend.

    python benchmarks/sliding_window_attention.py [--requests 16] [--context 4096]
                                                  [--window 512] [--chunk 256] [--iters 10]

SmolLM2-135M's geometry (9 query heads over 3 KV heads of 64), float32, blocks of 16 handed
out in random order. A windowed layer reads only the blocks from the one that holds its
window's first position, so its time should follow the window, not the context. Prints the
median milliseconds of `attend` (after one warm-up call) and full / window.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidal.kernels.attention import select_attention_backend
from tidal.kernels.attention.metadata import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def batch(num_requests: int, context: int, q_len: int):
    """num_requests requests of `context` cached tokens, q_len new each: (query, caches,
    metadata)."""
    blocks_each = -(-context // BLOCK)
    num_blocks = 1 + num_requests * blocks_each
    gen = torch.Generator().manual_seed(0)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    tables = order.view(num_requests, blocks_each)
    cache = [torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)]
    query = torch.randn(num_requests * q_len, HEADS, HEAD_DIM, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_requests * q_len,), -1, dtype=torch.int64),
        block_tables=tables,
        query_start_loc=torch.arange(0, num_requests * q_len + 1, q_len, dtype=torch.int32),
        seq_lens=torch.full((num_requests,), context, dtype=torch.int32))
    return query, cache, meta


def median_ms(backend, query, cache, meta, window, iters: int) -> float:
    stored = [backend.kv_cache(*c.shape, c.dtype, c.device).copy_(c) for c in cache]
    plan = backend.prepare(meta, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    call = lambda: backend.attend(query, *stored, meta, plan, HEAD_DIM ** -0.5,
                                  sliding_window=window)
    call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk's new tokens")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    print(f"{args.requests} decodes / one {args.chunk}-token chunk over {args.context} "
          f"positions, window {args.window}, {torch.get_num_threads()} threads")
    for name in ("cpu", "numba", "torch"):
        try:
            backend = select_attention_backend(name, "cpu", torch.float32)
        except ValueError as e:
            print(f"{name:6s} unavailable: {e}")
            continue
        backend.warm_up(torch.float32)
        for what, (n, q_len) in (("decode", (args.requests, 1)), ("prefill", (1, args.chunk))):
            query, cache, meta = batch(n, args.context, q_len)
            full = median_ms(backend, query, cache, meta, None, args.iters)
            windowed = median_ms(backend, query, cache, meta, args.window, args.iters)
            print(f"{name:6s} {what:8s} full {full:8.2f} ms   window {windowed:8.2f} ms   "
                  f"{full / windowed:5.1f}x")


if __name__ == "__main__":
    main()
