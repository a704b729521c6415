"""Decode inter-token latency on a quiet CPU and beside two busy loops, per wait policy, in one run.

    python benchmarks/shared_cpu.py [MODEL] [--policies auto,spin] [--tokens 48] [--rounds 2]

Issue 38's goal: beside two unrelated busy loops (`python -c "while True: pass"`, not niced,
in their own session like a neighbour's job) decode inter-token latency stays within 2.5x the
quiet figure. For each policy (`--cpu-wait-policy`, or a raw `env:NAME=VALUE,...` to try an
OpenMP setting by hand) one engine (`LLM`, the bundled demo model unless MODEL) is started in a
child process, which alternates quiet and busy phases `--rounds` times: each phase first
decodes one `--settle`-token request (time for the worker to notice the change), then times
one greedy request of `--tokens` tokens against one of 1 token, so that
ITL = (t(N) - t(1)) / (N - 1). The loops are started and killed by PID here, each phase.
Prints per policy the median quiet and busy ITL and their ratio, and the load average before
(the machine is rarely quiet: compare ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUSY_LOOP = "while True: pass"


def start_busy_loops(count: int) -> list[subprocess.Popen]:
    """`count` busy loops in a new session each (an unrelated job: autogroup gives it its own
    share of the CPU, as another user's would)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
            for _ in range(count)]


def stop(loops: list[subprocess.Popen]) -> None:
    for loop in loops:
        loop.kill()
        loop.wait()


def timed_decode(llm, tokens: int) -> float:
    from tidal import SamplingParams

    start = time.perf_counter()
    llm.generate(["def"], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0),
                 use_tqdm=False)
    return time.perf_counter() - start


def itl_ms(llm, tokens: int) -> float:
    one = timed_decode(llm, 1)
    many = timed_decode(llm, tokens)
    return 1000 * max(0.0, many - one) / (tokens - 1)


def child(model: str | None, policy: str, tokens: int, settle: int, rounds: int,
          loops: int) -> dict:
    from tidal import LLM

    kwargs = {"kv_cache_memory": "32MiB", "max_model_len": 512}  # room for any model
    if policy.startswith("env:"):
        for pair in policy[4:].split(","):
            name, _, value = pair.partition("=")
            os.environ[name] = value
    elif policy != "today":
        kwargs["cpu_wait_policy"] = policy
    result = {"quiet": [], "busy": []}
    with (LLM(model, **kwargs) if model else LLM(**kwargs)) as llm:
        timed_decode(llm, settle)  # compile and warm up
        for _ in range(rounds):
            for phase in ("quiet", "busy"):
                busy = start_busy_loops(loops) if phase == "busy" else []
                try:
                    timed_decode(llm, settle)
                    result[phase].append(itl_ms(llm, tokens))
                finally:
                    stop(busy)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="model (default: the demo model)")
    ap.add_argument("--policies", default="auto,spin",
                    help="comma-separated: auto, spin, passive, today (no flag), "
                         "or env:NAME=VALUE;... (';' between variables)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--settle", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.child.replace(";", ","), a.tokens, a.settle,
                               a.rounds, a.loops)))
        return 0
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}, "
          f"{os.cpu_count()} cores, {a.loops} busy loops in the busy phases")
    print(f"{'policy':<34} {'quiet ITL ms':>12} {'busy ITL ms':>12} {'busy/quiet':>10}")
    for policy in a.policies.split(","):
        cmd = [sys.executable, __file__, *([a.model] if a.model else []), "--child", policy,
               "--tokens", str(a.tokens), "--settle", str(a.settle), "--rounds", str(a.rounds),
               "--loops", str(a.loops)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{policy}: failed\n{done.stderr[-3000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        quiet, busy = statistics.median(r["quiet"]), statistics.median(r["busy"])
        print(f"{policy:<34} {quiet:12.1f} {busy:12.1f} {busy / quiet:9.1f}x   "
              f"(quiet {', '.join(f'{x:.1f}' for x in r['quiet'])}; "
              f"busy {', '.join(f'{x:.1f}' for x in r['busy'])})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
