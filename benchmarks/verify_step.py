"""A speculative verification step against a decode step, in one worker in this process: R
requests at ~200 tokens of context, steps of one token each and steps verifying K drafts
each, alternating (so a machine whose load drifts affects both alike); prints each kind's
median and least time and their ratio, what the adaptive policy's measured step times see.

    python benchmarks/verify_step.py MODEL_FOLDER [--requests 1] [--drafts 4] [--steps 30]
                                     [--threads 2] [--profile] [--parts]

--profile prints cProfile's top functions over the verification steps (then the decode
steps) instead. --parts runs the fused layers' build with its per-part timer
(`fused_layers.timed_build`) and prints, for both kinds of step, each part's median ms a step
over the 30 layers (the parts' sum is the fused call's time). The drafts are a fixed token, mostly rejected: a step costs the same either
way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def worker_for(model: str):
    from tidal.engine_core.config import (
        CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    )
    from tidal.workers.worker import Worker

    config = EngineConfig(ModelConfig(model, dtype="float32", max_model_len=2048),
                          CacheConfig(num_kv_blocks_override=1024),
                          SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
                          ParallelConfig(device="cpu"))
    worker = Worker(config.worker_config(0, 2048, ""))
    worker.load()
    worker.init_kv_cache(1024)
    return worker


def stepper(model: str, requests: int = 1):
    """A worker in this process holding `requests` requests of ~200 tokens, and `run(k)`:
    one step of every request with k drafts (a fixed token, mostly rejected: a step costs
    the same either way), returning its seconds at the worker."""
    import numpy as np

    from tidal.ipc.messages import SamplingParams, pack_token_ids
    from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData

    worker = worker_for(model)
    rng = random.Random(0)
    sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    prompt = 200
    known = {f"r{i}": prompt for i in range(requests)}  # tokens each request holds
    new = [NewRequestData(req_id, pack_token_ids([rng.randrange(3, 1000) for _ in range(prompt)]),
                          prompt, list(range(1 + i * 40, 1 + (i + 1) * 40)), 0, prompt,
                          sampling) for i, req_id in enumerate(known)]
    worker.execute(BatchPlan(1, new_requests=new,
                             total_num_scheduled_tokens=prompt * requests))
    for req_id in known:
        known[req_id] += 1
    step_id = 1

    def run(k: int) -> float:
        nonlocal step_id
        step_id += 1
        drafts = pack_token_ids([5] * k) if k else b""
        cached = [CachedRequestData(req_id, [], n - 1, 1 + k, spec_token_ids=drafts)
                  for req_id, n in known.items()]
        plan = BatchPlan(step_id, cached_requests=cached,
                         total_num_scheduled_tokens=requests * (1 + k))
        start = time.perf_counter()
        result = worker.execute(plan)
        seconds = time.perf_counter() - start
        counts = (np.frombuffer(result.num_tokens, np.int32) if result.num_tokens
                  else [1] * requests)
        for req_id, c in zip(known, counts):
            known[req_id] += int(c)
        return seconds

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.parts:
        from tidal.kernels.cpu import fused_layers
        if fused_layers.timed_build().library is None:
            raise SystemExit("the timed build of decoder_layers.c failed")
    run = stepper(args.model, args.requests)
    for _ in range(3):
        run(0)
        run(args.drafts)
    if args.profile:
        import cProfile
        import pstats
        for k in (args.drafts, 0):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                run(k)
            profile.disable()
            print(f"--- {args.steps} steps of {args.requests} x {1 + k} rows")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        return
    if args.parts:
        print_parts(run, args)
        return
    decode, verify = [], []
    for _ in range(args.steps):
        decode.append(run(0))
        verify.append(run(args.drafts))
    md, mv = statistics.median(decode), statistics.median(verify)
    print(f"{args.requests} request(s), {args.drafts} drafts each, {torch.get_num_threads()} "
          f"threads: decode median {md * 1e3:.2f} ms (least {min(decode) * 1e3:.2f}), verify "
          f"median {mv * 1e3:.2f} ms (least {min(verify) * 1e3:.2f}); verify / decode "
          f"{mv / md:.2f} (least {min(verify) / min(decode):.2f})")


def print_parts(run, args) -> None:
    """Each timed part's median ms a step, decode and verification steps alternating."""
    from tidal.kernels.cpu import fused_layers

    fused_layers.layer_times(reset=True)
    parts = {0: [], args.drafts: []}
    walls = {0: [], args.drafts: []}
    for _ in range(args.steps):
        for k in (0, args.drafts):
            walls[k].append(run(k))
            parts[k].append(fused_layers.layer_times(reset=True))
    print(f"{args.requests} request(s), {args.drafts} drafts each, median ms a step "
          f"(least), parts summed over the layers:")
    print(f"{'part':>10} {'decode':>16} {'verify':>16}")
    for name in fused_layers.PARTS + ("layers", "step"):
        cells = []
        for k in (0, args.drafts):
            if name == "step":
                values = walls[k]
            elif name == "layers":
                values = [sum(p.values()) for p in parts[k]]
            else:
                values = [p[name] for p in parts[k]]
            cells.append(f"{statistics.median(values) * 1e3:7.2f} ({min(values) * 1e3:6.2f})")
        print(f"{name:>10} {cells[0]:>16} {cells[1]:>16}")


if __name__ == "__main__":
    main()
