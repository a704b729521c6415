"""Where one worker step goes, and how close it is to what this machine allows.

    python benchmarks/step_profile.py MODEL_DIR [--batch 32] [--context 256] [--prefill 512]
                                      [--threads 2] [--profile] [--temperature 0]

Loads MODEL_DIR into an in-process `Worker` (no daemon, no sockets) and measures

  * the machine: read bandwidth (sum over a 1 GiB float32 tensor) and float32 GEMM FLOP/s
    (a [512, 2048] x [2048, 2048] matmul), both with torch at `--threads`, the best of one
    measurement before the model runs and one after;
  * one decode step at `--batch` requests of `--context` tokens (inputs, forward, LM head,
    sampler): the median of `--steps`, against its two floors, weight bytes / read bandwidth
    and 2 x parameters x batch / GEMM FLOP/s, and against the bytes the step actually reads
    (a de-quantized GGUF's layers stay 4- or 8-bit blocks, `kernels/cpu/small_m_gemm.py`);
  * one `--prefill`-token prefill: tokens/s against GEMM FLOP/s / (2 x decoder-layer
    parameters);
  * with `--profile`, a torch.profiler table of the decode step by operator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tidal.engine_core.cpu_threads import with_shared_openmp

# the worker process gets its OpenMP environment from the executor (engine_core/cpu_threads.py):
# one runtime for torch and numba, through LD_LIBRARY_PATH. The loader reads that variable only
# when a process starts, so this in-process Worker runs the script again with it (two
# runtimes spinning against each other made a decode step up to 7x slower, 2026-12-01)
_ENV = with_shared_openmp(dict(os.environ))
if _ENV.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH"):
    os.execve(sys.executable, [sys.executable, *sys.argv], _ENV)

import torch  # noqa: E402

from tidal.engine_core.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                     SchedulerConfig)
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData
from tidal.workers.host_memory import keep_freed_memory
from tidal.workers.layers import GemmLayer
from tidal.workers.worker import Worker

BLOCK_SIZE = 16


def read_bandwidth() -> float:
    """Bytes/s of a streaming read (a sum over 1 GiB that no cache can hold)."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times)


def gemm_flops() -> float:
    """float32 FLOP/s of a prefill-shaped matmul."""
    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    a @ b
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 512 * 2048 * 2048 / min(times)


class Bench:
    def __init__(self, model: str, args):
        self.args = args
        max_len = args.context + 64 + args.prefill
        blocks = args.batch * (args.context + 64) // BLOCK_SIZE + args.prefill // BLOCK_SIZE + 64
        config = EngineConfig(
            ModelConfig(model, dtype="float32"),
            CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks_override=blocks),
            SchedulerConfig(max_num_seqs=args.batch + 1,
                            max_num_batched_tokens=max(args.prefill, args.batch + 1)),
            ParallelConfig(device="cpu", attention_backend=args.attention_backend))
        self.worker = Worker(config.worker_config(0, max_len, ""))
        self.worker.load()
        self.worker.init_kv_cache(self.worker.determine_num_kv_blocks())
        self.step_id = 0
        self.weight_bytes = self.worker.weight_bytes
        self.num_params = self.worker.num_params
        # a prefill token goes through the decoder layers only (logits for one row at the end)
        self.layer_params = sum(p.numel() for p in
                                self.worker.runner.model.model.layers.parameters())

    def bytes_streamed(self, rows: int) -> int:
        """Weight bytes one forward of `rows` rows reads: each linear layer's weight as the
        path for that many rows stores it, plus the other parameters (norms)."""
        model = self.worker.runner.model
        gemms = [m for m in model.modules() if isinstance(m, GemmLayer)]
        in_gemms = {id(m.weight) for m in gemms}
        rest = sum(p.nbytes for p in model.parameters() if id(p) not in in_gemms)
        return rest + sum(m.weight_bytes_read(rows) for m in gemms)

    def _run(self, **fields) -> float:
        self.step_id += 1
        start = time.perf_counter()
        self.worker.execute(BatchPlan(self.step_id, **fields))
        return time.perf_counter() - start

    def decode_setup(self) -> list[NewRequestData]:
        a = self.args
        g = torch.Generator().manual_seed(0)
        sampling = SamplingParams(temperature=a.temperature, max_tokens=10**6, ignore_eos=True)
        per_req = (a.context + 64) // BLOCK_SIZE
        new = []
        for i in range(a.batch):
            tokens = torch.randint(3, 1000, (a.context,), generator=g).tolist()
            blocks = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
            new.append(NewRequestData(f"d{i}", pack_token_ids(tokens), a.context, blocks, 0,
                                      a.context, sampling))
        self._run(new_requests=new)
        return new

    def decode_step(self, new, step: int) -> float:
        cached = [CachedRequestData(r.req_id, [], self.args.context + step, 1) for r in new]
        return self._run(cached_requests=cached)

    def prefill(self) -> float:
        n = self.args.prefill
        tokens = torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(1)).tolist()
        first = 1 + self.args.batch * (self.args.context + 64) // BLOCK_SIZE
        blocks = list(range(first, first + (n + BLOCK_SIZE - 1) // BLOCK_SIZE))
        times = []
        for i in range(3):
            req = NewRequestData(f"p{i}", pack_token_ids(tokens), n, blocks, 0, n,
                                 SamplingParams(temperature=0.0))
            times.append(self._run(new_requests=[req]))
            self._run(finished_req_ids=[req.req_id])
        return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    keep_freed_memory()  # as the worker process does
    # NOTE: on a shared VM the machine's speed drifts by 20-40% over minutes, so the floors
    # use the best of a measurement before and one after the model's runs
    bw, flops = read_bandwidth(), gemm_flops()
    bench = Bench(a.model, a)
    print(f"model {a.model}: {bench.num_params / 1e6:.1f}M parameters, "
          f"{bench.weight_bytes / 1e6:.0f} MB of weights")
    new = bench.decode_setup()
    times = [bench.decode_step(new, s) for s in range(a.steps)]
    step = statistics.median(times)
    pre = bench.prefill()
    bw, flops = max(bw, read_bandwidth()), max(flops, gemm_flops())
    print(f"machine: {a.threads} threads, read {bw / 1e9:.1f} GB/s, GEMM {flops / 1e9:.0f} GFLOP/s "
          "(best of before and after)")
    floor = bench.weight_bytes / bw
    compute = 2 * bench.num_params * a.batch / flops
    print(f"decode step, batch {a.batch}, context {a.context}: {step * 1e3:.2f} ms "
          f"(floor {floor * 1e3:.2f} ms = weights / bandwidth: {floor / step:.0%} of it; "
          f"GEMM bound {compute * 1e3:.2f} ms = 2 x parameters x batch / GEMM FLOP/s: "
          f"{compute / step:.0%})")
    stored = bench.bytes_streamed(a.batch)
    print(f"  weights as the step reads them at batch {a.batch} (4/8-bit blocks, narrower or "
          f"float32 panels): {stored / 1e6:.0f} MB, floor {stored / bw * 1e3:.2f} ms: "
          f"{stored / bw / step:.0%} of the step")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for s in range(a.steps, a.steps + 5):
                bench.decode_step(new, s)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    rate = a.prefill / pre
    ideal = flops / (2 * bench.layer_params)
    print(f"prefill {a.prefill} tokens: {pre * 1e3:.1f} ms = {rate:.0f} tokens/s "
          f"(GEMM bound {ideal:.0f} tokens/s = GEMM FLOP/s / (2 x decoder-layer parameters): "
          f"{rate / ideal:.0%} of it)")
    bench.worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
