"""What an int8 KV cache buys on the CPU, against float32: blocks per GiB, preemptions and
throughput at a tight `--kv-cache-memory`, and the decode step's attention over long contexts.

    python benchmarks/kv_dtype_capacity.py [--model DIR] [--kv-cache-memory 24MiB]
        [--requests 32] [--prompt 256] [--output 64] [--context 4096] [--decodes 8]
        [--iters 7] [--skip-engine] [--skip-attention]

1. blocks per GiB: the model runner's sizing (`AttentionBackend.kv_bytes_per_token_head`) for
   SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, blocks of 16).
2. engine: `LLM.generate` of --requests random-token prompts of --prompt tokens, --output
   greedy tokens each (ignore_eos), all at once, under --kv-cache-memory, once per cache
   dtype: KV blocks, preemptions, output tokens/s.
3. attention: one layer's decode step (--decodes requests x --context cached positions,
   SmolLM2's heads) through the attention backend `auto` picks for each cache dtype, float32
   and int8 alternating, median of --iters after a warm-up; the caches of 30 layers are
   cycled so each call reads from memory, as in a real step.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from tidal.kernels.attention import select_attention_backend
from tidal.kernels.attention.metadata import AttentionMetadata

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
DEFAULT_MODEL = os.path.expanduser("~/.cache/tidal-peers/models/smollm2-135m-instruct")
GIB = 2**30


def blocks_per_gib() -> None:
    print("1. KV blocks per GiB (SmolLM2-135M: 30 layers, 3 KV heads of 64, 16 tokens a block)")
    base = None
    for dtype, kv in ((torch.float32, "auto"), (torch.bfloat16, "auto"),
                      (torch.float32, "int8")):
        backend = select_attention_backend("torch", "cpu", dtype, kv)
        block = 2 * LAYERS * BLOCK * KV_HEADS * backend.kv_bytes_per_token_head(HEAD_DIM, dtype)
        blocks = GIB // block
        base = base or blocks
        name = str(dtype).replace("torch.", "") if kv == "auto" else kv
        print(f"   {name:<9} {block:>7} bytes a block  {blocks:>6} blocks/GiB  "
              f"{blocks * BLOCK:>7} tokens/GiB  {blocks / base:.2f}x")


def engine(args) -> None:
    from tidal.frontend.llm import LLM
    from tidal.ipc.messages import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    print(f"2. engine: {args.requests} requests x {args.prompt} prompt + {args.output} output "
          f"tokens at once, --kv-cache-memory {args.kv_cache_memory}")
    for kv in ("auto", "int8"):
        with LLM(args.model, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
                 max_model_len=args.prompt + args.output, startup_timeout=600) as llm:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            stats = llm.get_stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(f"   {kv:<5} {llm.engine_info.num_kv_blocks:>5} blocks  "
                  f"{stats.num_preemptions:>4} preemptions  {tokens / seconds:7.1f} output "
                  f"tok/s  ({seconds:.1f} s)")


def decode_batch(context: int, decodes: int, kv: str, backend):
    blocks_each = -(-context // BLOCK)
    num_blocks = 1 + decodes * blocks_each
    gen = torch.Generator().manual_seed(0)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    tables = tables.view(decodes, blocks_each)
    layers = []
    for _ in range(LAYERS):
        caches = [backend.kv_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.float32,
                                   torch.device("cpu")) for _ in range(2)]
        if kv == "auto":
            for c in caches:
                c.copy_(torch.randn(c.shape, generator=gen))
            layers.append((*caches, None))
        else:
            scales = [backend.kv_scales(num_blocks, BLOCK, KV_HEADS, torch.device("cpu"))
                      for _ in range(2)]
            for c, s in zip(caches, scales):
                c.copy_(torch.randint(-127, 128, c.shape, generator=gen, dtype=torch.int8))
                s.fill_(0.01)
            layers.append((*caches, tuple(scales)))
    query = torch.randn(decodes, HEADS, HEAD_DIM, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((decodes,), -1, dtype=torch.int64), block_tables=tables,
        query_start_loc=torch.arange(decodes + 1, dtype=torch.int32),
        seq_lens=torch.full((decodes,), context, dtype=torch.int32))
    return query, layers, meta


def attention(args) -> None:
    print(f"3. decode attention: {args.decodes} requests x {args.context} positions, one layer "
          f"(30 layers' caches in turn), median of {args.iters}; {torch.get_num_threads()} "
          f"threads")
    runs = {}
    for kv in ("auto", "int8"):
        backend = select_attention_backend("auto", "cpu", torch.float32, kv)
        backend.warm_up(torch.float32)
        query, layers, meta = decode_batch(args.context, args.decodes, kv, backend)
        plan = backend.prepare(meta, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
        runs[kv] = (backend, query, layers, meta, plan, [])
    scale = HEAD_DIM ** -0.5
    for i in range(args.iters + 1):
        for kv, (backend, query, layers, meta, plan, times) in runs.items():  # alternating
            start = time.perf_counter()
            for k, v, scales in layers:
                backend.attend(query, k, v, meta, plan, scale, kv_scales=scales)
            if i:
                times.append((time.perf_counter() - start) / len(layers))
    medians = {kv: statistics.median(r[5]) * 1e3 for kv, r in runs.items()}
    for kv, (backend, *_rest) in runs.items():
        name = "float32" if kv == "auto" else kv
        print(f"   {name:<8} ({backend.name} backend) {medians[kv]:.3f} ms a layer  "
              f"{medians[kv] / medians['auto']:.2f}x float32's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-cache-memory", default="24MiB")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    args = parser.parse_args()
    blocks_per_gib()
    if not args.skip_attention:
        attention(args)
    if not args.skip_engine:
        engine(args)


if __name__ == "__main__":
    main()
