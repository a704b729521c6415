"""Issue 3, item 3: TP=2 on CPU (two processes, gloo) gives the same logits and the same
greedy tokens as TP=1, for split KV heads (2 over 2 ranks) and a replicated one (1 KV
head on 2 ranks); both ranks sample the same tokens, unseeded random sampling included.
Prompt logprobs (whose logits every rank gathers) equal TP=1's; only rank 0 packs them.
A grammar-constrained request sampled at temperature 1 gets the same tokens on every rank
(each rank masks with its own matcher) and at TP=1.

Issue 34: every model family's TP=2 split (dense: Granite 3, OLMo 2 with its q/k norms
all-reduced, Phi-3 with its fused checkpoint projections split over the ranks, Gemma 2;
mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE with one KV head, Granite-MoE, every
expert's matrices split): float64 prompt logits, chunked, equal transformers'. The
end-to-end family tests (tests/e2e/test_dense_families_e2e.py, test_moe_llm.py) run Gemma 3
and Qwen2-MoE at TP=2 through the whole engine and the other families at TP=1.

Both ranks run in one spawn of two processes (a module fixture) for every test here: each
spawn costs two interpreters importing torch and the worker."""

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tidal.ipc.messages import SamplingParams, StructuredOutputsParams
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


def _run(path: str, **config) -> tuple[torch.Tensor, list[int], list[int], list]:
    """Prompt logits (chunks of 16), 6 greedy tokens and 6 unseeded temperature-1 tokens
    from a fresh worker, and the prompt logprobs (as packed) of a 30-token prompt."""
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
    script.add("random", PROMPT[:9], SamplingParams(temperature=1.0, max_tokens=6))
    script.add("choice", PROMPT[:12], SamplingParams(
        temperature=1.0, max_tokens=6, structured_outputs=StructuredOutputsParams(
            choice=["apple", "banana", "cherry"])), eos_token_id=0)
    outputs = script.run(worker, any_rank=True)
    script.add("plp", PROMPT[:30], SamplingParams(temperature=0.0, max_tokens=1,
                                                  prompt_logprobs=2))
    prompt_logprobs = []
    while script.requests:
        result = worker.runner.execute(script.plan(16))
        prompt_logprobs += [(p.start, p.token_ids, p.logprobs, p.ranks)
                            for p in result.prompt_logprobs]
        script.record(result)
    return (torch.cat(parts), outputs["gen"], outputs["random"], prompt_logprobs,
            outputs["choice"])


# arch -> (tiny-model overrides, prompt length, float64 tolerance against transformers).
# Dense prompts stay inside the tiny Phi-3's original 40 positions (past them transformers'
# one-call forward switches to LongRoPE's long factors: tests/workers/test_dense_families.py).
# Measured (both ranks alike): Granite 3.5e-16, Phi-3 2.2e-16; OLMo 2 3.2e-7 (its q/k norms'
# float32 statistics, added across ranks in another order); Gemma 2 9.5e-8 (transformers'
# float32 softmax in its eager attention); the MoE families 0.8-1.8e-7 (OLMoE the most).
FAMILIES = {
    "granite": ({}, 30, 1e-9),
    "olmo2": ({}, 30, 1e-6),
    "phi3": ({}, 30, 1e-9),
    "gemma2": ({}, 30, 1e-6),
    "mixtral": ({}, 50, 1e-6),
    "qwen2_moe": ({}, 50, 1e-6),
    "qwen3_moe": ({}, 50, 1e-6),
    "olmoe": ({"num_key_value_heads": 1}, 50, 1e-6),
    "granitemoe": ({}, 50, 1e-6),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")


def _family_logits(path: str, num_tokens: int, rank: int, port: int) -> torch.Tensor:
    from worker_test_utils import chunked_logits, prompt_ids

    worker = Worker(worker_config(path, dtype="float64", tensor_parallel_size=2, rank=rank,
                                  dist_init_method=f"tcp://127.0.0.1:{port}"))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    return chunked_logits(worker, prompt_ids(7, num_tokens), 16, "family")


def _rank_main(rank: int, paths: list[str], families: list[tuple[str, int]], port: int,
               out_file: str) -> None:
    torch.set_num_threads(1)
    results = [_run(path, tensor_parallel_size=2, rank=rank,
                    dist_init_method=f"tcp://127.0.0.1:{port}") for path in paths]
    family_logits = [_family_logits(path, n, rank, port) for path, n in families]
    torch.save((results, family_logits), f"{out_file}.{rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(tiny_llama, tiny_model_factory, tmp_path_factory):
    """Both ranks' results (rank 0's, rank 1's): `_run` of the tiny Llama and of a
    one-KV-head Llama, then each family's chunked prompt logits; and their folders."""
    paths = [tiny_llama, tiny_model_factory("llama", num_key_value_heads=1)]
    families = {arch: (tiny_model_factory(arch, **overrides), n)
                for arch, (overrides, n, _) in FAMILIES.items()}
    out_file = str(tmp_path_factory.mktemp("tp2") / "tp2.pt")
    mp.spawn(_rank_main, args=(paths, list(families.values()), _free_port(), out_file),
             nprocs=2, join=True)
    return paths, families, [torch.load(f"{out_file}.{r}") for r in range(2)]


def _decode(path: str, token_ids: list[int]) -> str:
    from tokenizers import Tokenizer  # not transformers': seconds less to load

    return Tokenizer.from_file(f"{path}/tokenizer.json").decode(token_ids)


@pytest.mark.timeout(300)
def test_tp2_equals_tp1(tp2):
    paths, _, ((tp2, _), (tp2_rank1, _)) = tp2
    for path, (logits2, greedy2, random2, prompt2, choice2), rank1 in zip(paths, tp2,
                                                                            tp2_rank1):
        logits1, greedy1, random1, prompt1, choice1 = _run(path)
        assert choice2 == rank1[4] == choice1
        assert _decode(path, choice1[:choice1.index(0)]) in ("apple", "banana", "cherry")
        rel = ((logits2 - logits1).abs().max() / logits1.abs().max()).item()
        assert rel < TOLERANCE, (path, rel)
        assert greedy2 == greedy1
        # every rank samples the same tokens (same logits, same generator), even unseeded
        assert rank1[1:3] == (greedy2, random2) and random2 == random1
        assert [p[0] for p in prompt2] == [1, 17] and rank1[3] == []
        for (start2, ids2, values2, ranks2), (start1, ids1, values1, ranks1) in zip(prompt2,
                                                                                  prompt1):
            assert (start2, ids2, ranks2) == (start1, ids1, ranks1)
            assert np.allclose(np.frombuffer(values2, "<f4"), np.frombuffer(values1, "<f4"),
                               rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_every_family_split_over_two_ranks_gives_transformers_logits(tp2, arch):
    from test_moe_models import hf_logits as hf_moe_logits  # experts_implementation="eager"
    from worker_test_utils import hf_logits, prompt_ids, rel_err

    _, families, ((_, rank0), (_, rank1)) = tp2
    index = list(FAMILIES).index(arch)
    path, num_tokens = families[arch]
    reference = (hf_moe_logits if arch in MOE_FAMILIES else hf_logits)(
        path, "float64", prompt_ids(7, num_tokens))
    for rank, logits in enumerate((rank0[index], rank1[index])):
        assert rel_err(logits, reference) < FAMILIES[arch][2], (arch, rank)
