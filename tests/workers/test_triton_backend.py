"""The worker through the Triton attention backend (interpreted on CPU by the tests'
conftest) agrees with the torch backend: the metadata the runner builds (int32 block
tables / query_start_loc / seq_lens, int64 slots, a block-table width per batch) is what
the kernels expect."""

import pytest
import torch

from tidal.ipc.messages import SamplingParams
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config


def _worker(path: str, backend: str) -> Worker:
    worker = Worker(worker_config(path, attention_backend=backend))
    worker.load()
    worker.init_kv_cache(16)
    return worker


def _chunked_prefill_logits(worker: Worker) -> torch.Tensor:
    """Two prompts (20 and 18 tokens) in chunks of 8: later chunks attend to cached K/V."""
    script = PlanScript()
    script.add("a", list(range(3, 23)))
    script.add("b", list(range(40, 58)))
    return torch.cat([worker.runner.compute_logits_all(script.plan(8)) for _ in range(3)])


def _greedy_tokens(worker: Worker) -> dict:
    script = PlanScript(first_block=8)
    script.add("c", list(range(60, 71)), SamplingParams(temperature=0.0, max_tokens=3))
    script.add("d", list(range(80, 83)), SamplingParams(temperature=0.0, max_tokens=3))
    return script.run(worker, chunk=8)


@pytest.fixture(scope="module")
def workers(tiny_qwen3):
    return _worker(tiny_qwen3, "triton"), _worker(tiny_qwen3, "torch")


def test_prefill_chunks_match(workers):
    triton, ref = (_chunked_prefill_logits(w) for w in workers)
    assert triton.shape == ref.shape == (38, 512)
    assert torch.allclose(triton, ref, rtol=1e-4, atol=1e-4)


def test_decode_tokens_match(workers):
    assert _greedy_tokens(workers[0]) == _greedy_tokens(workers[1])
