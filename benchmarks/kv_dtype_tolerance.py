"""How far a quantized KV cache moves a real model's greedy output: SmolLM2-135M-Instruct,
64 prompts of our own, 32 greedy tokens each, `--kv-cache-dtype int8` (and fp8) against the
float32 cache of the same engine.

    python benchmarks/kv_dtype_tolerance.py [--model DIR] [--dtypes int8 fp8] [--tokens 32]

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
"""

from __future__ import annotations

import argparse
import os
import time

from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams

DEFAULT_MODEL = os.path.expanduser("~/.cache/tidal-peers/models/smollm2-135m-instruct")

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


def run(model: str, kv_cache_dtype: str, tokens: int) -> tuple[list, float]:
    """Each prompt's (token ids, chosen-token logprobs), and the seconds generate took."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    with LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="1GiB",
             startup_timeout=300) as llm:
        start = time.perf_counter()
        outputs = llm.generate(prompts(), params, use_tqdm=False)
        seconds = time.perf_counter() - start
    result = []
    for out in outputs:
        completion = out.outputs[0]
        chosen = [entry[token].logprob for entry, token in zip(completion.logprobs,
                                                               completion.token_ids)]
        result.append((list(completion.token_ids), chosen))
    return result, seconds


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", nargs="+", default=["int8", "fp8"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    base, seconds = run(args.model, "auto", args.tokens)
    print(f"float32 KV cache: {len(base)} prompts x {args.tokens} tokens in {seconds:.1f} s")
    rows = []
    for dtype in args.dtypes:
        other, seconds = run(args.model, dtype, args.tokens)
        rows.append((dtype, compare(base, other, args.tokens), seconds))
    keys = list(rows[0][1])
    print("| kv_cache_dtype | " + " | ".join(keys) + " | generate s |")
    print("| --- " * (len(keys) + 2) + "|")
    for dtype, stats, seconds in rows:
        print(f"| {dtype} | " + " | ".join(stats[k] for k in keys) + f" | {seconds:.1f} |")


if __name__ == "__main__":
    main()
