"""A batch mixing four LoRA adapters against the base model alone, on one engine.

    python benchmarks/lora.py [MODEL_FOLDER] [--requests 16] [--rank 16] [--rounds 3]
                              [--experts]

Makes four random PEFT adapters (rank --rank, every attention and MLP projection; with
--experts, for an MoE model, also its experts' stacked gate_up_proj and down_proj, PEFT's
`target_parameters`) for the model in a temporary folder, starts one engine with
--enable-lora --max-loras 4, and runs the same offline batch (--requests prompts of 64
tokens, 64 greedy tokens each) in turn: every request on the base model, then the requests
spread over the four adapters; rounds alternate which goes first. Prints each run's seconds
per engine step (wall time / steps the scheduler counted) and the median ratio adapters /
base (docs/performance.md keeps the figures).
The default model is SmolLM2-135M-Instruct's folder converted from the tests' GGUF file.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time


def default_model() -> str:
    found = glob.glob(os.path.expanduser("~/.cache/tidal/gguf-v1/SmolLM2-135M-Instruct*"))
    if not found:
        sys.exit("no model folder given and no converted SmolLM2 in ~/.cache/tidal/gguf-v1 "
                 "(run tests/e2e/test_real_model.py once, or pass a folder)")
    return found[0]


def make_adapters(model: str, root: str, rank: int, count: int,
                  experts: bool = False) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"] if experts
            else None))
        path = os.path.join(root, f"adapter{i}")
        peft.save_pretrained(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="the worker's threads (1 on a shared machine: no OpenMP barrier "
                        "waits for a time slice)")
    parser.add_argument("--experts", action="store_true",
                        help="adapters on an MoE model's experts too (target_parameters)")
    args = parser.parse_args()
    model = args.model or default_model()

    from transformers import AutoTokenizer

    from tidal.frontend import LLM, LoRARequest, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        paths = make_adapters(model, root, args.rank, 4, args.experts)
        loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
        span = min(1000, len(AutoTokenizer.from_pretrained(model)) - 10)  # a tiny vocabulary
        prompts = [[(7 * r + 13 * t) % span + 10 for t in range(args.prompt_len)]
                   for r in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        with LLM(model, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                 dtype="float32", kv_cache_memory="256MiB", cpu_threads=args.cpu_threads,
                 max_model_len=args.prompt_len + args.max_tokens + 16) as llm:
            llm.generate(prompts[:4], params, use_tqdm=False, lora_request=loras)  # warm-up
            kinds = {"base": None, "4 adapters": [loras[r % 4] for r in range(len(prompts))]}
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for rnd in range(args.rounds):
                order = list(kinds) if rnd % 2 == 0 else list(kinds)[::-1]
                for kind in order:
                    # a distinct first token per round: no prefix-cache hits across runs
                    batch = [[rnd * 3 + 1 + (kind == "base")] + p[1:] for p in prompts]
                    steps = llm.get_stats().num_steps
                    start = time.perf_counter()
                    llm.generate(batch, params, use_tqdm=False, lora_request=kinds[kind])
                    elapsed = time.perf_counter() - start
                    per_step = elapsed / (llm.get_stats().num_steps - steps)
                    times[kind].append(per_step)
                    print(f"round {rnd}: {kind:>10}: {per_step * 1e3:7.2f} ms/step "
                          f"({elapsed:.2f} s)", flush=True)
    base, mixed = statistics.median(times["base"]), statistics.median(times["4 adapters"])
    print(f"median ms/step: base {base * 1e3:.2f}, 4 adapters {mixed * 1e3:.2f}, "
          f"ratio {mixed / base:.2f}x ({args.requests} requests, rank {args.rank}, "
          f"{args.prompt_len}-token prompts, {args.max_tokens} tokens each)")


if __name__ == "__main__":
    main()
