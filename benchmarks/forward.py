"""Forward-pass benchmark: tidal's Worker against transformers on the same model, same run.

    python benchmarks/forward.py [--device cpu|cuda] [--context 128] [--steps 8] [--threads N]

Builds a random-weight Llama from a config (hidden 256, 4 layers, ~7M parameters by
default) in a temporary folder, then times

  * one decode step at batch 1, 16 and 64 (each request already holds `--context` tokens):
    tidal = Worker.execute of a decode plan (inputs, forward, logits, sampling);
    transformers = model(next_token, past_key_values=cache) plus argmax;
  * one 512-token prefill (logits for the last position only on both sides).

and prints milliseconds and the ratio tidal / transformers (below 1 means tidal is faster).
On CUDA it also prints each decode step against the time to read the weights and the KV
cache once at the device's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from tidal.engine_core.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                     SchedulerConfig)
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData
from tidal.workers.worker import Worker

BATCH_SIZES = (1, 16, 64)
PREFILL_LEN = 512
BLOCK_SIZE = 16


def build_model(path: str, args) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# tidal


class TidalBench:
    def __init__(self, path: str, args):
        max_len = args.context + args.steps + PREFILL_LEN + 8
        blocks = (max(BATCH_SIZES) * (args.context + args.steps + 2) + PREFILL_LEN) // BLOCK_SIZE
        config = EngineConfig(
            ModelConfig(path, dtype=args.dtype),
            CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks_override=blocks + 16),
            SchedulerConfig(max_num_seqs=max(BATCH_SIZES), max_num_batched_tokens=max(
                PREFILL_LEN, max(BATCH_SIZES) * args.context)),
            ParallelConfig(device=args.device, enforce_eager=args.enforce_eager))
        self.worker = Worker(config.worker_config(0, max_len, ""))
        self.worker.load()
        self.worker.init_kv_cache(self.worker.determine_num_kv_blocks())
        self.step_id = 0
        self.device = args.device

    def _plan(self, **fields) -> BatchPlan:
        self.step_id += 1
        return BatchPlan(self.step_id, **fields)

    def decode(self, batch: int, context: int, steps: int) -> float:
        """Median decode-step seconds for `batch` requests of `context` tokens."""
        g = torch.Generator().manual_seed(batch)
        greedy = SamplingParams(temperature=0.0, max_tokens=steps + 1)
        num_blocks = (context + steps + BLOCK_SIZE) // BLOCK_SIZE
        new, next_block = [], 1
        for i in range(batch):
            tokens = torch.randint(0, 1000, (context,), generator=g).tolist()
            blocks = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            new.append(NewRequestData(f"b{batch}-{i}", pack_token_ids(tokens), context,
                                      blocks, 0, context, greedy))
        self.worker.execute(self._plan(new_requests=new))  # prefill
        times = []
        for step in range(steps):
            cached = [CachedRequestData(r.req_id, [], context + step, 1) for r in new]
            times.append(_timed(lambda: self.worker.execute(self._plan(cached_requests=cached)),
                                self.device))
        self.worker.execute(self._plan(finished_req_ids=[r.req_id for r in new]))
        return statistics.median(times)

    def prefill(self, length: int) -> float:
        tokens = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(1))
        blocks = list(range(1, 1 + (length + BLOCK_SIZE - 1) // BLOCK_SIZE))
        times = []
        for i in range(3):
            req = NewRequestData(f"p{i}", pack_token_ids(tokens.tolist()), length, blocks, 0,
                                 length, SamplingParams(temperature=0.0))
            times.append(_timed(lambda: self.worker.execute(self._plan(new_requests=[req])),
                                self.device))
            self.worker.execute(self._plan(finished_req_ids=[req.req_id]))
        return min(times)


# ---------------------------------------------------------------------------------------------
# transformers


class HFBench:
    def __init__(self, path: str, args):
        import transformers

        dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model.to(args.device).eval()
        self.device = args.device

    @torch.inference_mode()
    def decode(self, batch: int, context: int, steps: int) -> float:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, 1000, (batch, context), generator=g).to(self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, nxt = _hf_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
        # transformers 5 names the cache `cache`, 4.x `past_key_values`
        key = "cache" if "cache" in out else "past_key_values"
        times = []
        for _ in range(steps):
            def step():
                nonlocal cache, nxt
                o = self.model(input_ids=nxt, use_cache=True, **{key: cache})
                cache, nxt = _hf_cache(o), o.logits[:, -1].argmax(-1, keepdim=True)
            times.append(_timed(step, self.device))
        return statistics.median(times)

    @torch.inference_mode()
    def prefill(self, length: int) -> float:
        ids = torch.randint(0, 1000, (1, length),
                            generator=torch.Generator().manual_seed(1)).to(self.device)
        return min(_timed(lambda: self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
                          .logits.argmax(-1), self.device) for _ in range(3))


def _hf_cache(output):
    return output["cache"] if "cache" in output else output.past_key_values


# ---------------------------------------------------------------------------------------------


def memory_bound_seconds(worker: Worker, batch: int, context: int) -> float:
    """Seconds to read the weights and the batch's KV once at the measured copy bandwidth."""
    weights = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
    kv = worker.runner.kv_block_bytes * batch * (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    buf.clone()
    seconds = _timed(lambda: [buf.clone() for _ in range(5)], "cuda") / 5
    bandwidth = 2 * buf.numel() / seconds  # read + write
    return (weights + kv) / bandwidth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args)
        tidal, hf = TidalBench(path, args), HFBench(path, args)
        params = sum(p.numel() for p in hf.model.parameters()) / 1e6
        print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
              f"({params:.1f}M params), {args.dtype} on {args.device}, "
              f"torch threads {torch.get_num_threads()}")
        print(f"{'case':<28}{'tidal ms':>10}{'hf ms':>10}{'tidal/hf':>10}")
        for batch in BATCH_SIZES:
            t, h = (tidal.decode(batch, args.context, args.steps),
                    hf.decode(batch, args.context, args.steps))
            extra = ""
            if args.device == "cuda":
                bound = memory_bound_seconds(tidal.worker, batch, args.context)
                extra = f"   memory-read bound {bound * 1e3:.3f} ms ({t / bound:.1f}x)"
            print(f"{f'decode batch {batch} (ctx {args.context})':<28}{t * 1e3:>10.2f}"
                  f"{h * 1e3:>10.2f}{t / h:>10.2f}{extra}")
        t, h = tidal.prefill(PREFILL_LEN), hf.prefill(PREFILL_LEN)
        print(f"{f'prefill {PREFILL_LEN} tokens':<28}{t * 1e3:>10.2f}{h * 1e3:>10.2f}"
              f"{t / h:>10.2f}")
        tidal.worker.shutdown()


if __name__ == "__main__":
    sys.exit(main())
