"""Offline benchmarks through `LLM`: `throughput`, `latency` and the engine-overhead figure.

- `run_throughput`: the whole workload in one `LLM.generate` call (greedy, `ignore_eos`, each
  request's own `max_tokens`), then the same workload through the transformers baselines in
  the same process (`hf_baselines`), and the ratios of tidal's output tokens/s to theirs.
- `run_latency`: one batch of `batch_size` identical-shape requests, generated `num_iters`
  times after `num_iters_warmup`; average and percentiles of the batch latency.
- `run_overhead`: engine steps per second on a one-layer, hidden-64 random-weight Llama (the
  model is so small that a step's time is the engine's own overhead: scheduling, messaging,
  batch preparation), with async scheduling on and off.
- `make_random_llama`: such random-weight Llama folders of any shape, using an existing
  model's tokenizer (no download), for the overhead figure and the models of
  benchmarks/archive/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from .datasets import BenchRequest
from .hf_baselines import throughput_result
from ...ipc.messages import SamplingParams

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def open_llm(config):
    """An `LLM` that starts its own engine-core daemon for `config` (an `EngineConfig`)."""
    from ..llm import LLM

    model, flags = llm_kwargs(config)
    return LLM(model, **flags)


def llm_kwargs(config) -> tuple[str, dict]:
    """`config` as `LLM(model, **flags)` arguments (through the flags that rebuild it)."""
    import argparse

    from ...engine_core.args import add_engine_args, config_to_argv

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    ns = parser.parse_args(config_to_argv(config))
    flags = {a.dest: getattr(ns, a.dest) for a in parser._actions
             if a.dest not in ("model_tag", "model")}
    return ns.model, flags


def greedy_params(output_len: int) -> SamplingParams:
    """Exactly `output_len` tokens, greedily (EOS ignored)."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def generate_requests(llm, requests: list[BenchRequest], use_tqdm: bool) -> int:
    """Generate the workload in one call; the number of output tokens produced."""
    prompts = [r.prompt_token_ids if r.prompt_token_ids is not None else r.prompt
               for r in requests]
    params = [greedy_params(r.output_len) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


def run_tidal_throughput(config, requests: list[BenchRequest], use_tqdm: bool = True) -> dict:
    """tidal's throughput on the workload (a two-request warm-up first, not timed)."""
    start_open = time.perf_counter()
    llm = open_llm(config)
    try:
        ready_s = time.perf_counter() - start_open
        generate_requests(llm, requests[:2], use_tqdm=False)
        start = time.perf_counter()
        num_output_tokens = generate_requests(llm, requests, use_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    result = throughput_result("tidal", requests, num_output_tokens, elapsed)
    result["ready_s"] = ready_s
    return result


def compare_to_baselines(tidal: dict, baselines: list[dict]) -> dict[str, float]:
    """tidal's output tokens/s divided by each baseline's, keyed by baseline name."""
    return {b["backend"]: tidal["output_tokens_per_s"] / max(b["output_tokens_per_s"], 1e-9)
            for b in baselines}


def format_throughput(results: list[dict], ratios: dict[str, float]) -> str:
    """vLLM's one-line-per-backend report, then the ratio lines."""
    lines = []
    for r in results:
        lines.append(f"{r['backend']:<24} Throughput: {r['requests_per_s']:.2f} requests/s, "
                     f"{r['total_tokens_per_s']:.2f} total tokens/s, "
                     f"{r['output_tokens_per_s']:.2f} output tokens/s "
                     f"({r['num_requests']} requests, {r['total_prompt_tokens']} prompt + "
                     f"{r['total_output_tokens']} output tokens in {r['elapsed_s']:.2f} s)")
    for r in results:
        if "ready_s" in r:
            lines.append(f"{r['backend']}: LLM(...) ready in {r['ready_s']:.2f} s")
    for name, ratio in ratios.items():
        lines.append(f"tidal / {name}: {ratio:.2f}x output tokens/s")
    return "\n".join(lines)


def run_latency(config, input_len: int, output_len: int, batch_size: int,
                num_iters_warmup: int, num_iters: int, seed: int = 0) -> dict:
    """Latency of one batch, repeated; seconds, with percentiles."""
    rng = np.random.default_rng(seed)
    llm = open_llm(config)
    try:
        vocab = _safe_token_ids(llm)
        prompts = [[int(t) for t in rng.choice(vocab, size=input_len)] for _ in range(batch_size)]
        params = greedy_params(output_len)
        for _ in range(num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        latencies = []
        for _ in range(num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
    finally:
        llm.close()
    arr = np.asarray(latencies)
    return {
        "input_len": input_len, "output_len": output_len, "batch_size": batch_size,
        "num_iters": num_iters, "avg_latency_s": float(arr.mean()),
        "latencies_s": latencies,
        "percentiles_s": {str(p): float(np.percentile(arr, p)) for p in LATENCY_PERCENTILES},
    }


def _safe_token_ids(llm) -> np.ndarray:
    tokenizer = llm.tokenizer
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def format_latency(result: dict) -> str:
    """Average latency and its percentiles, as vLLM prints them."""
    lines = [f"Avg latency: {result['avg_latency_s']:.4f} seconds "
             f"(batch {result['batch_size']}, {result['input_len']} in, "
             f"{result['output_len']} out, {result['num_iters']} iterations)"]
    for p, value in result["percentiles_s"].items():
        lines.append(f"{p}% percentile latency: {value:.4f} seconds")
    return "\n".join(lines)


def make_random_llama(dst: str, tokenizer_src: str, hidden_size: int, num_layers: int,
                      max_position_embeddings: int = 2048, seed: int = 0) -> str:
    """A random-weight Llama folder at `dst` with `tokenizer_src`'s tokenizer; returns `dst`.

    Heads of dimension 64 (at least one), MLP 4x hidden, float32. Reuses `dst` if it already
    holds a model of this shape.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": hidden_size, "num_hidden_layers": num_layers}
    if _folder_has_shape(dst, shape):
        return dst
    os.makedirs(dst, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src, local_files_only=True)
    tokenizer.save_pretrained(dst)
    num_heads = max(1, hidden_size // 64)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def _folder_has_shape(path: str, shape: dict) -> bool:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return all(config.get(k) == v for k, v in shape.items()) and \
        os.path.exists(os.path.join(path, "model.safetensors"))


def count_parameters(model_dir: str) -> int:
    """Parameters in a safetensors model folder (reads headers only)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="np") as f:
        for name in f.keys():
            total += int(np.prod(f.get_slice(name).get_shape()))
    return total


def run_overhead(config, batch_size: int, output_len: int, num_iters: int) -> dict:
    """Engine steps/s with async scheduling on and off (same config otherwise)."""
    runs = {}
    for async_on in (True, False):
        run_config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, async_scheduling=async_on))
        runs["async" if async_on else "sync"] = _steps_per_second(
            run_config, batch_size, output_len, num_iters)
    return {"batch_size": batch_size, "output_len": output_len, **runs}


def _steps_per_second(config, batch_size: int, output_len: int, num_iters: int) -> dict:
    """Decode-dominated runs: one batch of 8-token prompts, `output_len` tokens each."""
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(batch_size)]
    params = greedy_params(output_len)
    llm = open_llm(config)
    try:
        llm.generate(prompts, params, use_tqdm=False)
        steps_before = _num_steps(llm)
        start = time.perf_counter()
        for _ in range(num_iters):
            llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_steps = _num_steps(llm) - steps_before
    finally:
        llm.close()
    return {"num_steps": num_steps, "elapsed_s": elapsed, "steps_per_s": num_steps / elapsed,
            "output_tokens_per_s": batch_size * output_len * num_iters / elapsed}


def _num_steps(llm) -> int:
    return int(llm.get_stats().num_steps)


def format_overhead(result: dict) -> str:
    """Two lines: steps/s with async scheduling on and off."""
    lines = []
    for key in ("async", "sync"):
        r = result[key]
        lines.append(f"engine overhead, {key:>5} scheduling: {r['steps_per_s']:.1f} steps/s "
                     f"({r['num_steps']} steps in {r['elapsed_s']:.2f} s, batch "
                     f"{result['batch_size']}, {r['output_tokens_per_s']:.0f} output tokens/s)")
    return "\n".join(lines)
