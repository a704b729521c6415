"""Issue 3, item 4: the sampler. Statistics, top-k=1 == greedy, per-request seeds (alone,
in a batch, after preemption), penalties / min_p / top_p / min_tokens against hand
computations, log-probabilities."""

import math

import numpy as np
import pytest
import torch

from tidal.ipc.messages import (
    SamplingParams,
    StructuredOutputsParams,
    TokenLogprobs,
    unpack_token_ids,
)
from tidal.workers.sampler import (
    Sampler,
    SamplingBatch,
    apply_grammar_bitmask,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    hashed_uniform_rows,
)
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config

NUM_DRAWS = 10_000
# Each empirical frequency has a standard deviation <= sqrt(0.25 / 10,000) = 0.005;
# 0.02 is four of them, so a correct sampler fails this about once in 10^4 runs (seeded
# runs are deterministic anyway).
FREQ_TOL = 0.02


def _batch(n: int, **fields) -> SamplingBatch:
    values = dict(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                  top_p=torch.ones(n), min_p=torch.zeros(n),
                  seeds=torch.zeros(n, dtype=torch.int64), seeded=torch.zeros(n, dtype=bool),
                  positions=torch.zeros(n, dtype=torch.int64))
    values.update(fields)
    return SamplingBatch(**values)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded):
    """10,000 draws at temperature 1 (unseeded: the worker generator; seeded: 10,000
    distinct seeds through the (seed, position) hash)."""
    batch = _batch(NUM_DRAWS, seeds=torch.arange(NUM_DRAWS) * 7919 - 5000,
                   seeded=torch.full((NUM_DRAWS,), seeded))
    tokens = Sampler(0, torch.device("cpu"))(LOGITS.expand(NUM_DRAWS, -1), batch).token_ids
    expected = torch.softmax(LOGITS.double(), dim=0)
    assert (_frequencies(tokens, 8) - expected).abs().max() < FREQ_TOL


def test_temperature_top_k_top_p_distribution():
    """temperature 0.5, top_k 4, top_p 0.8: draws follow the renormalised kept set."""
    batch = _batch(NUM_DRAWS, temperature=torch.full((NUM_DRAWS,), 0.5),
                   top_k=torch.full((NUM_DRAWS,), 4), top_p=torch.full((NUM_DRAWS,), 0.8))
    tokens = Sampler(1, torch.device("cpu"))(LOGITS.expand(NUM_DRAWS, -1), batch).token_ids
    probs = torch.softmax(LOGITS.double() / 0.5, 0)
    top4 = probs.argsort(descending=True)[:4]
    p4 = probs[top4] / probs[top4].sum()
    keep = int((p4.cumsum(0) < 0.8).sum()) + 1  # smallest prefix reaching 0.8
    expected = torch.zeros(8, dtype=torch.float64)
    expected[top4[:keep]] = p4[:keep] / p4[:keep].sum()
    assert (_frequencies(tokens, 8) - expected).abs().max() < FREQ_TOL


def test_top_k_1_equals_greedy():
    logits = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(0, torch.device("cpu"))
    top1 = sampler(logits, _batch(64, top_k=torch.ones(64, dtype=torch.int64))).token_ids
    greedy = sampler(logits, _batch(64, temperature=torch.zeros(64))).token_ids
    assert torch.equal(top1, logits.argmax(-1)) and torch.equal(greedy, top1)


def test_hashed_uniform_depends_only_on_seed_and_position():
    seeds = torch.tensor([5, 5, 6, -(2**63)])
    positions = torch.tensor([10, 11, 10, 10])
    u = hashed_uniform_rows(seeds, positions)
    assert torch.equal(u[:1], hashed_uniform_rows(seeds[:1], positions[:1]))
    assert (u > 0).all() and (u < 1).all()
    assert u[0] != u[1] and u[0] != u[2]
    many = hashed_uniform_rows(torch.arange(4000), torch.zeros(4000, dtype=torch.int64))
    assert abs(many.mean().item() - 0.5) < 0.02


def test_penalties_match_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 6)
    prompt = torch.tensor([[0, 1, -1], [5, 5, 5]])
    output = torch.tensor([[1, 2, 2, -1], [3, -1, -1, -1]])
    presence, frequency, repetition = [0.5, -0.3], [0.25, 1.0], [1.3, 0.8]
    batch = _batch(2, presence_penalty=torch.tensor(presence),
                   frequency_penalty=torch.tensor(frequency),
                   repetition_penalty=torch.tensor(repetition),
                   output_token_ids=output, prompt_token_ids=prompt)
    ours = apply_penalties(logits.clone(), batch)
    expected = logits.clone()
    for r in range(2):
        outs = [t for t in output[r].tolist() if t >= 0]
        seen = set(outs) | {t for t in prompt[r].tolist() if t >= 0}
        for v in range(6):
            x = expected[r, v].item()
            if v in seen:
                x = x / repetition[r] if x > 0 else x * repetition[r]
            x -= frequency[r] * outs.count(v) + presence[r] * (v in outs)
            expected[r, v] = x
    assert torch.allclose(ours, expected, atol=1e-6)


def test_min_p_and_top_p_match_hand_computation():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]]))
    kept = apply_min_p(logits, torch.tensor([0.2])).isfinite()  # threshold 0.1
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]  # 0.5 + 0.25 reaches 0.7
    kept = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, True, False, False]]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 6)
    logits[0, 2], logits[0, 4] = 9.0, 8.0  # EOS 2 and stop id 4 are the best tokens
    batch = _batch(1, temperature=torch.zeros(1), min_tokens_rows=torch.tensor([0, 0]),
                   min_tokens_ids=torch.tensor([2, 4]))
    assert Sampler(0, torch.device("cpu"))(logits, batch).token_ids.tolist() == [0]


def test_grammar_bitmask_masks_only_its_rows_tokens():
    """Bit j % 32 of word j // 32 allows token j; rows not listed keep every token."""
    logits = torch.arange(40.0).repeat(2, 1)  # the best token is the last, 39
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # token 3
    bitmask[0, 1] = 1 << 2  # token 34
    masked = apply_grammar_bitmask(logits, bitmask, torch.tensor([1]))
    assert masked[1].isfinite().nonzero().flatten().tolist() == [3, 34]
    assert torch.equal(masked[0], logits[0])
    batch = _batch(2, temperature=torch.zeros(2), grammar_bitmask=bitmask,
                   grammar_rows=torch.tensor([1]))
    assert Sampler(0, torch.device("cpu"))(logits, batch).token_ids.tolist() == [39, 34]


def test_logprobs_are_raw_model_logprobs_with_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    batch = _batch(1, temperature=torch.zeros(1), num_logprobs=2,
                   min_tokens_rows=torch.tensor([0]), min_tokens_ids=torch.tensor([1]))
    out = Sampler(0, torch.device("cpu"))(logits, batch)
    raw = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [2]  # token 1 masked by min_tokens
    assert out.logprob_token_ids.tolist() == [[2, 1, 2]]
    assert torch.allclose(out.logprobs[0], raw[[2, 1, 2]])
    assert out.sampled_ranks.tolist() == [2]


# ---------------------------------------------------------------------------------------------
# seeds through the worker


@pytest.fixture(scope="module")
def worker(tiny_llama):
    worker = Worker(worker_config(tiny_llama))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    return worker


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12)


def test_seed_reproduces_alone_and_inside_a_batch(worker):
    prompt = _prompt(20, 0)
    script = PlanScript()
    script.add("alone", prompt, SEEDED)
    alone = script.run(worker)["alone"]

    script = PlanScript(first_block=30)
    for i in range(5):  # other requests first, so the seeded one sits at a different row
        script.add(f"other{i}", _prompt(5 + 7 * i, i + 1),
                   SamplingParams(temperature=1.0, max_tokens=4 + i,
                                  seed=None if i % 2 else 99 + i))
    script.add("mine", prompt, SEEDED)
    outputs = script.run(worker, chunk=8)
    assert outputs["mine"] == alone
    unseeded = PlanScript(first_block=70)
    unseeded.add("u", prompt, SamplingParams(temperature=1.0, max_tokens=12))
    assert unseeded.run(worker)["u"] != alone  # the seed, not luck, made them equal


def test_logprobs_through_the_worker(worker):
    script = PlanScript()
    script.add("lp", _prompt(9, 3), SamplingParams(temperature=0.0, max_tokens=2, logprobs=3))
    script.add("no", _prompt(4, 4), SamplingParams(temperature=0.0, max_tokens=2))
    sampled = worker.execute(script.plan())
    assert sampled.req_ids == ["lp", "no"] and sampled.logprobs[1] is None
    entry: TokenLogprobs = sampled.logprobs[0]
    ids = unpack_token_ids(entry.token_ids).tolist()
    values = np.frombuffer(entry.logprobs, dtype="<f4")
    assert len(ids) == 4 and ids[0] == unpack_token_ids(sampled.token_ids)[0]
    assert entry.sampled_rank == 1 and ids[0] == ids[1]  # greedy: the top token
    assert values[1] >= values[2] >= values[3] and math.isclose(values[0], values[1])
    script.record(sampled)
    script.run(worker)  # finish cleanly


# ---------------------------------------------------------------------------------------------
# structured output through the worker

EOS = 0  # the tiny tokenizer's <|endoftext|>
DIGITS = SamplingParams(temperature=0.0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))


def test_grammar_constrains_its_request_alone_and_survives_a_recompute(worker, tiny_llama):
    """A regex-constrained request next to a free one: three digits, then EOS (the grammar
    is complete, so only the request's stop token is allowed). Rebuilt mid-way, as after a
    preemption (the worker sees it anew with its tokens so far), or resubmitted with its
    delivered tokens as prompt (`num_resumed_tokens`), its matcher is replayed over them and it
    gives the same tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    script = PlanScript()
    script.add("digits", _prompt(11, 5), DIGITS, eos_token_id=EOS)
    script.add("free", _prompt(7, 6), SamplingParams(temperature=0.0, max_tokens=8))
    outputs = script.run(worker, chunk=8)
    digits = outputs["digits"]
    assert digits[3] == EOS and tokenizer.decode(digits[:3]).isdigit()
    alone = PlanScript(first_block=60)
    alone.add("free", _prompt(7, 6), SamplingParams(temperature=0.0, max_tokens=8))
    assert alone.run(worker)["free"] == outputs["free"]  # the mask touched its row only

    script = PlanScript(first_block=40)
    req = script.add("digits", _prompt(11, 5), DIGITS, eos_token_id=EOS)
    for _ in range(3):  # the prompt in two chunks, then one digit
        script.record(worker.execute(script.plan(chunk=8)))
    assert len(req.output_ids) == 2
    req.seen, req.num_computed = False, 0  # resumed: recompute prompt + its 2 tokens
    assert script.run(worker, chunk=8)["digits"] == digits

    # resubmitted to a new core: the delivered tokens are prompt, and the grammar replays them
    script = PlanScript(first_block=100)
    script.add("digits", _prompt(11, 5) + digits[:2], SamplingParams(
        temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(
            regex="[0-9]{3}")), eos_token_id=EOS, num_resumed_tokens=2)
    assert script.run(worker)["digits"][:2] == digits[2:4]


def test_a_grammar_that_does_not_compile_is_refused_alone(worker):
    """A constraint the frontend would have refused, sent anyway: the workers refuse that
    request (its error names the field), and the rest of the batch runs."""
    script = PlanScript(first_block=80)
    script.add("bad", _prompt(5, 7), SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(ab")),
        eos_token_id=EOS)
    script.add("good", _prompt(5, 8), DIGITS, eos_token_id=EOS)
    sampled = worker.execute(script.plan())
    assert [f.req_id for f in sampled.failed] == ["bad"]
    assert sampled.failed[0].error.startswith("structured_outputs.regex does not compile")
    assert sampled.req_ids == ["good"]
    script.finish("bad")
    script.record(sampled)
    script.run(worker)
