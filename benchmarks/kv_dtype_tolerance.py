"""How far a quantized KV cache moves a real model's greedy output: SmolLM2-135M-Instruct,
64 prompts of our own, 32 greedy tokens each, `--kv-cache-dtype int8` (and fp8) against the
float32 cache of the same engine, and beside them llama.cpp's `-ctk q8_0 -ctv q8_0` against
its own F32 cache on the same prompt token ids (one table, one run).

    python benchmarks/kv_dtype_tolerance.py [--model DIR] [--dtypes int8 fp8] [--tokens 32]
        [--llama-server BIN --gguf FILE | --no-llama-cpp]

Per cache dtype:
  exact prompts      prompts whose 32 tokens equal the float32 cache's
  greedy agreement   positions whose token equals float32's, over all 64 x 32
  common prefix      mean tokens before the first difference (/ 32)
  mean |d logprob|   mean |logprob_q - logprob_f32| of the chosen token over the positions
                     whose context is still identical (up to and including the first
                     difference, where each run's own chosen token counts)
  max |d logprob|    the largest of those

The model: the float32 HF folder `~/.cache/tidal-peers/models/smollm2-135m-instruct` that
/work/shared/peers/setup.sh converts from the pinned Q4_1 GGUF (the same weights as the test
fixture `tests/real_models.py`), or `--model`. Both runs use the same engine flags
(attention backend auto, float32 compute) apart from the cache's dtype.

llama.cpp: `llama-server` and the F32 GGUF of the same weights that setup.sh builds into
~/.cache/tidal-peers, started twice by this script (and stopped by its PID), with flags equal
but for the cache type: `-ctk f32 -ctv f32`, then `-ctk q8_0 -ctv q8_0` (q8_0: blocks of 32
values with one fp16 scale); `-fa on` in both, since llama.cpp reads a quantized V cache only
through flash attention; one slot (`-np 1`), `--seed 0`. Each prompt goes to `/completion` as
the token ids tidal gets (the HF tokenizer's), with `temperature 0`, `n_predict 32`,
`n_probs 1` and `post_sampling_probs false` (the chosen token's logprob of the raw logits'
softmax), `cache_prompt false` (no KV reuse between prompts), `ignore_eos true`. Its
ignore_eos masks the end tokens' logits where tidal's generates past an end token; each
engine's two runs follow the same rule, so each row compares like with like. The last row,
llama.cpp F32 against tidal's float32 cache, checks that both engines run the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

PEERS = os.path.expanduser("~/.cache/tidal-peers")
DEFAULT_MODEL = os.path.join(PEERS, "models", "smollm2-135m-instruct")
DEFAULT_GGUF = os.path.join(PEERS, "models", "smollm2-135m-instruct-f32.gguf")
DEFAULT_LLAMA_SERVER = os.path.join(PEERS, "llama.cpp", "build", "bin", "llama-server")

SUBJECTS = ["the ocean", "a lighthouse keeper", "prime numbers", "the French revolution",
            "photosynthesis", "a chess opening", "the history of bread", "black holes"]
FORMS = ["Write a short story about {}.", "Explain {} to a ten-year-old.",
         "List three surprising facts about {}.", "Write a haiku about {}.",
         "What are the main arguments for and against studying {}?",
         "Describe {} in the style of a news report.",
         "Give me a step-by-step plan to learn about {} in a week.",
         "Summarise what an encyclopedia would say about {}."]


def prompts() -> list[str]:
    """64 prompts: 8 forms x 8 subjects, each in SmolLM2's chat template."""
    return [f"<|im_start|>user\n{form.format(subject)}<|im_end|>\n<|im_start|>assistant\n"
            for subject in SUBJECTS for form in FORMS]


def prompt_ids(model: str) -> list[list[int]]:
    """The prompts as the token ids both engines get (tidal would tokenize the text the same
    way: the HF tokenizer, special tokens parsed; SmolLM2 adds no BOS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.encode(text) for text in prompts()]


def run(model: str, kv_cache_dtype: str, ids: list[list[int]], tokens: int) -> tuple[list, float]:
    """Each prompt's (token ids, chosen-token logprobs), and the seconds generate took."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    with LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="1GiB",
             startup_timeout=300) as llm:
        start = time.perf_counter()
        outputs = llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    result = []
    for out in outputs:
        completion = out.outputs[0]
        chosen = [entry[token].logprob for entry, token in zip(completion.logprobs,
                                                               completion.token_ids)]
        result.append((list(completion.token_ids), chosen))
    return result, seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    """Until /health answers 200; RuntimeError if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} at start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while the model loads
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s")


def run_llama_cpp(binary: str, gguf: str, cache_type: str, ids: list[list[int]], tokens: int,
                  threads: int, log_path: str) -> tuple[list, float]:
    """`run`'s result from llama-server with `-ctk/-ctv cache_type`, started here and stopped
    by its PID; its log goes to `log_path`."""
    port = free_port()
    command = [binary, "-m", gguf, "-ctk", cache_type, "-ctv", cache_type, "-fa", "on",
               "-np", "1", "-c", "4096", "--seed", "0", "-t", str(threads),
               "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, server, timeout=300)
            start = time.perf_counter()
            result = [complete(url, prompt, tokens) for prompt in ids]
            seconds = time.perf_counter() - start
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return result, seconds


def complete(url: str, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """One greedy completion's token ids and each chosen token's logprob."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "seed": 0,
            "n_probs": 1, "post_sampling_probs": False, "return_tokens": True,
            "cache_prompt": False, "ignore_eos": True}
    reply = post(url + "/completion", body, timeout=600)
    chosen = reply["tokens"]
    probs = reply["completion_probabilities"]
    if len(chosen) != tokens or [p["id"] for p in probs] != chosen:
        raise RuntimeError(f"llama-server returned {len(chosen)} tokens / probs not matching")
    return chosen, [p["logprob"] for p in probs]


def compare(base: list, other: list, tokens: int) -> dict:
    exact = same = prefix = 0
    deltas = []
    for (ids, lps), (qids, qlps) in zip(base, other):
        first = next((k for k, (a, b) in enumerate(zip(ids, qids)) if a != b), len(ids))
        exact += first == len(ids)
        prefix += first
        same += sum(a == b for a, b in zip(ids, qids))
        deltas += [abs(a - b) for a, b in zip(lps[:first + 1], qlps[:first + 1])]
    n = len(base)
    return {"exact prompts": f"{exact}/{n}",
            "greedy agreement": f"{same / (n * tokens):.3f}",
            "common prefix": f"{prefix / n:.1f}/{tokens}",
            "mean |d logprob|": f"{sum(deltas) / len(deltas):.4f}",
            "max |d logprob|": f"{max(deltas):.4f}"}


def run_both_llama_cpp(parser, args, ids: list[list[int]]) -> dict:
    """{"f32": run, "q8_0": run} of llama-server, or a usage error if it is not built."""
    for path in (args.llama_server, args.gguf):
        if not os.path.exists(path):
            parser.error(f"{path} not found (/work/shared/peers/setup.sh builds it), "
                         "or pass --no-llama-cpp")
    runs = {}
    for cache_type in ("f32", "q8_0"):
        log = os.path.join(args.llama_log_dir, f"kv_dtype_tolerance-llama-{cache_type}.log")
        runs[cache_type] = run_llama_cpp(args.llama_server, args.gguf, cache_type, ids,
                                         args.tokens, args.llama_threads, log)
        print(f"llama.cpp {cache_type} KV cache: {runs[cache_type][1]:.1f} s (log {log})")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", nargs="+", default=["int8", "fp8"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    parser.add_argument("--gguf", default=DEFAULT_GGUF,
                        help="F32 GGUF of the same weights as --model")
    # one thread: the figures do not depend on it, and on the shared 2-core machine two
    # threads of ggml's spinning thread pool took 1.0-2.3 s a token (2026-12-04, load 8-10)
    parser.add_argument("--llama-threads", type=int, default=1)
    parser.add_argument("--llama-log-dir", default="/tmp",
                        help="where each llama-server run's log goes")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="tidal's rows only")
    parser.add_argument("--prompts", type=int, default=64,
                        help="the first N prompts only (a quick check of the script)")
    args = parser.parse_args()
    ids = prompt_ids(args.model)[:args.prompts]
    print(f"{len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{args.tokens} greedy tokens each")
    llama = {} if args.no_llama_cpp else run_both_llama_cpp(parser, args, ids)
    base, seconds = run(args.model, "auto", ids, args.tokens)
    print(f"tidal float32 KV cache: {seconds:.1f} s")
    rows = []
    for dtype in args.dtypes:
        other, seconds = run(args.model, dtype, ids, args.tokens)
        rows.append((f"tidal {dtype}", "tidal float32", compare(base, other, args.tokens),
                     seconds))
    if llama:
        rows.append(("llama.cpp q8_0", "llama.cpp f32",
                     compare(llama["f32"][0], llama["q8_0"][0], args.tokens), llama["q8_0"][1]))
        rows.append(("llama.cpp f32", "tidal float32",
                     compare(base, llama["f32"][0], args.tokens), llama["f32"][1]))
    keys = list(rows[0][2])
    print("| KV cache | against | " + " | ".join(keys) + " | generate s |")
    print("| --- " * (len(keys) + 3) + "|")
    for name, against, stats, seconds in rows:
        print(f"| {name} | {against} | " + " | ".join(stats[k] for k in keys)
              + f" | {seconds:.1f} |")


if __name__ == "__main__":
    main()
