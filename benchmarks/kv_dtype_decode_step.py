"""The whole decode step over long contexts, int8 KV cache against float32: SmolLM2-135M in two
in-process `Worker`s (no daemon, no sockets), one per cache dtype, steps alternating.

    python benchmarks/kv_dtype_decode_step.py [--model DIR] [--batch 8]
        [--contexts 512 2048 4096] [--steps 7] [--threads 2] [--with-numba]

For each context: --batch requests that already hold `context` cached positions (the plan
says they are cached, as a prefix-cache hit would: no prefill is run, the cache's contents do
not change the work), then --steps decode steps of one token per request (inputs, 30 layers,
LM head, greedy sampling), float32 and int8 alternating step by step so that a shared
machine's drift hits both alike; the median of each, and int8's over float32's.

Which kernels run (`attention_backend auto`, float32 compute): float32 decodes in the `cpu`
backend's C row kernel (kernels/attention/decode_attention.c) inside the fused decoder layers;
int8 in its int8 row kernel (`tidal_decode_attention_int8`: int8 rows widened to float a tile
of positions at a time) and written by `tidal_write_kv_int8`, without the fused layers (they
read float32 caches only). `--with-numba` adds a third worker, int8 through the `numba`
backend (numba's kernel, which the cpu backend used for int8 before the C one), to the same
alternation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tidal.engine_core.cpu_threads import with_shared_openmp

# one OpenMP runtime for torch and numba, as the worker process gets (benchmarks/step_profile.py)
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
DEFAULT_MODEL = os.path.expanduser("~/.cache/tidal-peers/models/smollm2-135m-instruct")


class DecodeBench:
    """One Worker with a `kv_cache_dtype` cache, holding --batch requests at a context."""

    def __init__(self, model: str, kv_cache_dtype: str, args, attention_backend: str = "auto"):
        self.args = args
        self.max_len = max(args.contexts) + args.steps + 1
        self.per_request = -(-self.max_len // BLOCK_SIZE)
        config = EngineConfig(
            ModelConfig(model, dtype="float32"),
            CacheConfig(block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype,
                        num_kv_blocks_override=1 + args.batch * self.per_request),
            SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.batch),
            ParallelConfig(device="cpu", attention_backend=attention_backend))
        self.worker = Worker(config.worker_config(0, self.max_len, ""))
        self.worker.load()
        self.worker.init_kv_cache(self.worker.determine_num_kv_blocks())
        # every page of the cache resident (2 MB pages where the kernel has them) before any
        # step is timed, as in a worker that has been idle once: otherwise the commit thread
        # runs beside the steps (a third thread on two cores) and steps read never-touched
        # pages, all one shared zero page, until it has been past them
        commit = getattr(self.worker.runner, "kv_commit", None)
        if commit is not None:
            commit.join()
        self.backend = self.worker.runner.attention_backend.name
        self.step_id = 0
        self.req_ids: list[str] = []
        self.context = 0

    def _run(self, **fields) -> float:
        self.step_id += 1
        start = time.perf_counter()
        self.worker.execute(BatchPlan(self.step_id, **fields))
        return time.perf_counter() - start

    def start(self, context: int) -> None:
        """Drop the previous requests; add --batch whose first `context - 1` positions the plan
        marks cached, and compute the last prompt position (so each has a sampled token)."""
        if self.req_ids:
            self._run(finished_req_ids=self.req_ids)
        g = torch.Generator().manual_seed(context)
        sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
        new = []
        for i in range(self.args.batch):
            tokens = torch.randint(3, 1000, (context,), generator=g).tolist()
            blocks = list(range(1 + i * self.per_request, 1 + (i + 1) * self.per_request))
            new.append(NewRequestData(f"c{context}-{i}", pack_token_ids(tokens), context,
                                      blocks, context - 1, 1, sampling))
        self._run(new_requests=new)
        self.req_ids = [r.req_id for r in new]
        self.context = context

    def decode_step(self) -> float:
        cached = [CachedRequestData(r, [], self.context, 1) for r in self.req_ids]
        seconds = self._run(cached_requests=cached)
        self.context += 1
        return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--steps", type=int, default=7, help="decode steps timed, each dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--with-numba", action="store_true",
                    help="a third worker: int8 through the numba backend's kernel")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    keep_freed_memory()  # as the worker process does
    benches = {kv: DecodeBench(a.model, kv, a) for kv in ("auto", "int8")}
    if a.with_numba:
        benches["int8 numba"] = DecodeBench(a.model, "int8", a, "numba")
    print(f"decode step of SmolLM2-135M, batch {a.batch}, float32 compute, {a.threads} threads; "
          f"median of {a.steps} steps each, {', '.join(benches)} alternating")
    numba_columns = (" int8 KV, numba backend ms | its / float32 |" if a.with_numba else "")
    print("| context | float32 KV ms (backend) | int8 KV ms (backend) | int8 / float32 |"
          + numba_columns)
    print("| --- " * (4 + 2 * a.with_numba) + "|")
    for context in a.contexts:
        times: dict[str, list[float]] = {kv: [] for kv in benches}
        for bench in benches.values():
            bench.start(context)
            bench.decode_step()  # warm-up: the first decode at this batch shape
        for _ in range(a.steps):
            for kv, bench in benches.items():
                times[kv].append(bench.decode_step())
        ms = {kv: statistics.median(t) * 1e3 for kv, t in times.items()}
        print(f"| {context} | {ms['auto']:.1f} ({benches['auto'].backend}) | "
              f"{ms['int8']:.1f} ({benches['int8'].backend}) | {ms['int8'] / ms['auto']:.2f}x |"
              + (f" {ms['int8 numba']:.1f} | {ms['int8 numba'] / ms['auto']:.2f}x |"
                 if a.with_numba else ""), flush=True)
    for bench in benches.values():
        bench.worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
