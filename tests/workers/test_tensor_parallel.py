"""Issue 3, item 3: TP=2 on CPU (two processes, gloo) gives the same logits and the same
greedy tokens as TP=1, for split KV heads (2 over 2 ranks) and a replicated one (1 KV
head on 2 ranks)."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tidal.ipc.messages import SamplingParams
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config

PROMPT = list(range(5, 5 + 40))
# float64 everywhere. The all-reduce sums partial products in another order, so bit equality
# is not promised; we measure exactly 0 on these models and allow 1e-9 relative.
TOLERANCE = 1e-9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, **config) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits (chunks of 16) and 6 greedy tokens from a fresh worker."""
    worker = Worker(worker_config(path, dtype="float64", **config))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    script = PlanScript()
    script.add("logits", PROMPT)
    parts = []
    while script.requests["logits"].num_computed < len(PROMPT):
        parts.append(worker.runner.compute_logits_all(script.plan(16)))
    script.finish("logits")
    script.add("gen", PROMPT[:17], SamplingParams(temperature=0.0, max_tokens=6))
    tokens = script.run(worker, any_rank=True)["gen"]
    return torch.cat(parts), tokens


def _rank_main(rank: int, paths: list[str], port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    results = [_run(path, tensor_parallel_size=2, rank=rank,
                    dist_init_method=f"tcp://127.0.0.1:{port}") for path in paths]
    if rank == 0:
        torch.save(results, out_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(180)
def test_tp2_equals_tp1(tiny_llama, tiny_model_factory, tmp_path):
    paths = [tiny_llama, tiny_model_factory("llama", num_key_value_heads=1)]
    out_file = str(tmp_path / "tp2.pt")
    mp.spawn(_rank_main, args=(paths, _free_port(), out_file), nprocs=2, join=True)
    tp2 = torch.load(out_file)
    for path, (logits2, tokens2) in zip(paths, tp2):
        logits1, tokens1 = _run(path)
        rel = ((logits2 - logits1).abs().max() / logits1.abs().max()).item()
        assert rel < TOLERANCE, (path, rel)
        assert tokens2 == tokens1
