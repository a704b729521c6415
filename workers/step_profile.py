"""The measuring side of `tidal tune profile`: one `Worker` in this process times random step
shapes for about --duration seconds and writes what it ran and how long each shape took.

    python -m tidal.workers.step_profile --config B64 --duration S [--seed N] --output FILE

started by the step profile's parent (`engine_core/advice/profile.py`, which never imports
torch) with the environment a serving worker gets (OMP threads, wait policy, core mask) and
the msgpack-encoded `WorkerConfig` of rank 0. FILE gets JSON: `{"samples": [...], "facts":
{...}}`, one sample per shape, each with its first measured step's plan entries as
`[num_computed_tokens, num_scheduled_tokens, count]` (the parent prices them with the step
cost model's features, so the features are defined in one place), the median and least
seconds over its measured steps, their number and the shape; the facts say what ran (device,
dtype, threads, KV block bytes and count, block size, attention backend).

A shape is (D decode requests of C context tokens each, M prefill chunks of P tokens after S
tokens already cached). A visit brings the D decodes into the worker's persistent batch in an
unmeasured step (claimed as cached, so they cost no prefill), then `REPEATS` measured steps run
them as cached requests (one token each) together with M fresh P-token prefill requests. Up to
`MAX_SHAPES` shapes are drawn in the first half of the time and all are visited again in turn
until it is up; a shape's time is the median of all its measured steps. Load from other
processes comes in bursts longer than a visit, so visits spread over the whole run see the
machine as it is, neither one lucky moment nor one burst (the least and the median differed
by up to 2x on the shared machine this was written on; the file keeps both). Step time is
the worker's `execute` in-process: inputs, forward, LM head, sampling (greedy).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from collections import Counter

import numpy as np

from ..ipc.messages import SamplingParams, pack_token_ids
from ..ipc.transport import decode_worker_config
from ..ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData

REPEATS = 2
"""Measured steps per visit of a shape."""
MIN_SHAPES, MAX_SHAPES = 12, 60
"""Shapes measured (at least, at most)."""


class _Shapes:
    """Random step shapes within the worker's limits and its KV cache."""

    DECODES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    PREFILLS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    CHUNKS = (1, 1, 2, 4, 8)
    """Prefill chunks (requests) in one step: several reach budgets past max_model_len."""

    def __init__(self, config, num_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.block_size = config.block_size
        self.max_len = config.max_model_len
        self.max_tokens = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.decodes = [d for d in self.DECODES if d <= config.max_num_seqs]
        self.num_blocks = num_blocks - 1  # block 0 is the null block

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def draw(self) -> tuple[int, int, int, int, int]:
        """(decodes, their context, prefill tokens per chunk, prefill offset, prefill chunks)
        that fit the step budget, max_num_seqs, the context length and the KV cache."""
        while True:
            d = self.rng.choice(self.decodes)
            m = self.rng.choice(self.CHUNKS)
            p = self.rng.choice([p for p in self.PREFILLS if p < self.max_len])
            if p == 0:
                m = 0
            if (d == 0 and p == 0) or d + m > self.max_seqs or d + m * p > self.max_tokens:
                continue
            c = int(round(2 ** self.rng.uniform(4, np.log2(max(self.max_len - REPEATS - 2,
                                                                  17)))))
            s = 0 if p == 0 or self.rng.random() < 0.5 else self.rng.randrange(
                0, max(1, self.max_len - p))
            need = d * self.blocks_for(c + REPEATS + 2) + m * self.blocks_for(s + p)
            if need <= self.num_blocks:
                return d, c, p, s, m


def plan_entries(plan: BatchPlan) -> list[list[int]]:
    """`[num_computed_tokens, num_scheduled_tokens, count]` of the plan's requests: what the
    step cost model's features are computed from."""
    counts = Counter((e.num_computed_tokens, e.num_scheduled_tokens)
                     for entries in (plan.new_requests, plan.cached_requests) for e in entries)
    return [[computed, scheduled, count] for (computed, scheduled), count in sorted(counts.items())]


class _ShapeRunner:
    """Runs one visit of a shape on the worker: an unmeasured step that brings its decodes
    into the persistent batch (and drops the previous visit's requests), then `REPEATS`
    measured steps."""

    def __init__(self, worker, shapes: _Shapes, seed: int) -> None:
        self.worker = worker
        self.shapes = shapes
        self.vocab = min(worker.args.vocab_size, 1000)
        self.rng = random.Random(seed + 1)
        self.sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
        self.step_id = 0
        self.visit = 0
        self.pending_finished: list[str] = []

    def _tokens(self, n: int) -> bytes:
        return pack_token_ids([self.rng.randrange(3, self.vocab) for _ in range(n)])

    def _execute(self, plan) -> float:
        start = time.perf_counter()
        self.worker.execute(plan)
        return time.perf_counter() - start

    def run(self, shape: tuple[int, int, int, int, int]) -> tuple[list[float], list]:
        """(seconds of each measured step, the first measured step's `plan_entries`)."""
        d, c, p, s, m = shape
        self.visit += 1
        tag = f"v{self.visit}"
        blocks_each = self.shapes.blocks_for(c + REPEATS + 2)
        decodes = [NewRequestData(f"{tag}d{i}", self._tokens(c + 1), c + 1,
                                  list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
                                  c, 1, self.sampling) for i in range(d)]
        first, prefill_each = 1 + d * blocks_each, self.shapes.blocks_for(s + p)
        prefill_blocks = [list(range(first + j * prefill_each, first + (j + 1) * prefill_each))
                          for j in range(m)]
        self.step_id += 1
        self.worker.execute(BatchPlan(self.step_id, new_requests=decodes,
                                      finished_req_ids=self.pending_finished,
                                      total_num_scheduled_tokens=d))
        self.pending_finished = [r.req_id for r in decodes]
        times, entries, previous = [], None, []
        for rep in range(REPEATS):
            new = [NewRequestData(f"{tag}p{rep}.{j}", self._tokens(s + p), s + p,
                                  prefill_blocks[j], s, p, self.sampling) for j in range(m)]
            cached = [CachedRequestData(r.req_id, [], c + 1 + rep, 1) for r in decodes]
            self.step_id += 1
            plan = BatchPlan(self.step_id, new_requests=new, cached_requests=cached,
                             finished_req_ids=previous, total_num_scheduled_tokens=d + m * p)
            times.append(self._execute(plan))
            entries = entries or plan_entries(plan)
            previous = [r.req_id for r in new]
        self.pending_finished += previous
        return times, entries

    def finish(self) -> None:
        self.step_id += 1
        self.worker.execute(BatchPlan(self.step_id, finished_req_ids=self.pending_finished))


def measure(worker, duration_s: float, seed: int) -> list[dict]:
    """Time step shapes for about `duration_s` seconds; one sample per shape.

    Shapes are drawn during the first half of the time (at most `MAX_SHAPES`), then visited
    again in turn until the time is up; a shape's time is the median of all its measured
    steps (see the module docstring)."""
    runner = _ShapeRunner(worker, _Shapes(worker.config, worker.num_kv_blocks, seed), seed)
    for _ in range(3):  # warm-up: first runs of each code path
        runner.run(runner.shapes.draw())
    shapes: list[tuple] = []
    times: list[list[float]] = []
    entries: list[list] = []
    start = time.perf_counter()
    turn = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= duration_s and len(shapes) >= MIN_SHAPES:
            break
        if len(shapes) < MAX_SHAPES and (elapsed < duration_s / 2 or len(shapes) < MIN_SHAPES):
            shapes.append(runner.shapes.draw())
            times.append([])
            entries.append([])
            i = len(shapes) - 1
        else:
            i = turn % len(shapes)
            turn += 1
        step_times, entries[i] = runner.run(shapes[i])
        times[i] += step_times
    runner.finish()
    return [{"entries": e, "seconds": statistics.median(t), "min_seconds": min(t),
             "num_steps": len(t), "shape": list(shape)}
            for shape, t, e in zip(shapes, times, entries)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tidal tune profile: the measuring worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    config = decode_worker_config(args.config)
    if config.cpu_cores:
        os.sched_setaffinity(0, config.cpu_cores)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s [tidal tune profile] %(message)s")
    import torch

    from .worker import Worker

    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    worker = Worker(config)
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    print(f"profiling {config.model} on {worker.device} ({worker.dtype}, "
          f"{torch.get_num_threads()} threads) for {args.duration:g} s ...", flush=True)
    samples = measure(worker, args.duration, args.seed)
    facts = {"model": config.model, "device": str(worker.device),
             "dtype": str(worker.dtype).replace("torch.", ""),
             "threads": torch.get_num_threads(),
             "kv_block_bytes": worker.runner.kv_block_bytes,
             "num_kv_blocks": worker.num_kv_blocks, "block_size": config.block_size,
             "attention_backend": worker.runner.attention_backend.name}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"samples": samples, "facts": facts}, f)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
