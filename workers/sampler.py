"""Vectorised sampler: one pass over the [num_rows, vocab] logits of every request that
samples this step, with per-row parameters as tensors (no Python loop over requests).

Order of operations (as vLLM v1):

    logits (float32)
      ├─► raw log-probabilities (log_softmax of the model's logits) ── returned when asked
      ├─ min_tokens: EOS and stop_token_ids set to -inf while too few tokens are generated
      ├─ penalties: repetition (prompt + output, HF rule), frequency and presence (output)
      ├─ grammar: tokens a constrained row's grammar does not allow set to -inf
      ├─► greedy rows (temperature 0): argmax
      └─ / temperature ─ min_p ─ top_k ─ top_p ─ draw ──► random rows

Speculative decoding's verification (`Sampler.verify`) runs the same processing (no
penalties, grammars or logprobs: the engine core verifies drafts only for requests without
them) on every draft position, then accepts or rejects the drafts.

The draw is by inverse CDF: one uniform u per row, and the token is the first index whose
cumulative probability (float64) exceeds u times the row's total, which samples exactly from
probs and can never pick a token of probability 0. For a seeded request u comes from a
counter-based hash of (seed, position of the token being sampled), so its tokens do not
depend on what else is in the batch, on the batch order, or on a preemption and recompute.
Unseeded rows draw u from one torch.Generator seeded from `WorkerConfig.seed` (identical on
every TP rank). One uniform per row, not one per vocabulary entry: the exponential race
this replaced drew 49,152 exponentials per row and step on SmolLM2, 12% of a serving
worker's time at temperature 1 (py-spy); the cumulative sum costs a small part of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_VERIFY_SALT = 0x5BD1E995 << 8
"""Mixed into a seeded request's seed for its verification draws."""


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step; row i is the i-th request that samples."""

    temperature: torch.Tensor
    """[N] float32; 0 means greedy."""
    top_k: torch.Tensor
    """[N] int64; 0 means off (the whole vocabulary)."""
    top_p: torch.Tensor
    """[N] float32 in (0, 1]."""
    min_p: torch.Tensor
    """[N] float32 in [0, 1]."""
    seeds: torch.Tensor
    """[N] int64: the request's seed (meaningful where `seeded`)."""
    seeded: torch.Tensor
    """[N] bool: draw from (seed, position) instead of the worker's generator."""
    positions: torch.Tensor
    """[N] int64: sequence index the sampled token will take."""
    presence_penalty: torch.Tensor | None = None
    """[N] float32, or None when no row uses penalties (then the two below are None too)."""
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    """[N, max_output_len] int64 generated tokens, padded with -1."""
    prompt_token_ids: torch.Tensor | None = None
    """[N, max_prompt_len] int64 prompt tokens, padded with -1."""
    min_tokens_rows: torch.Tensor | None = None
    """[M] int64 rows and [M] int64 token ids to mask (min_tokens not reached yet)."""
    min_tokens_ids: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    """[G, ceil(vocab / 32)] int32 allowed-token bits of the constrained rows (bit j % 32 of
    word j // 32 is token j), from `structured_output.py`; None when no row is constrained."""
    grammar_rows: torch.Tensor | None = None
    """[G] int64: the rows `grammar_bitmask` belongs to."""
    num_logprobs: int | None = None
    """Most top alternatives any row asked for; None when no row wants logprobs."""
    host_flags: dict[str, bool] | None = None
    """Which paths the batch needs (keys all_greedy, min_p, top_k_top_p, seeded), computed
    on the host by the runner so the sampler never waits on the device to decide; None
    derives them from the tensors."""

    def flag(self, name: str) -> bool:
        if self.host_flags is not None:
            return self.host_flags[name]
        return {
            "all_greedy": lambda: bool((self.temperature == 0).all()),
            "min_p": lambda: bool((self.min_p > 0).any()),
            "top_k_top_p": lambda: bool((self.top_k > 0).any() or (self.top_p < 1).any()),
            "seeded": lambda: bool(self.seeded.any()),
        }[name]()


@dataclass
class SamplerOutput:
    """Sampled tokens and, when asked, log-probabilities (from the raw model logits)."""

    token_ids: torch.Tensor
    """[N] int64."""
    logprob_token_ids: torch.Tensor | None = None
    """[N, 1 + num_logprobs] int64: the sampled token, then the top alternatives."""
    logprobs: torch.Tensor | None = None
    """[N, 1 + num_logprobs] float32, same layout."""
    sampled_ranks: torch.Tensor | None = None
    """[N] int64: rank of the sampled token (1 = most likely)."""


class Sampler:
    """Turns logits into tokens; holds only the generator for unseeded rows."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.to(torch.float32)
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if batch.num_logprobs is not None else None)
        if batch.min_tokens_rows is not None:
            logits = logits.index_put((batch.min_tokens_rows, batch.min_tokens_ids),
                                      torch.tensor(float("-inf"), device=logits.device))
        if batch.presence_penalty is not None:
            logits = apply_penalties(logits, batch)
        if batch.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, batch.grammar_bitmask, batch.grammar_rows)
        greedy = argmax_rows(logits)
        if batch.flag("all_greedy"):
            sampled = greedy
        else:
            sampled = torch.where(batch.temperature == 0, greedy, self._draw(logits, batch))
        out = SamplerOutput(token_ids=sampled)
        if raw_logprobs is not None:
            _fill_logprobs(out, raw_logprobs, batch.num_logprobs)
        return out

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return inverse_cdf(self._target_probs(logits, batch), self._uniforms(batch))

    def verify(self, logits: torch.Tensor, batch: SamplingBatch, draft_ids: np.ndarray,
               num_drafts: np.ndarray) -> list[np.ndarray]:
        """Speculative decoding: the tokens each request keeps from its drafts.

        `logits` [sum(k + 1), vocab]: request i's k_i + 1 rows in a run (row j is the
        target's distribution for the token after draft j - 1; row 0 after its last known
        token), `batch` per row (positions: the index each row's token would take),
        `draft_ids` [sum k] the drafts, concatenated. Greedy rows accept draft j while it
        equals row j's argmax; sampled rows use rejection sampling against a deterministic
        draft (vLLM's for n-gram drafts: q is one-hot), accepting draft d with probability
        p(d) and otherwise drawing from p with d removed, so every emitted token is
        distributed exactly as the target's p. Either way the first rejected position
        gives its own token, and a run with every draft accepted gives a bonus token from
        its last row. Returns, per request, its 1 + accepted tokens (int32)."""
        logits = logits.to(torch.float32)
        num_rows = logits.shape[0]
        device = logits.device
        greedy = argmax_rows(logits)
        draft_at = np.full(num_rows, -1, np.int64)  # the draft each row judges (-1: bonus row)
        starts = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]])
        for start, offset, k in zip(starts, np.concatenate([[0], np.cumsum(num_drafts)[:-1]]),
                                    num_drafts):
            draft_at[start:start + k] = draft_ids[offset:offset + k]
        judged = torch.from_numpy(np.maximum(draft_at, 0)).to(device)
        if batch.flag("all_greedy"):
            accept = (greedy == judged).cpu().numpy()
            choice = greedy.cpu().numpy()
        else:
            probs = self._target_probs(logits, batch)
            u_accept, u_draw = self._verify_uniforms(batch)
            p_draft = probs.gather(1, judged.unsqueeze(1)).squeeze(1).to(torch.float64)
            sampled_accept = u_accept < p_draft
            # the residual max(p - q, 0) with q one-hot at the draft: p without the draft
            has_draft = torch.from_numpy(draft_at >= 0).to(device)
            residual = probs.clone()
            residual[has_draft.nonzero().squeeze(1), judged[has_draft]] = 0.0
            drawn = inverse_cdf(residual, u_draw)
            is_greedy = batch.temperature == 0
            accept = torch.where(is_greedy, greedy == judged, sampled_accept).cpu().numpy()
            choice = torch.where(is_greedy, greedy, drawn).cpu().numpy()
        out = []
        for start, offset, k in zip(starts, np.concatenate([[0], np.cumsum(num_drafts)[:-1]]),
                                    num_drafts):
            a = 0
            while a < k and accept[start + a]:
                a += 1
            out.append(np.concatenate([draft_ids[offset:offset + a],
                                       choice[start + a:start + a + 1]]).astype(np.int32))
        return out

    def _target_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, min_p, top-k, top-p."""
        temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
        logits = logits / temperature.unsqueeze(1)
        if batch.flag("min_p"):
            logits = apply_min_p(logits, batch.min_p)
        if batch.flag("top_k_top_p"):
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        return torch.softmax(logits, dim=-1)

    def _verify_uniforms(self, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [N] float64 uniforms per row (the accept test, the draw): the generator's, or
        for seeded rows a hash of (seed, position) apart from plain sampling's (a salted
        seed), so a seeded request's run is reproducible whatever the batch."""
        num_rows = batch.temperature.shape[0]
        device = batch.temperature.device
        u = torch.rand(2, num_rows, generator=self.generator, dtype=torch.float64,
                       device=device)
        if batch.flag("seeded"):
            rows = batch.seeded.nonzero().squeeze(1)
            seeds = batch.seeds[rows] ^ _VERIFY_SALT
            u[0, rows] = hashed_uniform_rows(seeds, batch.positions[rows])
            u[1, rows] = hashed_uniform_rows(seeds ^ 1, batch.positions[rows])
        return u[0], u[1]

    def _uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """[N] float64 uniforms in [0, 1): the generator's, or (seed, position)'s hash."""
        num_rows = batch.temperature.shape[0]
        device = batch.temperature.device
        u = torch.rand(num_rows, generator=self.generator, dtype=torch.float64, device=device)
        if batch.flag("seeded"):
            rows = batch.seeded.nonzero().squeeze(1)
            u[rows] = hashed_uniform_rows(batch.seeds[rows], batch.positions[rows])
        return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, vocab] probabilities (rows need not sum to exactly 1), [N] uniforms in [0, 1) ->
    [N] int64: the first index whose running sum exceeds u x the row's total. A token of
    probability 0 adds nothing to the running sum, so it can never be that index."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[1] - 1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-D tensor: the first maximal index of each row, a NaN
    counting as the maximum. On the CPU numpy's vectorised argmax (same rules) does it
    ~15x faster than torch's, which matters at a few hundred rows of a large vocabulary."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2 \
            and x.shape[0] and x.shape[1]:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# logits processing


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of tokens seen in the
    prompt or output), then frequency (times the output count) and presence (once per
    distinct output token) subtracted, as in vLLM / OpenAI."""
    num_rows, vocab_size = logits.shape
    output_counts = _token_counts(batch.output_token_ids, num_rows, vocab_size)
    prompt_seen = _token_counts(batch.prompt_token_ids, num_rows, vocab_size) > 0
    seen = prompt_seen | (output_counts > 0)
    rep = batch.repetition_penalty.unsqueeze(1).expand_as(logits)
    rep = torch.where(seen, rep, 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * output_counts
    return logits - batch.presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def _token_counts(token_ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[N, L] ids padded with -1 -> [N, vocab] float32 occurrence counts."""
    counts = torch.zeros(num_rows, vocab_size + 1, device=token_ids.device)
    index = torch.where(token_ids < 0, vocab_size, token_ids)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          rows: torch.Tensor) -> torch.Tensor:
    """-inf for every token of `rows` whose bit in the row's bitmask is 0 (not allowed)."""
    vocab_size = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (bitmask.to(logits.device).unsqueeze(2) >> bits) & 1  # [G, words, 32]
    allowed = allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
    rows = rows.to(logits.device)
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Keep the top_k largest logits (ties at the k-th value kept; 0 = off), then the
    smallest set whose probability reaches top_p (the token crossing it included)."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
    kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _fill_logprobs(out: SamplerOutput, raw_logprobs: torch.Tensor, num_logprobs: int) -> None:
    out.logprob_token_ids, out.logprobs, out.sampled_ranks = token_logprobs(
        raw_logprobs, out.token_ids, num_logprobs)


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, vocab] log-probabilities and one [N] token per row -> (ids, values, ranks): ids and
    values [N, 1 + num_top], the given token first, then the `num_top` most likely; ranks
    [N], the given token's rank in its row (1 = the most likely; ties share the best rank).
    The sampler's logprobs and the prompt's use this one rule."""
    chosen = token_ids.unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    if num_top <= 0:
        return chosen, chosen_lp, ranks
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, top_ids], dim=1), torch.cat([chosen_lp, top_lp], dim=1), ranks


# ---------------------------------------------------------------------------------------------
# counter-based random numbers


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values < 2**32;
    products may wrap in int64, the mask keeps their exact low 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform_rows(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] seeds, [N] positions -> [N] float64 uniforms in (0, 1) with 48 random bits, a pure
    function of (seed, position): two 24-bit hashes (indices 0 and 1), joined."""
    bits = _hashed_bits(seeds, positions, 2).to(torch.float64)
    return (bits[:, 0] + (bits[:, 1] + 0.5) / (1 << 24)) / (1 << 24)


def _hashed_bits(seeds: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """[N, count] int64 holding 24 random bits each, hashed from (seed, position, index)."""
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32((positions & _MASK32) ^ 0x9E3779B9)))
    key2 = _mix32(key ^ 0x85EBCA6B)
    index = torch.arange(count, device=seeds.device, dtype=torch.int64)
    bits = _mix32(((_mix32(key.unsqueeze(1) ^ index) + key2.unsqueeze(1)) & _MASK32))
    return bits >> 8
