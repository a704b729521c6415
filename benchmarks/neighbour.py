"""Throughput with and without a busy neighbour: what a low-priority CPU hog costs tidal.

    python benchmarks/neighbour.py MODEL [--num-prompts 200] [--hogs 2] [--wait-policy PASSIVE]

Runs one offline workload (sharegpt-like token ids, greedy, ignore_eos, all requests at once,
the same generator as ../shared/peers/offline_compare.py) through `LLM` twice in fresh
processes: on a quiet machine, then beside `--hogs` busy loops started with `nice -n 19`
(one per core by default). Prints output tokens/s of both and their ratio. `--wait-policy`
sets OMP_WAIT_POLICY for the workers (by default libgomp spins a while, then sleeps; PASSIVE sleeps at once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time


def workload(num_prompts: int, seed: int = 7, vocab_hi: int = 8192) -> list[dict]:
    rng = random.Random(seed)

    def lognormal(mu: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, round(rng.lognormvariate(math.log(mu), 0.6))))

    return [{"prompt": [rng.randrange(3, vocab_hi) for _ in range(lognormal(160, 32, 512))],
             "max_tokens": lognormal(96, 16, 256)} for _ in range(num_prompts)]


def run_once(model: str, reqs_path: str) -> float:
    """Output tokens/s of one `LLM.generate` over the workload (in this process)."""
    from tidal.frontend import LLM, SamplingParams

    reqs = json.load(open(reqs_path))
    llm = LLM(model)
    llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.close()
    return sum(r["max_tokens"] for r in reqs) / wall


def measure(model: str, reqs_path: str, env: dict) -> float:
    out = subprocess.run([sys.executable, __file__, model, "--child", reqs_path], env=env,
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wait-policy", default=None, help="OMP_WAIT_POLICY for the workers")
    ap.add_argument("--child", metavar="REQS", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(run_once(a.model, a.child))
        return 0
    env = dict(os.environ)
    if a.wait_policy:
        env["OMP_WAIT_POLICY"] = a.wait_policy
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload(a.num_prompts), f)
    quiet = measure(a.model, f.name, env)
    hogs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
            for _ in range(a.hogs)]
    try:
        busy = measure(a.model, f.name, env)
    finally:
        for hog in hogs:
            hog.kill()
    os.unlink(f.name)
    policy = env.get("OMP_WAIT_POLICY", "tidal's default")
    print(f"{a.num_prompts} sharegpt-like requests, OMP_WAIT_POLICY={policy}, load average "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}")
    print(f"quiet:                        {quiet:8.1f} output tokens/s")
    print(f"beside {a.hogs} nice-19 busy loops: {busy:8.1f} output tokens/s")
    print(f"kept {busy / quiet:.0%} of its throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
