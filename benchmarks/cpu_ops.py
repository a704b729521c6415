"""Two `cpu_kernels` choices on the same decode steps, interleaved in one process.

    python benchmarks/cpu_ops.py MODEL_DIR [--a auto] [--b auto,no-fused] [--batch 1 4 8 16]
                                 [--context 256] [--rounds 8] [--steps 5] [--threads 2]

Loads MODEL_DIR twice into in-process `Worker`s (no daemon, no sockets), one with each choice
(`kernels/cpu/ops.py`), prefills `--batch` requests of `--context` tokens in each, then times
decode steps (inputs, forward, LM head, greedy sampling) in `--rounds` rounds, each round
`--steps` steps of A then of B (the order alternating between rounds), so drift in a shared
machine's speed falls on both. Prints each worker's start-up line, then per batch the median
step of each round, the medians and bests over rounds, and the median over rounds of B / A
(each round's pair ran back to back, so a busy spell on a shared machine skews few ratios).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from tidal.engine_core.cpu_threads import with_shared_openmp

# one OpenMP runtime for torch and the C kernels, as the executor gives a worker process
# (benchmarks/step_profile.py says why); the loader reads LD_LIBRARY_PATH only at start
_ENV = with_shared_openmp(dict(os.environ))
if _ENV.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH"):
    os.execve(sys.executable, [sys.executable, *sys.argv], _ENV)

import torch  # noqa: E402

from tidal.engine_core.config import (CacheConfig, EngineConfig, ModelConfig,  # noqa: E402
                                      ParallelConfig, SchedulerConfig)
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData
from tidal.workers.host_memory import keep_freed_memory  # noqa: E402
from tidal.workers.worker import Worker  # noqa: E402

BLOCK_SIZE = 16


class Decoder:
    """One worker with `batch` requests of `context` tokens prefilled, stepping them."""

    def __init__(self, model: str, cpu_kernels: str, batch: int, context: int, steps: int):
        self.context, self.step_id, self.done = context, 0, 0
        per_req = -(-(context + steps + 1) // BLOCK_SIZE)
        config = EngineConfig(
            ModelConfig(model, dtype="float32"),
            CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks_override=batch * per_req + 2),
            SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, context)),
            ParallelConfig(device="cpu", cpu_kernels=cpu_kernels))
        self.worker = Worker(config.worker_config(0, context + steps + 1, ""))
        self.worker.load()
        self.worker.init_kv_cache(self.worker.determine_num_kv_blocks())
        g = torch.Generator().manual_seed(0)
        sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
        self.ids = [f"d{i}" for i in range(batch)]
        for i, req_id in enumerate(self.ids):  # one prefill a step
            tokens = torch.randint(3, 1000, (context,), generator=g).tolist()
            blocks = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
            self._run(new_requests=[NewRequestData(req_id, pack_token_ids(tokens), context,
                                                   blocks, 0, context, sampling)])

    def _run(self, **fields) -> float:
        self.step_id += 1
        start = time.perf_counter()
        self.worker.execute(BatchPlan(self.step_id, **fields))
        return time.perf_counter() - start

    def step(self) -> float:
        """One decode step of every request."""
        computed = self.context + self.done
        self.done += 1
        return self._run(cached_requests=[CachedRequestData(r, [], computed, 1)
                                          for r in self.ids])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--a", default="auto", help="cpu_kernels of A")
    ap.add_argument("--b", default="auto,no-fused", help="cpu_kernels of B")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="decode steps a round")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    keep_freed_memory()  # as the worker process does
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for handler in logging.getLogger().handlers:  # the start-up lines of the CPU ops only
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or "CPU ops (" in r.getMessage())
    print(f"model {a.model}, {a.threads} threads, context {a.context}, {a.rounds} rounds of "
          f"{a.steps} steps; A: cpu_kernels={a.a}, B: cpu_kernels={a.b}", flush=True)
    for batch in a.batch:
        pair = [Decoder(a.model, spec, batch, a.context, a.rounds * a.steps + a.steps)
                for spec in (a.a, a.b)]
        for d in pair:
            d.step()  # warm-up
        rounds: list[list[float]] = [[], []]
        for r in range(a.rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                rounds[which].append(statistics.median(pair[which].step()
                                                       for _ in range(a.steps)))
        ms = [[round(t * 1e3, 1) for t in times] for times in rounds]
        med = [statistics.median(times) * 1e3 for times in rounds]
        ratio = statistics.median(b / a for a, b in zip(*rounds))
        print(f"batch {batch:3d}: median A {med[0]:7.2f} ms  B {med[1]:7.2f} ms, best A "
              f"{min(ms[0]):.1f} B {min(ms[1]):.1f}; B/A median of the rounds' {ratio:.2f}"
              f"   rounds A {ms[0]}  B {ms[1]}", flush=True)
        for d in pair:
            d.worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
