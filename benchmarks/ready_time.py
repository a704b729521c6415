"""Ready time (issue 36 item 4): seconds from the command to the first token, warm page cache.

    python benchmarks/ready_time.py [MODEL ...] [--runs 5] [--bytecode]

For each model (default: the bundled demo model, and SmolLM2-135M-Instruct's GGUF from the
tests' cache, ~/.cache/tidal-test, when it is there) runs `--runs` fresh processes of

    python -c "from tidal import LLM, SamplingParams; LLM(MODEL).generate(['def'], max_tokens=1)"

and times each from its start to the line it prints once the token is back (its shutdown is
not counted). One run first, not counted, warms the page cache and tidal's compile caches
(numba, the C kernels). Prints each model's runs and their median, and the load average.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import sys
from tidal import LLM, SamplingParams
model = sys.argv[1] or None
llm = LLM(model) if model else LLM()
llm.generate(["def"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
print("FIRST-TOKEN", flush=True)
llm.close()
"""


def default_models() -> list[str]:
    smollm2 = glob.glob(os.path.join(os.environ.get("TIDAL_TEST_CACHE",
                                                    os.path.expanduser("~/.cache/tidal-test")),
                                     "SmolLM2-135M-Instruct*.gguf"))
    return [""] + smollm2[:1]


def ready_s(model: str, env: dict | None = None) -> float:
    """Seconds from starting the process to its FIRST-TOKEN line."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, model], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("FIRST-TOKEN"):
            seconds = time.perf_counter() - start
            proc.wait()
            return seconds
    raise RuntimeError(f"no token from {model or 'the demo model'} (exit {proc.wait()})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="models (default: demo, SmolLM2 if cached)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bytecode", action="store_true",
                    help="let the runs write and read bytecode caches (__pycache__) where this "
                         "shell forbids them (PYTHONDONTWRITEBYTECODE, set in some containers "
                         "and CI images, not by Python's defaults): each of tidal's three "
                         "processes then compiles its sources once, in the warm-up run, as a "
                         "user's first start does, instead of at every start")
    a = ap.parse_args(argv)
    env = None
    if a.bytecode:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    bytecode = "off (PYTHONDONTWRITEBYTECODE)" if (env or os.environ).get(
        "PYTHONDONTWRITEBYTECODE") else "on"
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"bytecode caches {bytecode}")
    for model in a.models or default_models():
        ready_s(model, env)  # warm the page cache and compile caches
        runs = [ready_s(model, env) for _ in range(a.runs)]
        print(f"{os.path.basename(model) or 'demo model'}: median {statistics.median(runs):.2f} s "
              f"(runs {', '.join(f'{r:.2f}' for r in runs)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
