"""A worker's resident memory under steady load: rounds of short requests through `LLM`.

    python benchmarks/worker_memory.py [MODEL_DIR] [--rounds 5] [--requests 2000]
                                       [--no-prefix-caching] [--kv-cache-memory 4GiB]

Starts `LLM(MODEL_DIR)` (the bundled demo model by default) with the engine's defaults, then
runs `--rounds` rounds of `--requests` prompts of 3-30 words, 4-32 output tokens each at
temperature 0.8, and prints the worker's RSS (from /proc, Linux) after start-up and after
each round. Issue 13's figures (docs/tuning.md, "Memory on the CPU"; the archive,
benchmarks/archive/BENCHMARKS.md) come from this script.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from tidal.frontend import LLM, SamplingParams

WORDS = "def class return import for while if else self value list dict the a of to".split()


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def worker_pid(daemon_pid: int) -> int:
    """The daemon's one child (run at tensor_parallel_size 1)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == daemon_pid:
                return int(name)
    raise RuntimeError(f"the engine core (pid {daemon_pid}) has no worker")


def one_round(llm: LLM, rng: random.Random, num_requests: int) -> None:
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
               for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(4, 32), temperature=0.8, ignore_eos=True)
              for _ in prompts]
    llm.generate(prompts, params, use_tqdm=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-memory", default=None)
    args = ap.parse_args(argv)
    flags = {"enable_prefix_caching": not args.no_prefix_caching}
    if args.kv_cache_memory:
        flags["kv_cache_memory"] = args.kv_cache_memory
    rng = random.Random(0)
    with LLM(args.model, **flags) as llm:
        pid = worker_pid(llm.daemon_pid)
        series = [rss_mb(pid)]
        print(f"ready: worker RSS {series[0]} MB", flush=True)
        for i in range(args.rounds):
            start = time.perf_counter()
            one_round(llm, rng, args.requests)
            series.append(rss_mb(pid))
            print(f"round {i + 1}: worker RSS {series[-1]} MB "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    print("worker RSS (MB):", " -> ".join(map(str, series)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
