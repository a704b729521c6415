"""The transformers baselines `tidal bench throughput` runs on the same workload, same process.

- `run_hf_static`: `model.generate()` over static batches taken in workload order (vLLM's `hf`
  backend): left-padded, each batch generates until its longest request's output length with
  EOS suppressed (`min_new_tokens`), and only each request's own output length is counted as
  useful output, as vLLM counts it.
- `run_hf_continuous`: transformers' own continuous batching (`init_continuous_batching`
  manager, transformers >= 4.53): one `add_request` per request with its own `max_new_tokens`
  and EOS disabled, timed from the first add to the last result (warm-up excluded).

Both return the same result dict as the tidal run (see `throughput_result`).
"""

from __future__ import annotations

import time

from .datasets import BenchRequest


def throughput_result(backend: str, requests: list[BenchRequest], num_output_tokens: int,
                      elapsed_s: float) -> dict:
    """requests/s, output tokens/s and total tokens/s of one backend's run."""
    elapsed_s = max(elapsed_s, 1e-9)
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "backend": backend,
        "num_requests": len(requests),
        "elapsed_s": elapsed_s,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
        "requests_per_s": len(requests) / elapsed_s,
        "output_tokens_per_s": num_output_tokens / elapsed_s,
        "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / elapsed_s,
    }


def load_hf_model(model_path: str, dtype: str = "auto", attn_implementation: str = "sdpa"):
    """The transformers model (eval mode, CPU) with the dtype the engine would use."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype,
                                                 attn_implementation=attn_implementation)
    return model.eval()


def static_batches(requests: list[BenchRequest], max_batch_size: int) -> list[list[BenchRequest]]:
    """Consecutive groups of at most `max_batch_size` requests, in workload order."""
    return [requests[i: i + max_batch_size] for i in range(0, len(requests), max_batch_size)]


def _generate_static_batch(model, batch: list[BenchRequest], pad_id: int) -> None:
    import torch

    max_len = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding: prompts end at the same column
        input_ids[row, max_len - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, max_len - r.prompt_len:] = 1
    max_new = max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                       max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)


def run_hf_static(model, requests: list[BenchRequest], max_batch_size: int) -> dict:
    """Static batching through `generate()`; the first batch's first request warms up first."""
    pad_id = _pad_id(model)
    warm = requests[0]
    _generate_static_batch(model, [BenchRequest(warm.prompt, warm.prompt_len, 2,
                                                warm.prompt_token_ids)], pad_id)
    start = time.perf_counter()
    for batch in static_batches(requests, max_batch_size):
        _generate_static_batch(model, batch, pad_id)
    elapsed = time.perf_counter() - start
    return throughput_result("transformers-static", requests,
                             sum(r.output_len for r in requests), elapsed)


def _pad_id(model) -> int:
    config = model.generation_config
    for value in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def has_hf_continuous_batching(model) -> bool:
    """Whether the installed transformers offers `init_continuous_batching` (>= 4.53)."""
    return hasattr(model, "init_continuous_batching")


def run_hf_continuous(model, requests: list[BenchRequest], timeout_s: float = 3600.0) -> dict:
    """transformers' continuous batching over the whole workload (all added at once)."""
    import torch
    from transformers import GenerationConfig

    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model),
                                  max_new_tokens=max(r.output_len for r in requests))
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen_config, block=True, timeout=60.0) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(list(r.prompt_token_ids), request_id=f"req-{i}",
                                max_new_tokens=r.output_len, eos_token_id=-1)
        num_output_tokens = _collect_hf_results(manager, len(requests), timeout_s)
        elapsed = time.perf_counter() - start
    return throughput_result("transformers-continuous", requests, num_output_tokens, elapsed)


def _collect_hf_results(manager, num_requests: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    finished: dict[str, int] = {}
    while len(finished) < num_requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers continuous batching: {len(finished)} of "
                               f"{num_requests} requests done after {timeout_s} s")
        result = manager.get_result(timeout=1.0)
        if result is not None and result.is_finished():
            if result.error:
                raise RuntimeError(f"transformers continuous batching failed: {result.error}")
            finished[result.request_id] = len(result.generated_tokens)
    return sum(finished.values())
