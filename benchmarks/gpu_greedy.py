"""Greedy tokens of tidal on a CUDA device against transformers', CUDA graphs on and off.

    python benchmarks/gpu_greedy.py MODEL_DIR [--dtype float32|bfloat16] [--prompts 8]

MODEL_DIR is an HF folder (benchmarks/gpu_check.sh makes one with SmolLM2-135M's config and
tokenizer and random weights: the real weights do not fit the 64 MiB the device machine is
sent). Prompts of 5-200 random token ids, 32 new tokens each, all in one batch (so decode
steps run at batch 8 through the captured graphs). Compared as vLLM's tests do: each sequence
up to transformers' first position whose top-2 logprob gap is below --tie-gap (float32: 1e-3,
bfloat16: 0.1, where one rounding flips near-ties). TF32 is off in float32 on both sides.
Prints one line per configuration and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def hf_reference(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype, device):
    """transformers' greedy tokens and top-2 logprob gaps per prompt (one at a time)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 output_logits=True, return_dict_in_generate=True)
            gaps = []
            for logits in gen.logits:
                top2 = torch.topk(logits[0].float().log_softmax(-1), 2).values
                gaps.append(float(top2[0] - top2[1]))
            result.append((gen.sequences[0, len(p):].tolist(), gaps))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def compare(got: list[list[int]], reference, tie_gap: float) -> tuple[int, int, list[str]]:
    """(tokens compared, tokens in all, mismatch descriptions)."""
    compared, total, bad = 0, 0, []
    for i, (tokens, (ref, gaps)) in enumerate(zip(got, reference)):
        upto = next((k for k, g in enumerate(gaps) if g < tie_gap), len(ref))
        total += len(ref)
        compared += upto
        if tokens[:upto] != ref[:upto]:
            first = next(k for k in range(upto) if k >= len(tokens) or tokens[k] != ref[k])
            bad.append(f"prompt {i}: first difference at token {first} "
                       f"(tidal {tokens[first:first + 4]}, transformers {ref[first:first + 4]})")
    return compared, total, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tie-gap", type=float, default=None)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of this script (graphs do not apply)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_greedy: no CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tie_gap = args.tie_gap if args.tie_gap is not None else (
        1e-3 if args.dtype == "float32" else 0.1)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 200))]
               for _ in range(args.prompts)]
    reference = hf_reference(args.model, prompts, args.max_tokens, dtype, args.device)

    from tidal.frontend.llm import LLM
    from tidal.ipc.messages import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    failed = False
    for eager in (True, False) if args.device == "cuda" else (True,):
        start = time.perf_counter()
        with LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=eager,
                 kv_cache_memory="4GiB" if args.device == "cuda" else "256MiB",
                 max_model_len=1024) as llm:
            ready = time.perf_counter() - start
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        got = [o.outputs[0].token_ids for o in outputs]
        compared, total, bad = compare(got, reference, tie_gap)
        name = "eager" if eager else "CUDA graphs"
        verdict = "OK" if not bad else "MISMATCH"
        print(f"gpu_greedy {args.dtype} {name}: {verdict}: {compared}/{total} tokens compared "
              f"(tie gap {tie_gap}), ready in {ready:.1f} s")
        for line in bad:
            print("   ", line)
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
