"""Benchmark the Triton attention kernels on a CUDA device.

    python benchmarks/attention_kernels.py [--dtype bfloat16] [--num-heads 32] [--num-kv-heads 8]
                                 [--head-dim 128] [--block-size 16] [--quick]

Times each kernel with CUDA events (median of many runs after warm-up, L2 flushed before each
run) for decode batches of 1-256 at 1k-32k context (the launch `paged_attention_triton`
chooses, and the plain one-pass launch where that choice was split-K), 2k-token prefills, and
KV writes. Decode and KV write are memory bound: their rows print achieved bandwidth (bytes the
kernel must move at least, over time) against the device's measured copy bandwidth. Prefill
rows print achieved FLOP/s against a measured dense matmul rate, with torch's
scaled_dot_product_attention on contiguous copies as a yardstick.

Needs CUDA: elsewhere it exits with a message and status 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

KIB = 1024
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (1 * KIB, 4 * KIB, 16 * KIB, 32 * KIB)
PREFILL_CASES = ((1, 2 * KIB, 0), (4, 2 * KIB, 0), (1, 2 * KIB, 6 * KIB))  # (seqs, q_len, ctx)
WRITE_KV_TOKENS = (64, 256, 2 * KIB, 8 * KIB)
TARGET = (64, 4 * KIB, 0.70)  # decode batch, context, share of copy bandwidth to reach
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class AttnShape:
    """One layer's attention geometry."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int


# ---- the size arithmetic (pure Python; checked by tests/kernels/test_kernels_benchmark.py) --


def kv_bytes(num_tokens: int, shape: AttnShape) -> int:
    """Bytes of K plus V for `num_tokens` cached tokens."""
    return 2 * num_tokens * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes


def attention_bytes(num_seqs: int, q_len: int, seq_len: int, shape: AttnShape) -> int:
    """Least bytes one attention call moves: every cached K/V once, query in, output out, the
    block tables (int32) and query_start_loc/seq_lens (int32)."""
    num_tokens = num_seqs * q_len
    q_and_out = 2 * num_tokens * shape.num_heads * shape.head_dim * shape.dtype_bytes
    num_blocks = -(-seq_len // shape.block_size)
    metadata = 4 * (num_seqs * num_blocks + 2 * num_seqs + 1)
    return num_seqs * kv_bytes(seq_len, shape) + q_and_out + metadata


def attention_flops(num_seqs: int, q_len: int, seq_len: int, shape: AttnShape) -> int:
    """Useful FLOPs of causal attention: 4·head_dim per (query, visible key) pair per head
    (2 for Q·K, 2 for P·V). New token j of a request sees seq_len - q_len + j + 1 keys."""
    ctx_len = seq_len - q_len
    pairs = q_len * (ctx_len + 1) + q_len * (q_len - 1) // 2
    return 4 * shape.head_dim * shape.num_heads * num_seqs * pairs


def write_kv_bytes(num_tokens: int, shape: AttnShape) -> int:
    """K and V read once and written once, plus the int64 slot mapping."""
    return 2 * kv_bytes(num_tokens, shape) + 8 * num_tokens


def kv_cache_gib(num_seqs: int, seq_len: int, shape: AttnShape) -> float:
    """Cache memory a case allocates (whole blocks, plus the null block)."""
    num_blocks = num_seqs * -(-seq_len // shape.block_size) + 1
    return kv_bytes(num_blocks * shape.block_size, shape) / 2**30


# ---- timing -------------------------------------------------------------------------------


class Timer:
    """Median CUDA-event time of a callable; flushes L2 before each run so small working sets
    are not served from cache."""

    def __init__(self, warmup: int = 10, iters: int = 50):
        self.warmup = warmup
        self.iters = iters
        self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self._flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def measure_copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy rate in bytes/s (read + write) over 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def measure_matmul_flops(timer: Timer, dtype: torch.dtype) -> float:
    """Dense 8192³ matmul rate in FLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = timer.median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


# ---- cases --------------------------------------------------------------------------------


def make_batch(num_seqs: int, q_len: int, seq_len: int, shape: AttnShape, dtype):
    """A packed attention batch with every request at `seq_len` tokens, blocks shuffled."""
    blocks_per_seq = -(-seq_len // shape.block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
    value_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
    order = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32) + 1
    block_tables = order.view(num_seqs, blocks_per_seq)
    query = torch.randn(num_seqs * q_len, shape.num_heads, shape.head_dim, device="cuda",
                        dtype=dtype)
    query_start_loc = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    return (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
            shape.head_dim ** -0.5)


def bench_decode(timer, shape, dtype, copy_bw, max_kv_gib, contexts, batches) -> list[dict]:
    from tidal.kernels.attention import triton_attention as ta

    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seq_len in contexts:
        for batch in batches:
            if kv_cache_gib(batch, seq_len, shape) > max_kv_gib:
                rows.append(dict(kernel="decode", batch=batch, ctx=seq_len, note="skipped"))
                continue
            args = make_batch(batch, 1, seq_len, shape, dtype)
            out = torch.empty_like(args[0])
            auto = ta.choose_launch(batch, batch, shape.num_heads, shape.num_kv_heads,
                                    shape.head_dim, args[3].shape[1] * shape.block_size,
                                    num_sms, dtype)
            launches = [auto]
            if auto.num_splits > 1:
                launches.append(ta.AttentionLaunch(auto.block_m, auto.tile_n, 1,
                                                   auto.num_warps, auto.num_stages))
            for launch in launches:
                ms = timer.median_ms(lambda: ta.run_paged_attention(*args, out, launch))
                nbytes = attention_bytes(batch, 1, seq_len, shape)
                rows.append(dict(kernel="decode", batch=batch, ctx=seq_len,
                                 splits=launch.num_splits, ms=ms, gbs=nbytes / ms / 1e6,
                                 pct=nbytes / (ms * 1e-3) / copy_bw))
            del args, out
            torch.cuda.empty_cache()
    return rows


def bench_prefill(timer, shape, dtype, matmul_rate, cases) -> list[dict]:
    import torch.nn.functional as F

    from tidal.kernels.attention.triton_attention import paged_attention_triton

    rows = []
    group = shape.num_heads // shape.num_kv_heads
    for num_seqs, q_len, ctx_len in cases:
        seq_len = ctx_len + q_len
        args = make_batch(num_seqs, q_len, seq_len, shape, dtype)
        out = torch.empty_like(args[0])
        flops = attention_flops(num_seqs, q_len, seq_len, shape)
        ms = timer.median_ms(lambda: paged_attention_triton(*args, out=out))
        rows.append(dict(kernel="prefill", batch=num_seqs, ctx=seq_len, q_len=q_len, ms=ms,
                         tflops=flops / ms / 1e9, pct=flops / (ms * 1e-3) / matmul_rate))
        if ctx_len == 0:  # yardstick: torch SDPA (flash) on contiguous copies
            q = args[0].view(num_seqs, q_len, shape.num_heads, shape.head_dim).transpose(1, 2)
            kv = torch.randn(num_seqs, shape.num_kv_heads * group, q_len, shape.head_dim,
                             device="cuda", dtype=dtype)
            ms = timer.median_ms(lambda: F.scaled_dot_product_attention(q, kv, kv,
                                                                        is_causal=True))
            rows.append(dict(kernel="sdpa", batch=num_seqs, ctx=seq_len, q_len=q_len, ms=ms,
                             tflops=flops / ms / 1e9, pct=flops / (ms * 1e-3) / matmul_rate))
    return rows


def bench_write_kv(timer, shape, dtype, copy_bw, token_counts) -> list[dict]:
    from tidal.kernels.attention.triton_attention import write_kv_triton

    rows = []
    for num_tokens in token_counts:
        num_blocks = -(-num_tokens // shape.block_size) * 2 + 1
        cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        key_cache = torch.empty(cache_shape, device="cuda", dtype=dtype)
        value_cache = torch.empty_like(key_cache)
        key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, device="cuda",
                          dtype=dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * shape.block_size, device="cuda")[:num_tokens]
        ms = timer.median_ms(lambda: write_kv_triton(key, value, key_cache, value_cache, slots))
        nbytes = write_kv_bytes(num_tokens, shape)
        rows.append(dict(kernel="write_kv", batch=num_tokens, ms=ms, gbs=nbytes / ms / 1e6,
                         pct=nbytes / (ms * 1e-3) / copy_bw))
    return rows


# ---- report -------------------------------------------------------------------------------


def format_row(row: dict) -> str:
    """One table line: kernel, batch (tokens for write_kv), context, split-K depth, time,
    achieved rate and its share of the measured ceiling."""
    if row.get("note"):
        return f"{row['kernel']:<9}{row['batch']:>7}{row['ctx']:>8}   {row['note']}"
    rate = (f"{row['tflops']:9.1f} TFLOP/s" if "tflops" in row
            else f"{row['gbs']:9.0f} GB/s    ")
    return (f"{row['kernel']:<9}{row['batch']:>7}{row.get('ctx', 0):>8}"
            f"{row.get('splits', 1):>7}{row['ms'] * 1e3:>11.1f}{rate}{100 * row['pct']:>8.1f}%")


def target_verdict(rows: list[dict]) -> str:
    """Whether the auto launch reached TARGET's share of copy bandwidth."""
    batch, ctx, share = TARGET
    hits = [r for r in rows if r["kernel"] == "decode" and r["batch"] == batch
            and r["ctx"] == ctx and "pct" in r]
    if not hits:
        return f"target (decode {batch} x {ctx}): not measured"
    pct = hits[0]["pct"]
    verdict = "met" if pct >= share else "NOT met"
    return (f"target: decode batch {batch} at {ctx} context reaches {100 * pct:.1f}% of copy "
            f"bandwidth (goal {100 * share:.0f}%): {verdict}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-kv-gib", type=float, default=40.0,
                        help="skip decode cases whose KV cache would exceed this")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per case")
    parser.add_argument("--quick", action="store_true",
                        help="decode at batch 1/64 x 4k/32k, one prefill, two KV writes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_kernels.py needs a CUDA device: torch.cuda.is_available() "
                         "is False here, nothing was timed.")
    dtype = DTYPES[args.dtype]
    shape = AttnShape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                      torch.tensor([], dtype=dtype).element_size())
    timer = Timer(iters=args.iters)
    copy_bw = measure_copy_bandwidth(timer)
    matmul_rate = measure_matmul_flops(timer, dtype)
    print(f"device: {torch.cuda.get_device_name(0)}  dtype: {args.dtype}  heads "
          f"{shape.num_heads}/{shape.num_kv_heads} x {shape.head_dim}, block {shape.block_size}")
    print(f"measured copy bandwidth {copy_bw / 1e9:.0f} GB/s, {args.dtype} matmul "
          f"{matmul_rate / 1e12:.0f} TFLOP/s")
    contexts = (4 * KIB, 32 * KIB) if args.quick else DECODE_CONTEXTS
    batches = (1, 64) if args.quick else DECODE_BATCHES
    rows = bench_decode(timer, shape, dtype, copy_bw, args.max_kv_gib, contexts, batches)
    rows += bench_prefill(timer, shape, dtype, matmul_rate,
                          PREFILL_CASES[:1] if args.quick else PREFILL_CASES)
    rows += bench_write_kv(timer, shape, dtype, copy_bw,
                           WRITE_KV_TOKENS[1:3] if args.quick else WRITE_KV_TOKENS)
    print(f"{'kernel':<9}{'batch':>7}{'ctx':>8}{'splits':>7}{'time us':>11}"
          f"{'achieved':>17}{'of peak':>9}")
    for row in rows:
        print(format_row(row))
    print(target_verdict(rows))


if __name__ == "__main__":
    sys.exit(main())
