"""Speculative decoding on SmolLM2: decode tokens/s with speculation off, ngram and suffix,
each with the adaptive policy and with a fixed draft count (as other engines), at 1, 4 and 32
streams, on a copy-heavy workload (outputs that quote the prompt: code edits, extraction) and
a chat workload (outputs that do not). Every conversation of a run has its own prompt
(`prompt`: the tasks with other names and numbers each time), so the suffix method's store
of earlier outputs holds no answer to a repeated question.

    python benchmarks/spec_decode.py [MODEL_FOLDER] [--streams 1 4 32] [--rounds 2]
        [--draft-model FOLDER ...] [--configs off ...] [--workloads copy chat]

Every engine is started once and kept; the measurements alternate between them within each
round (off, ngram, ngram fixed, suffix, suffix fixed, then again), so a machine whose load
drifts affects them alike. Greedy sampling: every method's tokens are checked against the
engine without speculation (`same` counts the outputs that are identical). tokens/s is
generated tokens over the wall time of the batch, prefill included (the chat prompts are
short beside their outputs; the copy prompts are not: 95-147 tokens for outputs of 43-96).
The first table gives each config's tokens/s and its ratio to off; the second, decode
tokens/s, leaves the prefill out (each batch from its first token to its last), the rate
the issue's single-stream goal speaks of.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

CODE = '''def load_{things}(path):
    {things} = []
    with open(path) as f:
        for line in f:
            name, {field}, email = line.strip().split(",")
            {things}.append({{"name": name, "{field}": int({field}), "email": email}})
    return {things}


def {adjective}({things}):
    return [u for u in {things} if u["{field}"] >= {limit}]
'''
THINGS = ["users", "orders", "books", "songs", "tickets", "patients", "players", "cars",
          "flights", "students", "invoices", "recipes", "rooms", "plants", "movies", "trips"]
FIELDS = ["age", "price", "pages", "year", "score", "weight", "level", "rank"]
CITIES = ["Lisbon", "Oslo", "Denver", "Osaka", "Nairobi", "Lyon", "Perth", "Quito"]
COPY_TASKS = [
    lambda t, f, n, c: "Rewrite this Python code, renaming the function load_{0} to "
    "read_{0}. Output only the code.\n\n".format(t) + CODE.format(
        things=t, field=f, adjective="selected", limit=n % 90 + 10),
    lambda t, f, n, c: "Add a docstring to each function of this code and output the whole "
    "code.\n\n" + CODE.format(things=t, field=f, adjective="filtered", limit=n % 70 + 5),
    lambda t, f, n, c: "Copy the following text exactly, then write DONE.\n\nThe quarterly "
    f"report on {t} shows revenue of {n % 9 + 1}.{n % 7} million dollars, up {n % 30 + 2} "
    f"percent from last year. Costs rose to {n % 5 + 1}.{n % 3} million dollars. The board "
    f"approved a new office in {c} and a hiring plan of {n % 60 + 10} engineers.",
    lambda t, f, n, c: "Extract every sentence that mentions a number from this text, word for "
    f"word.\n\nThe bridge in {c} is {n % 2000 + 300} meters long. It was opened in "
    f"{1950 + n % 70} by the mayor. Traffic is heavy in the morning. About {n % 90 + 10}000 "
    f"cars cross it every day. The toll is {n % 9 + 1} euros for cars.",
]
ANIMALS = ["dragon", "penguin", "fox", "robot", "turtle", "owl", "whale", "goat", "cat",
           "bear", "snail", "parrot", "horse", "frog", "tiger", "beetle"]
SKILLS = ["cook", "paint", "swim", "sing", "fly a kite", "play chess", "garden", "dance"]
TIPS = ["sleeping better", "learning a language", "saving money", "running a marathon",
        "cooking rice", "writing essays", "keeping plants alive", "staying focused"]
WHYS = ["the sky is blue", "leaves change color", "the sea is salty", "we have seasons",
        "ice floats", "the moon has phases", "thunder follows lightning", "bread rises"]
EVENTS = ["birthday party", "picnic", "game night", "weekend trip", "dinner", "garden party",
          "holiday", "movie night"]
RELATIVES = ["grandmother", "brother", "best friend", "neighbour"]
CHAT_TASKS = [
    lambda t, f, n, c: f"Write a short story about a {ANIMALS[n % 16]} who learns to "
    f"{SKILLS[n // 16 % 8]}.",
    lambda t, f, n, c: f"What are three tips for {TIPS[n % 8]} in {CITIES[n // 8 % 8]}?",
    lambda t, f, n, c: f"Explain why {WHYS[n % 8]} to a {n // 8 % 6 + 7}-year-old.",
    lambda t, f, n, c: f"Give me ideas for a {EVENTS[n % 8]} for my "
    f"{RELATIVES[n // 8 % 4]} in {c}.",
]


def prompt(tasks: list, index: int) -> str:
    """The index-th prompt of a workload: its tasks in turn, each time with other names and
    numbers, so no two prompts of a run are alike (the suffix method would otherwise find
    earlier rounds' outputs in its store and look better than on fresh requests)."""
    n = index // len(tasks)
    return tasks[index % len(tasks)](THINGS[n % 16], FIELDS[n // 16 % 8], n * 37 + 11,
                                     CITIES[n % 8])


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


def measure(llm, conversations, params, streams: int
            ) -> tuple[float, float, float, list[list[int]]]:
    """(tokens/s, decode tokens/s, tokens per engine step, token ids per conversation)
    running `streams` conversations at a time. Decode tokens/s leaves the prefill out: the
    tokens after each output's first over the time from each batch's first token to its
    last (the copy prompts are 95-147 tokens against outputs of 43-96, so their prefill is
    a fifth of a run without speculation). Tokens per step does not depend on the
    machine's load: without speculation it is the batch size, with it the accepted drafts
    add to it."""
    outputs = []
    before = llm.get_stats()
    start = time.perf_counter()
    decode_s = 0.0
    for i in range(0, len(conversations), streams):
        batch = llm.chat(conversations[i:i + streams], params, use_tqdm=False)
        decode_s += (max(o.metrics.last_token_time for o in batch)
                     - min(o.metrics.first_token_time for o in batch))
        outputs += batch
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    ids = [o.outputs[0].token_ids for o in outputs]
    per_step = (after.generation_tokens - before.generation_tokens) / max(
        1, after.num_steps - before.num_steps)
    decode_rate = sum(len(i) - 1 for i in ids) / max(decode_s, 1e-9)
    return sum(map(len, ids)) / seconds, decode_rate, per_step, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat"],
                        choices=["copy", "chat"])
    parser.add_argument("--draft-model", action="append", default=[], metavar="FOLDER",
                        help="add configs 'draft NAME' and 'draft NAME fixed' (method "
                        "draft_model with this folder; repeatable)")
    parser.add_argument("--tasks", type=int, default=4,
                        help="prompts per workload at 1 stream (at N streams: N prompts)")
    args = parser.parse_args()
    from tidal.frontend import LLM, SamplingParams

    model = args.model or default_model()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    configs = {name: CONFIGS[name] for name in args.configs}
    for folder in args.draft_model:
        draft = {"method": "draft_model", "model": folder, "num_speculative_tokens": 4}
        label = os.path.basename(os.path.normpath(folder))
        configs[f"draft {label}"] = draft
        configs[f"draft {label} fixed"] = dict(draft, adaptive=False)
    engines = {}
    for name, spec in configs.items():
        engines[name] = LLM(model, kv_cache_memory="256MiB", max_model_len=1024,
                            speculative_config=None if spec is None else json.dumps(spec))
    workloads = {w: {"copy": COPY_TASKS, "chat": CHAT_TASKS}[w] for w in args.workloads}
    rates: dict[tuple, list[float]] = {}
    decode_rates: dict[tuple, list[float]] = {}
    same: dict[tuple, list[int]] = {}
    steps: dict[tuple, list[float]] = {}
    used = {wname: 0 for wname in workloads}  # prompts of each workload so far
    try:
        for _ in range(args.rounds):
            for wname, tasks in workloads.items():
                for streams in args.streams:
                    n = streams if streams > 1 else args.tasks
                    convs = [[{"role": "user", "content": prompt(tasks, used[wname] + i)}]
                             for i in range(n)]
                    used[wname] += n
                    reference = None
                    for name, llm in engines.items():
                        rate, decode_rate, per_step, ids = measure(llm, convs, params,
                                                                   streams)
                        rates.setdefault((wname, streams, name), []).append(rate)
                        decode_rates.setdefault((wname, streams, name), []).append(decode_rate)
                        steps.setdefault((wname, streams, name), []).append(per_step)
                        print(f"# {wname} {streams} stream(s) {name}: {rate:.2f} tokens/s, "
                              f"decode {decode_rate:.2f} tokens/s, {per_step:.2f} tokens/step",
                              flush=True)
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
    width = max(18, *(len(n) + 2 for n in names))
    print(f"{'workload':9}{'streams':>8}  " + "".join(f"{n:>{width}}" for n in names))
    _rate_rows(rates, workloads, args.streams, names, width)
    print("decode tokens/s (each batch's first token to its last: its prefill left out):")
    _rate_rows(decode_rates, workloads, args.streams, names, width)
    print("tokens per engine step (independent of the machine's load):")
    for wname in workloads:
        for streams in args.streams:
            cells = [f"{statistics.median(steps[(wname, streams, n)]):.2f}" for n in names]
            print(f"{wname:9}{streams:>8}  " + "".join(f"{c:>{width}}" for c in cells))
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


def _rate_rows(rates: dict, workloads, streams_list, names: list[str], width: int) -> None:
    """One row per workload and stream count: each config's median rate and its ratio to
    the first config's (off)."""
    for wname in workloads:
        for streams in streams_list:
            base = statistics.median(rates[(wname, streams, names[0])])
            cells = []
            for name in names:
                r = statistics.median(rates[(wname, streams, name)])
                cells.append(f"{r:8.1f} ({r / base:4.2f}x)")
            print(f"{wname:9}{streams:>8}  " + "".join(f"{c:>{width}}" for c in cells))


if __name__ == "__main__":
    main()
