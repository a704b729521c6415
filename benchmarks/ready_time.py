"""Ready time (issue 36 item 4): seconds from the command to the first token, warm page cache.

    python benchmarks/ready_time.py [MODEL ...] [--runs 5] [--bytecode] [--serve [--port P]]

For each model (default: the bundled demo model, and SmolLM2-135M-Instruct's GGUF from the
tests' cache, ~/.cache/tidal-test, when it is there) runs `--runs` fresh processes of

    python -c "from tidal import LLM, SamplingParams; LLM(MODEL).generate(['def'], max_tokens=1)"

and times each from its start to the line it prints once the token is back (its shutdown is
not counted). One run first, not counted, warms the page cache and tidal's compile caches
(numba, the C kernels). Prints each model's runs and their median, and the load average.

--serve times `tidal serve MODEL --port P` instead (the `tidal` next to this Python): from the
command to GET /health answering 200 (polled every 20 ms), and to the first token of a
one-token /v1/completions request sent then; each server is stopped (SIGTERM to its process
group) after.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

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


def serve_ready_s(model: str, port: int, env: dict | None = None) -> tuple[float, float]:
    """Seconds from starting `tidal serve` to /health 200, and to its first token."""
    tidal = os.path.join(os.path.dirname(sys.executable), "tidal")
    start = time.perf_counter()
    proc = subprocess.Popen([tidal, "serve", *([model] if model else []), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tidal serve {model or '(demo)'} exited {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        health = time.perf_counter() - start
        with urllib.request.urlopen(f"{base}/v1/models") as answer:
            name = json.load(answer)["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": "def", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as answer:
            answer.read()
        return health, time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


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
    ap.add_argument("--serve", action="store_true",
                    help="time `tidal serve` to /health 200 and to a first token over HTTP")
    ap.add_argument("--port", type=int, default=8411, help="--serve's port")
    a = ap.parse_args(argv)
    env = None
    if a.bytecode:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    bytecode = "off (PYTHONDONTWRITEBYTECODE)" if (env or os.environ).get(
        "PYTHONDONTWRITEBYTECODE") else "on"
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"bytecode caches {bytecode}")
    for model in a.models or default_models():
        if a.serve:
            serve_ready_s(model, a.port, env)  # warm-up
            runs = [serve_ready_s(model, a.port, env) for _ in range(a.runs)]
            health, first = [h for h, _ in runs], [f for _, f in runs]
            print(f"tidal serve {os.path.basename(model) or 'demo model'}: /health 200 median "
                  f"{statistics.median(health):.2f} s (runs {', '.join(f'{r:.2f}' for r in health)}); "
                  f"first token median {statistics.median(first):.2f} s "
                  f"(runs {', '.join(f'{r:.2f}' for r in first)})", flush=True)
            continue
        ready_s(model, env)  # warm the page cache and compile caches
        runs = [ready_s(model, env) for _ in range(a.runs)]
        print(f"{os.path.basename(model) or 'demo model'}: median {statistics.median(runs):.2f} s "
              f"(runs {', '.join(f'{r:.2f}' for r in runs)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
