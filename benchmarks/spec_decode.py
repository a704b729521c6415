"""Speculative decoding on SmolLM2: decode tokens/s with speculation off, ngram and suffix,
each with the adaptive policy and with a fixed draft count (as other engines), at 1, 4 and 32
streams, on a copy-heavy workload (outputs that quote the prompt: code edits, extraction) and
a chat workload (outputs that do not).

    python benchmarks/spec_decode.py [MODEL_FOLDER] [--streams 1 4 32] [--rounds 2]

Every engine is started once and kept; the measurements alternate between them within each
round (off, ngram, ngram fixed, suffix, suffix fixed, then again), so a machine whose load
drifts affects them alike. Greedy sampling: every method's tokens are checked against the
engine without speculation (`same` counts the outputs that are identical). tokens/s is
generated tokens over the wall time of the batch (prefill included: the prompts are short
beside the outputs). The table gives each config's tokens/s and its ratio to off.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
'''

COPY_TASKS = [
    "Rewrite this Python code, renaming the function load_users to read_users. Output only "
    "the code.\n\n" + CODE,
    "Add a docstring to each function of this code and output the whole code.\n\n" + CODE,
    "Copy the following text exactly, then write DONE.\n\nThe quarterly report shows revenue "
    "of 4.2 million dollars, up 12 percent from last year. Costs rose to 3.1 million dollars. "
    "The board approved a new office in Lisbon and a hiring plan of 40 engineers.",
    "Extract every sentence that mentions a number from this text, word for word.\n\nThe "
    "bridge is 1200 meters long. It was opened in 1998 by the mayor. Traffic is heavy in the "
    "morning. About 45000 cars cross it every day. The toll is 3 euros for cars.",
]
CHAT_TASKS = [
    "Write a short story about a dragon who learns to cook.",
    "What are three tips for sleeping better?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me ideas for a birthday party for my grandmother.",
]

CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "ngram fixed": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "suffix fixed": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
}


def default_model() -> str:
    for pattern in ("~/.cache/tidal/gguf-v1/SmolLM2-135M-Instruct*",
                    "~/.cache/tidal-test/gguf-v1/SmolLM2-135M-Instruct*"):
        found = glob.glob(os.path.expanduser(pattern))
        if found:
            return found[0]
    sys.exit("no model folder given and no converted SmolLM2 in ~/.cache/tidal/gguf-v1 "
             "(run tests/e2e/test_real_model.py once, or pass a folder)")


def measure(llm, conversations, params, streams: int) -> tuple[float, float, list[list[int]]]:
    """(tokens/s, tokens per engine step, token ids per conversation) running `streams`
    conversations at a time. Tokens per step does not depend on the machine's load: without
    speculation it is the batch size, with it the accepted drafts add to it."""
    outputs = []
    before = llm.get_stats()
    start = time.perf_counter()
    for i in range(0, len(conversations), streams):
        outputs += llm.chat(conversations[i:i + streams], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    ids = [o.outputs[0].token_ids for o in outputs]
    per_step = (after.generation_tokens - before.generation_tokens) / max(
        1, after.num_steps - before.num_steps)
    return sum(map(len, ids)) / seconds, per_step, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tasks", type=int, default=4,
                        help="prompts per workload at 1 stream (at N streams: N prompts)")
    args = parser.parse_args()
    from tidal.frontend import LLM, SamplingParams

    model = args.model or default_model()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {}
    for name in args.configs:
        spec = CONFIGS[name]
        engines[name] = LLM(model, kv_cache_memory="256MiB", max_model_len=1024,
                            speculative_config=None if spec is None else json.dumps(spec))
    workloads = {"copy": COPY_TASKS, "chat": CHAT_TASKS}
    rates: dict[tuple, list[float]] = {}
    same: dict[tuple, list[int]] = {}
    steps: dict[tuple, list[float]] = {}
    try:
        for _ in range(args.rounds):
            for wname, tasks in workloads.items():
                for streams in args.streams:
                    n = streams if streams > 1 else args.tasks
                    convs = [[{"role": "user", "content": tasks[i % len(tasks)]}]
                             for i in range(n)]
                    reference = None
                    for name, llm in engines.items():
                        rate, per_step, ids = measure(llm, convs, params, streams)
                        rates.setdefault((wname, streams, name), []).append(rate)
                        steps.setdefault((wname, streams, name), []).append(per_step)
                        print(f"# {wname} {streams} stream(s) {name}: {rate:.2f} tokens/s, "
                              f"{per_step:.2f} tokens/step", flush=True)
                        if reference is None:
                            reference = ids
                        same.setdefault((wname, streams, name), []).append(
                            sum(a == b for a, b in zip(ids, reference)))
        stats = {name: llm.get_stats() for name, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.close()
    print(f"model {model}, {args.max_tokens} tokens per output, greedy, median of "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    names = list(engines)
    print(f"{'workload':9}{'streams':>8}  " + "".join(f"{n:>18}" for n in names))
    for wname in workloads:
        for streams in args.streams:
            base = statistics.median(rates[(wname, streams, names[0])])
            cells = []
            for name in names:
                r = statistics.median(rates[(wname, streams, name)])
                cells.append(f"{r:8.1f} ({r / base:4.2f}x)")
            print(f"{wname:9}{streams:>8}  " + "".join(f"{c:>18}" for c in cells))
    print("tokens per engine step (independent of the machine's load):")
    for wname in workloads:
        for streams in args.streams:
            cells = [f"{statistics.median(steps[(wname, streams, n)]):.2f}" for n in names]
            print(f"{wname:9}{streams:>8}  " + "".join(f"{c:>18}" for c in cells))
    print("outputs identical to off's: " + ", ".join(
        f"{n} {sum(sum(v) for k, v in same.items() if k[2] == n)}/"
        f"{sum(len(v) * (k[1] if k[1] > 1 else args.tasks) for k, v in same.items() if k[2] == n)}"
        for n in names))
    for name, s in stats.items():
        if s.spec_num_draft_tokens:
            print(f"{name}: {s.spec_num_drafts} drafts, {s.spec_num_draft_tokens} draft tokens, "
                  f"{s.spec_num_accepted_tokens} accepted "
                  f"({s.spec_num_accepted_tokens / s.spec_num_draft_tokens:.0%}), per position "
                  f"{s.spec_accepted_per_pos}")


if __name__ == "__main__":
    main()
