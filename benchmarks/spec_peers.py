"""Speculative decoding beside the peers: `tidal serve`, llama-server and `vllm serve`, each
with speculation off and with its own n-gram speculation, on the same chat-templated prompts
of `benchmarks/spec_decode.py` (copy-heavy and chat), one stream and four.

    python benchmarks/spec_peers.py [--engines tidal llama.cpp vllm] [--tasks 8]

One server at a time (started, measured, stopped), in the order the configurations are
listed, so the machine is as quiet for each. A stream sends its conversations one after
another to /v1/chat/completions (greedy, `max_tokens`, non-streaming); tokens/s is the
completion tokens of all streams over the wall time (prefill included, as spec_decode.py).
Each engine's ratio is to its own "off" configuration. Peers come from
../shared/peers/setup.sh (PEERS, default ~/.cache/tidal-peers): the float32 SmolLM2 folder
for tidal and vLLM, its F32 GGUF for llama-server.

The peers' settings: llama-server `--spec-type ngram-simple` with a 3-token lookup and 4
drafts (`--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4`) and `ngram-mod` with
its defaults; vLLM `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}`, as tidal's `ngram`. A configuration whose server does not come up
is reported with the last lines of its log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import CHAT_TASKS, COPY_TASKS, prompt  # noqa: E402

PEERS = os.path.expanduser(os.environ.get("PEERS", "~/.cache/tidal-peers"))
MODEL = os.path.join(PEERS, "models/smollm2-135m-instruct")
GGUF = os.path.join(PEERS, "models/smollm2-135m-instruct-f32.gguf")
PEER_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                            "peers")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def tidal_cmd(port: int, spec: dict | None) -> list[str]:
    cmd = [sys.executable, "-m", "tidal.frontend.cli", "serve", MODEL, "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "2048"]
    return cmd + (["--speculative-config", json.dumps(spec)] if spec else [])


def llama_cmd(port: int, extra: list[str]) -> list[str]:
    return [os.path.join(PEERS, "llama.cpp/build/bin/llama-server"), "-m", GGUF, "--port",
            str(port), "-t", str(os.cpu_count()), "-np", "4", "-c", "8192", "--no-webui",
            "-a", "m", *extra]


def vllm_cmd(port: int, spec: dict | None) -> list[str]:
    venv = os.path.join(PEERS, "venv")
    tc = ctypes.util.find_library("tcmalloc_minimal") or ""
    env = ["env", "VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=2",
           f"VLLM_CPU_OMP_THREADS_BIND=0-{os.cpu_count() - 1}",
           f"LD_PRELOAD={tc}:{venv}/lib/libiomp5.so"]
    cmd = [os.path.join(venv, "bin/python"), os.path.join(PEER_SCRIPTS, "vllm_cli.py"), "serve",
           MODEL, "--port", str(port), "--dtype", "float32", "--served-model-name", "m",
           "--max-model-len", "2048"]
    return env + cmd + (["--speculative-config", json.dumps(spec)] if spec else [])


CONFIGS = {
    "tidal": [("off", lambda p: tidal_cmd(p, None)),
              ("ngram", lambda p: tidal_cmd(p, NGRAM)),
              ("suffix", lambda p: tidal_cmd(p, {"method": "suffix",
                                                 "num_speculative_tokens": 4}))],
    "llama.cpp": [("off", lambda p: llama_cmd(p, [])),
                  ("ngram-simple", lambda p: llama_cmd(p, [
                      "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                      "--spec-ngram-simple-size-m", "4"])),
                  ("ngram-mod", lambda p: llama_cmd(p, ["--spec-type", "ngram-mod"]))],
    "vllm": [("off", lambda p: vllm_cmd(p, None)),
             ("ngram", lambda p: vllm_cmd(p, NGRAM))],
}


def post(port: int, content: str, max_tokens: int) -> int:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["usage"]["completion_tokens"]


def wait_up(port: int, proc: subprocess.Popen, limit_s: float = 400) -> float | None:
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s and proc.poll() is None:
        try:
            post(port, "Hi", 1)
            return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, OSError, KeyError, ValueError):
            time.sleep(0.5)
    return None


def run_streams(port: int, prompts: list[str], streams: int, max_tokens: int) -> float:
    """tokens/s of `prompts` sent by `streams` clients, each one request at a time."""
    shares = [prompts[i::streams] for i in range(streams)]

    def client(share: list[str]) -> int:
        return sum(post(port, p, max_tokens) for p in share)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(client, shares))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tasks", type=int, default=8, help="prompts per workload and stream count")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--port", type=int, default=8470)
    args = parser.parse_args()
    workloads = {"copy": COPY_TASKS, "chat": CHAT_TASKS}
    prompts = {(w, s): [prompt(tasks, 1000 + 100 * s + i) for i in range(args.tasks)]
               for w, tasks in workloads.items() for s in args.streams}
    logs = tempfile.mkdtemp(prefix="spec-peers-")
    results: dict[tuple[str, str], dict] = {}
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; logs in {logs}",
          flush=True)
    for engine in args.engines:
        for name, make in CONFIGS[engine]:
            log = os.path.join(logs, f"{engine}-{name}.log")
            with open(log, "w") as out:
                # from the logs folder: a checkout's top-level kernels/ would shadow a module
                # vLLM probes for
                proc = subprocess.Popen(make(args.port), stdout=out, stderr=subprocess.STDOUT,
                                        cwd=logs, start_new_session=True)
            try:
                ready = wait_up(args.port, proc)
                if ready is None:
                    tail = open(log).read().strip().splitlines()[-3:]
                    results[(engine, name)] = {"error": " | ".join(tail)[-300:]}
                    print(f"# {engine} {name}: did not come up: {tail}", flush=True)
                    continue
                row = {"ready_s": ready}
                for (w, s), ps in prompts.items():
                    row[(w, s)] = run_streams(args.port, ps, s, args.max_tokens)
                    print(f"# {engine} {name} {w} {s} stream(s): {row[(w, s)]:.1f} tokens/s",
                          flush=True)
                results[(engine, name)] = row
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    keys = list(prompts)
    print(f"SmolLM2-135M-Instruct float32, {args.max_tokens} tokens, greedy, {args.tasks} "
          f"prompts per cell; load average {os.getloadavg()[0]:.2f}")
    print(f"{'engine':10}{'config':14}" + "".join(f"{w + ' x' + str(s):>18}" for w, s in keys))
    for (engine, name), row in results.items():
        if "error" in row:
            print(f"{engine:10}{name:14}  failed: {row['error']}")
            continue
        base = results.get((engine, "off"), {})
        cells = []
        for k in keys:
            ratio = f" ({row[k] / base[k]:.2f}x)" if k in base else ""
            cells.append(f"{row[k]:.1f}{ratio}")
        print(f"{engine:10}{name:14}" + "".join(f"{c:>18}" for c in cells))
    shutil.rmtree(logs, ignore_errors=True) if not any("error" in r for r in results.values()) \
        else None


if __name__ == "__main__":
    main()
