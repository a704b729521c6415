"""Speculative decoding's verification (`Sampler.verify`), at the sampler level: greedy keeps
the target's argmax; rejection sampling against a deterministic draft emits tokens
distributed exactly as the target (chi-square over many seeds, at the first and the second
position); a seeded request's verification is reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tidal.workers.sampler import Sampler, SamplingBatch

VOCAB = 6
PROBS = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])  # the target at every position


def batch(num_rows: int, temperature: float, seeds: np.ndarray | None,
          positions: np.ndarray) -> SamplingBatch:
    full = lambda v, dtype: torch.full((num_rows,), v, dtype=dtype)
    return SamplingBatch(
        temperature=full(temperature, torch.float32), top_k=full(0, torch.int64),
        top_p=full(1.0, torch.float32), min_p=full(0.0, torch.float32),
        seeds=torch.from_numpy(seeds if seeds is not None else np.zeros(num_rows, np.int64)),
        seeded=full(seeds is not None, torch.bool), positions=torch.from_numpy(positions))


def verify(num_requests: int, drafts: list[int], temperature: float = 1.0,
           seeds: np.ndarray | None = None, logits: torch.Tensor | None = None):
    k = len(drafts)
    rows = num_requests * (k + 1)
    if logits is None:
        logits = PROBS.log().expand(rows, VOCAB).clone()
    positions = np.tile(np.arange(100, 101 + k), num_requests)
    row_seeds = None if seeds is None else np.repeat(seeds, k + 1)
    return Sampler(0, torch.device("cpu")).verify(
        logits, batch(rows, temperature, row_seeds, positions),
        np.tile(np.asarray(drafts, np.int64), num_requests), np.full(num_requests, k))


def test_greedy_accepts_the_drafts_equal_to_the_argmax_then_adds_its_own():
    # rows of one request with 3 drafts: argmax 1, 2, 5, then 4 (the bonus row)
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([1, 2, 5, 4]):
        logits[row, token] = 5.0
    out = Sampler(0, torch.device("cpu")).verify(
        logits, batch(4, 0.0, None, np.arange(4)), np.asarray([1, 2, 3]), np.asarray([3]))
    assert out[0].tolist() == [1, 2, 5]  # the third draft (3) rejected: the argmax instead
    out = Sampler(0, torch.device("cpu")).verify(
        logits, batch(4, 0.0, None, np.arange(4)), np.asarray([1, 2, 5]), np.asarray([3]))
    assert out[0].tolist() == [1, 2, 5, 4]  # every draft accepted: the bonus token too


@pytest.mark.parametrize("seeded", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(seeded):
    """20,000 requests drafting [3, 1] against a target p at both positions: the first
    emitted token and, where the first draft was accepted, the second are distributed as p
    (a chi-square test at the 0.1% level; a biased sampler, e.g. one always accepting the
    draft, fails it by far)."""
    n = 20_000
    seeds = np.arange(n, dtype=np.int64) * 7919 + 1 if seeded else None
    out = verify(n, [3, 1], seeds=seeds)
    expected = PROBS.numpy().astype(np.float64)
    expected /= expected.sum()
    first = np.bincount([o[0] for o in out], minlength=VOCAB)
    assert chisquare(first, expected * n).pvalue > 1e-3
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=VOCAB)
    assert first[3] == second.sum()  # a second token exactly when the first draft held
    assert chisquare(second, expected * second.sum()).pvalue > 1e-3
    accepted_both = sum(len(o) == 3 for o in out)
    assert accepted_both == pytest.approx(n * 0.25 * 0.30, rel=0.1)


def test_seeded_verification_is_reproducible():
    seeds = np.arange(200, dtype=np.int64)
    a = verify(200, [3, 1, 4], seeds=seeds)
    b = verify(200, [3, 1, 4], seeds=seeds)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    c = verify(200, [3, 1, 4], seeds=seeds + 1000)
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
