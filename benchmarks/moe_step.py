"""Decode steps of a mixture-of-experts model against a dense model of the same active
parameters, in one process, interleaved.

    python benchmarks/moe_step.py [--hidden 768] [--layers 8] [--experts 8] [--top-k 2]
                                  [--expert-size 768] [--batch 1 8 32] [--context 128]
                                  [--rounds 6] [--steps 5] [--device cpu] [--threads 2]

Writes two random-weight folders (no tokenizer: the worker does not read one): a Mixtral
(`--experts` experts of intermediate size `--expert-size`, top `--top-k`) and a Llama whose MLP
is `--top-k` x `--expert-size` wide, so a token runs the same number of multiply-adds in both
(same attention, embeddings and LM head). Each is loaded into an in-process `Worker` (the real
worker path: model runner, attention backend, the CPU op seam's kernels on the CPU), `--batch`
requests of `--context` tokens are prefilled, then decode steps are timed in `--rounds`
rounds of `--steps` steps, MoE then dense or dense then MoE by turns, so a shared machine's
drift falls on both. Prints the median step per batch size and the MoE / dense ratio.
A third decoder runs the MoE model with the few-token path off (`workers/moe.py`
FEW_TOKENS = 0: every step sorted and grouped by expert), in the same rounds, so the last
column is what the few-token path saves (steps of up to FEW_TOKENS tokens take it).

What it shows: at batch 1 the MoE step reads k experts' weights a layer, as the dense one
reads its MLP; as the batch grows the tokens spread over more experts, so the MoE step
streams up to all E experts' weights (E / k times the dense MLP's bytes) and runs one small
GEMM pair per expert instead of one large one.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

from tidal.engine_core.cpu_threads import with_shared_openmp

# one OpenMP runtime for torch and the C kernels, as the executor gives a worker process
_ENV = with_shared_openmp(dict(os.environ))
if _ENV.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH"):
    os.execve(sys.executable, [sys.executable, *sys.argv], _ENV)

import torch  # noqa: E402

from tidal.engine_core.config import (CacheConfig, EngineConfig, ModelConfig,  # noqa: E402
                                      ParallelConfig, SchedulerConfig)
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData
from tidal.workers import moe  # noqa: E402
from tidal.workers.worker import Worker  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 8192


def write_models(a: argparse.Namespace, root: str) -> dict[str, str]:
    """The MoE and the dense folder under `root` (random weights, float32)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256),
                  max_position_embeddings=4096, tie_word_embeddings=False)
    folders = {}
    for name, model in (
        ("moe", transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=a.expert_size, num_local_experts=a.experts,
            num_experts_per_tok=a.top_k))),
        ("dense", transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, intermediate_size=a.top_k * a.expert_size))),
    ):
        folders[name] = os.path.join(root, name)
        model.to(torch.float32).save_pretrained(folders[name])
        del model
    return folders


class Decoder:
    """One worker with `batch` requests of `context` tokens prefilled, stepping them."""

    def __init__(self, model: str, device: str, dtype: str, batch: int, context: int,
                 steps: int):
        self.context, self.step_id, self.done = context, 0, 0
        per_req = -(-(context + steps + 1) // BLOCK_SIZE)
        config = EngineConfig(
            ModelConfig(model, dtype=dtype),
            CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks_override=batch * per_req + 2),
            SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, context)),
            ParallelConfig(device=device))
        self.worker = Worker(config.worker_config(0, context + steps + 1, ""))
        self.worker.load()
        self.worker.init_kv_cache(self.worker.determine_num_kv_blocks())
        g = torch.Generator().manual_seed(0)
        sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
        self.ids = [f"d{i}" for i in range(batch)]
        for i, req_id in enumerate(self.ids):  # one prefill a step
            tokens = torch.randint(3, VOCAB, (context,), generator=g).tolist()
            blocks = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
            self._run(new_requests=[NewRequestData(req_id, pack_token_ids(tokens), context,
                                                   blocks, 0, context, sampling)])

    def _run(self, **fields) -> float:
        self.step_id += 1
        start = time.perf_counter()
        self.worker.execute(BatchPlan(self.step_id, **fields))
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def step(self) -> float:
        """One decode step of every request."""
        computed = self.context + self.done
        self.done += 1
        return self._run(cached_requests=[CachedRequestData(r, [], computed, 1)
                                          for r in self.ids])


def print_profile(decoder: Decoder, few_tokens: int, title: str) -> None:
    """torch.profiler's operators of 3 decode steps, by self time."""
    from torch.profiler import ProfilerActivity, profile

    moe.FEW_TOKENS = few_tokens
    activities = [ProfilerActivity.CPU]
    if decoder.worker.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(3):
            decoder.step()
    sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    print(f"-- {title}: 3 steps")
    print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=40))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=768)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="decode steps a round")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="after each batch size, print "
                    "torch.profiler's top operators of 3 MoE decode steps, each path")
    ap.add_argument("--models", default=None, help="folder to write the models into "
                    "(default: a temporary one)")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for handler in logging.getLogger().handlers:  # the CPU ops' start-up lines only
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or "CPU ops (" in r.getMessage())
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_models(a, a.models or tmp)
        active = a.top_k * a.expert_size
        print(f"hidden {a.hidden}, {a.layers} layers; MoE: {a.experts} experts of "
              f"{a.expert_size}, top-{a.top_k}; dense MLP {active} wide; {a.device} {dtype}, "
              f"{a.threads} threads, context {a.context}, {a.rounds} rounds of {a.steps} steps",
              flush=True)
        print(f"{'batch':>5}  {'MoE ms':>8}  {'dense ms':>8}  {'MoE/dense':>9}  "
              f"{'grouped ms':>10}  {'grouped/MoE':>11}")
        few = moe.FEW_TOKENS
        for batch in a.batch:
            # MoE (few-token path as shipped), dense, MoE with every step grouped
            trio = [Decoder(folders[name], a.device, dtype, batch, a.context,
                            a.rounds * a.steps + a.steps + 3) for name in ("moe", "dense", "moe")]
            limits = (few, few, 0)

            def steps(which: int) -> float:
                moe.FEW_TOKENS = limits[which]
                return statistics.median(trio[which].step() for _ in range(a.steps))

            for which in range(3):
                steps(which)  # warm-up
            rounds: list[list[float]] = [[], [], []]
            for r in range(a.rounds):
                for which in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
                    rounds[which].append(steps(which))
            moe.FEW_TOKENS = few
            med = [statistics.median(times) * 1e3 for times in rounds]
            ratio = statistics.median(m / d for m, d in zip(rounds[0], rounds[1]))
            saved = statistics.median(g / m for m, g in zip(rounds[0], rounds[2]))
            print(f"{batch:5d}  {med[0]:8.2f}  {med[1]:8.2f}  {ratio:9.2f}  {med[2]:10.2f}  "
                  f"{saved:11.2f}", flush=True)
            if a.profile:
                for which, label in ((0, "few-token path as shipped"), (2, "grouped")):
                    print_profile(trio[which], limits[which], f"batch {batch}, MoE, {label}")
            moe.FEW_TOKENS = few
            for d in trio:
                d.worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
