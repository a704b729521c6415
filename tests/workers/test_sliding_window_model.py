"""A Mistral whose 20-position window is shorter than its prompts gives transformers' greedy
tokens through a worker with each CPU attention backend (issue 34), prompts whole (the
prefill chunk paths: SDPA with a banded mask, the C kernel's rows) and in chunks of 7 while
other requests decode. The full process tree (engine core freeing blocks, preemption, prefix
hits) is tests/e2e/test_sliding_window_e2e.py; the kernels against the reference are
tests/kernels/test_sliding_window.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tidal.ipc.messages import SamplingParams
from tidal.kernels.attention import cpu_attention
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config

NUM_NEW = 12
LENGTHS = (3, 19, 21, 45, 70)  # around and past the window of 20


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(34)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def tiny_mistral(tiny_model_factory) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="module")
def hf_greedy(tiny_mistral) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32)
    assert model.config.sliding_window == 20
    results = []
    with torch.no_grad():
        for prompt in _prompts():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                                 min_new_tokens=NUM_NEW, do_sample=False)
            results.append(out[0, len(prompt):].tolist())
    return results


@pytest.mark.parametrize("backend", ["cpu", "numba", "torch"])
def test_windowed_greedy_equals_transformers(tiny_mistral, hf_greedy, backend):
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX2/AVX-512 on this machine")
    worker = Worker(worker_config(tiny_mistral, attention_backend=backend))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    for chunk in (10**9, 7):
        script = PlanScript()
        for i, prompt in enumerate(_prompts()):
            script.add(f"r{i}", prompt, greedy, eos_token_id=0)
        outputs = script.run(worker, chunk=chunk)
        assert [outputs[f"r{i}"] for i in range(len(LENGTHS))] == hf_greedy, chunk
