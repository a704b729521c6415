"""Speculative decoding in the engine core: the config and the policy that decides every step
how many draft tokens each request proposes (the proposers are in `proposers.py`, the
scheduler's side in `drafting.py`).

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}'

A draft is a guess at a request's next tokens. The scheduler appends a request's k drafts
after its one new token (they count against the token budget and get KV slots), the reporting
worker computes logits at all k + 1 positions and keeps the longest prefix the target model
agrees with plus one token of its own (greedy: argmax; sampled: rejection sampling, which
keeps the target distribution exactly), and the scheduler sets `num_computed_tokens` to
what was accepted (the rejected drafts' KV slots are overwritten by the next step).

Proposers (`proposers.py`; pure Python, no model, no torch):

- `ngram` (prompt lookup, vLLM's): the last n tokens (n from prompt_lookup_max down to
  prompt_lookup_min) are looked up earlier in the request's own tokens (a per-request index
  of each n-gram's latest end, extended by new tokens only); the tokens that followed the
  latest earlier occurrence are the draft.
- `suffix` (Arctic Inference's suffix decoding, simplified): the longest suffix of the
  request's tokens (up to `suffix_max_match` long) that occurred before, in the request
  (prompt and output) or in a bounded store of earlier requests' outputs, proposes what
  followed it. The store is an index from n-gram to where it continues (n = 1 ..
  suffix_max_match), so a lookup is a few dict probes, not a scan.

- `draft_model`: a smaller model with the target's vocabulary, run by the workers
  (`workers/drafter.py`); here only `proposers.DraftModelProposer`, which always has the ceiling's
  worth of drafts, so the plan carries how many (`CachedRequestData.num_model_drafts`).

The adaptive policy (`AdaptivePolicy`, on unless `"adaptive": false`): every step it picks
k_i in 0 .. min(num_speculative_tokens, draft length) for each request so that
(expected tokens the step produces) / (predicted step time) is highest. A proposal of k
drafts whose positions are accepted with p1, p2, .. (each given the ones before it were,
learned per length of the match the proposer drafted from: `AcceptanceTable`, over the
positions verification tested: `verified_positions`) yields 1 + p1 + p1 p2 + .. + p1..pk
tokens; a step of decodes is priced by the step times the
engine core measured (`StepTimes`, per query-row count), a step with a prefill chunk, or any
step before the first measurements, by the step cost model (`advice/step_cost.py`: a request
with k drafts is a prefill chunk of k + 1 tokens). Before the proposer runs, `ask` prices
each request's best case so that no one is asked where drafts cannot pay. The
maximum of this ratio over the separable choices is found by Dinkelbach's iteration
(fix the ratio r, let each request maximise E_i(k) - r * cost_i(k), recompute r; exact,
converges in a few rounds). A lone request on a memory-bound machine thus gets every draft
(an extra token costs little); a full batch whose step is compute-bound gets drafts only for
requests whose acceptance pays for them, and a chat request that never matches gets none.
"""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

METHODS = ("ngram", "suffix", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "model", "adaptive", "suffix_max_match", "suffix_cache_requests"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON keys, and tidal's own: adaptive, suffix_*)."""

    method: str
    num_speculative_tokens: int
    """The most drafts a request proposes in one step (the adaptive policy's ceiling)."""
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    """ngram: the shortest and longest n-gram looked up."""
    adaptive: bool = True
    """Pick each request's draft count every step from the measured step times (the step
    cost model before them) and its acceptance (False: always propose as many as the
    proposer has, up to the ceiling, as vLLM, SGLang and llama.cpp do)."""
    suffix_max_match: int = 8
    """suffix: the longest suffix matched."""
    suffix_cache_requests: int = 256
    """suffix: earlier requests whose outputs the global store keeps (oldest dropped)."""
    model: str | None = None
    """draft_model: the draft model's local folder (a smaller model with the target's
    vocabulary), run by every worker beside the target (`workers/drafter.py`)."""

    @property
    def drafts_in_worker(self) -> bool:
        """Whether the workers make the drafts (draft_model): the plan then says how many
        (`CachedRequestData.num_model_drafts`), not which."""
        return self.method == "draft_model"


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The JSON text (or dict) of `--speculative-config` as a `SpeculativeConfig`; None for
    None. ValueError naming the key for an unknown key or a bad value."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(_KEYS))})")
    method = value.get("method")
    if method is None and value.get("model"):
        method = "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
    model = value.get("model")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config.model must name the draft model's folder "
                             f"for method 'draft_model', got {model!r}")
    elif model is not None:
        raise ValueError(f"speculative_config.model is only for method 'draft_model', not "
                         f"{method!r}")
    k = value.get("num_speculative_tokens")
    _int(k, "num_speculative_tokens", 1, 32)
    lo, hi = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max", 5)
    _int(lo, "prompt_lookup_min", 1, 64)
    _int(hi, "prompt_lookup_max", 1, 64)
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be at most "
                         f"prompt_lookup_max ({hi})")
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
    max_match = value.get("suffix_max_match", 8)
    _int(max_match, "suffix_max_match", 1, 64)
    cached = value.get("suffix_cache_requests", 256)
    _int(cached, "suffix_cache_requests", 0, 1 << 20)
    return SpeculativeConfig(method, k, lo, hi, adaptive, max_match, cached, model)


def _int(value, key: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], "
                         f"got {value!r}")


# ---------------------------------------------------------------------------------------------
# the adaptive policy


@dataclass(frozen=True)
class CostTerms:
    """The step cost model's terms that a verification changes (seconds, or relative units:
    only ratios matter). Defaults when no `tidal tune profile` exists: a step's fixed part
    equals 32 tokens of compute, as on a memory-bound CPU or GPU decode of a small model."""

    intercept: float = 1.0
    per_token: float = 1.0 / 32  # a prefill token
    per_decode: float = 1.0 / 32  # a decode request
    per_context: float = 0.0  # a decode's key
    per_pair: float = 0.0  # a prefill chunk's (query, key) pair

    @classmethod
    def from_model(cls, model) -> CostTerms:
        """From a `StepCostModel`."""
        return cls(max(model.intercept_s, 1e-9), model.per_prefill_token_s,
                   model.per_decode_req_s, model.per_decode_context_token_s,
                   model.per_prefill_attention_pair_s)

    def verify_entry(self, num_computed: int, k: int) -> float:
        """The cost of a decode with k drafts: the decode, and each draft a prefill token."""
        return self.entry(num_computed, k + 1)

    def step_time(self, rows: int) -> float:
        """A decode step's cost by these terms, `rows` query rows in all (contexts left
        out): the prior `StepTimes` scales to its measurements."""
        return self.intercept + self.per_decode * rows

    def entry(self, num_computed: int, num_tokens: int) -> float:
        """The cost of one plan entry (`step_cost.chunk_features`)."""
        if num_tokens == 1:
            return self.per_decode + self.per_context * (num_computed + 1)
        return (self.per_token * num_tokens
                + self.per_pair * num_tokens * (num_computed + (num_tokens + 1) / 2))


STEP_SAMPLES = 3
"""Measured steps of a row count before `StepTimes` trusts its time."""
STEP_WINDOW = 9
"""A row count's time is the median of its last this many measured steps: recent ones, as
the contexts grow and the machine's load changes, and the median, since on a shared machine
a step now and then takes several times its due (2-vCPU VM, load 8: one step in ten)."""


STEP_STALE = 256
"""Measured steps (of any row count) after which a row count not measured since is
forgotten: while a row count's time says drafts do not pay, no step of it runs and its
time would never change, so a load that passed (a 5-row step measured at 6x a 1-row one on
the loaded 2-vCPU EPYC, ~2x quiet) would stop speculation for good. Forgotten, it is
estimated from its neighbours or the prior again, and drafted and measured afresh if that
says they pay (a few steps in every STEP_STALE)."""


class StepTimes:
    """Seconds of decode steps (no prefill chunk) by their query rows, as the engine core
    measured them (each plan's own time at the workers): what a step with drafts really
    costs on this machine and model, which no prefill-and-decode profile says (a
    verification's rows run the decode kernels, not the prefill ones).

    A row count measured `STEP_SAMPLES` times is trusted; another one is estimated from
    its trusted neighbours: linearly between the nearest below and above, past the last
    along the line through the last two, else (one trusted) as the prior
    (`CostTerms.step_time`) scaled to it."""

    def __init__(self) -> None:
        self.mean: dict[int, float] = {}
        """Each row count's time: the median of its last STEP_WINDOW steps."""
        self.count: dict[int, int] = {}
        self._recent: dict[int, deque[float]] = {}
        self._trusted: list[int] = []  # sorted row counts with STEP_SAMPLES measurements
        self._steps = 0  # steps observed
        self._last: dict[int, int] = {}  # row count -> the step that last measured it

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not seconds > 0:
            return
        self._steps += 1
        self._last[rows] = self._steps
        if self._steps % 16 == 0:
            self._forget_stale()
        recent = self._recent.get(rows)
        if recent is None:
            recent = self._recent[rows] = deque(maxlen=STEP_WINDOW)
        recent.append(seconds)
        self.mean[rows] = statistics.median(recent)
        n = self.count[rows] = self.count.get(rows, 0) + 1
        if n == STEP_SAMPLES:
            self._trusted = sorted(self._trusted + [rows])

    @property
    def steps(self) -> int:
        """Steps measured so far."""
        return self._steps

    def _forget_stale(self) -> None:
        """Drop the row counts not measured in the last STEP_STALE steps."""
        stale = [r for r, at in self._last.items() if self._steps - at > STEP_STALE]
        for rows in stale:
            for table in (self.mean, self.count, self._recent, self._last):
                table.pop(rows, None)
        if stale:
            self._trusted = [r for r in self._trusted if r in self.count]

    def known_at_or_below(self, rows: int) -> bool:
        """Whether some trusted row count is at most `rows` (estimates then never
        extrapolate downward, where a prior scaled from a slower step would overprice)."""
        return bool(self._trusted) and self._trusted[0] <= rows

    def least_above(self, rows: int, most: int) -> list[float]:
        """The least time of a trusted row count above `rows + d` (inf if none), for d in
        0 .. `most`: one pass over the trusted counts (sorted), then a bisection each."""
        trusted, mean = self._trusted, self.mean
        suffix_least = [float("inf")] * (len(trusted) + 1)
        for i in range(len(trusted) - 1, -1, -1):
            suffix_least[i] = min(mean[trusted[i]], suffix_least[i + 1])
        return [suffix_least[bisect_right(trusted, rows + d)] for d in range(most + 1)]

    def estimate(self, rows: int, prior) -> float:
        """Seconds of a decode step of `rows` rows; `prior(rows)` a cost in any unit. Needs
        a trusted row count."""
        trusted = self._trusted  # sorted: the neighbours by bisection (a policy's step
        # prices up to 128 row counts a step at 32 streams with 4 drafts each)
        if self.count.get(rows, 0) >= STEP_SAMPLES:
            return self.mean[rows]
        below_end, above_start = bisect_left(trusted, rows), bisect_right(trusted, rows)
        below = trusted[below_end - 1] if below_end else None
        above = trusted[above_start] if above_start < len(trusted) else None
        if below is not None and above is not None:
            t = (rows - below) / (above - below)
            return self.mean[below] + t * (self.mean[above] - self.mean[below])
        if below is not None and len(trusted) >= 2:  # past the last: the steeper slope of
            # the last two's and the first and last's. The last two are often a few rows
            # apart and their slope noise: on 32 copying streams (SmolLM2, Zen 4 EPYC) 29
            # and 32 rows at 62.7 and 67.0 ms said 1.4 ms a row, the rows from 1 to 32 1.9,
            # and steps of ~100 rows cost ~1.8 a row; drafting priced at 1.4 ran at 0.54x
            low, high = trusted[-2], trusted[-1]
            first = trusted[0]
            mean = self.mean
            slope = max(0.0, (mean[high] - mean[low]) / (high - low),
                        (mean[high] - mean[first]) / (high - first))
            return mean[high] + slope * (rows - high)
        near = below if below is not None else above
        return self.mean[near] * prior(rows) / prior(near)


MIN_GAIN = 0.05
"""Drafts are chosen only where they promise this much more (relative) expected tokens per
measured second than the step without them: the measured times are medians of noisy steps,
the acceptance an estimate, and the engine core's own work per step (not in the measured
times) grows with drafts. Without it, the quiet benchmark (2026-12-04, SmolLM2 on the AVX2
EPYC) drafted on 32 chat streams for 1% more tokens a step and ran at 0.92x, and on 4
copying streams at 0.94-0.95x."""

PROPOSE_WINDOW = 9
"""The proposer's time per request asked is the median of its last this many steps (and
is forgotten after STEP_STALE measured steps without one). It was a running mean (a tenth
of the way per step): one slow call (a collection or a page fault in the engine core,
20 ms) early in a fresh engine, while its acceptance evidence was still thin, priced every
ask out (1.5 ms a request added to a 7 ms step), and since the time is measured only when
the proposer is asked, asking never resumed (2026-12-05)."""

PRIOR_WEIGHT = 4.0
"""Positions' worth of weight an `AcceptanceTable` estimate gives what it leans on (the
position before it, or the pooled acceptance)."""


def verified_positions(num_drafts: int, num_accepted: int) -> int:
    """Draft positions a verification tested: the accepted ones and the first rejected one
    (if any). The positions after a rejection were never tried, so counting them as
    rejections (as acceptance = accepted / drafted does) halves the estimate of a per-position
    acceptance a for long drafts: SmolLM2's fixed suffix drafts, 6048 of 19973 draft tokens
    accepted (30%), but 6048 of 10192 tested positions (59%), and they did yield 2.17 tokens a
    draft (1 + a + .. + a^4 is 2.27 at 59%, 1.42 at 30%); the adaptive policy, pricing at 30%,
    drafted 1.13 tokens a step where fixed drafting made 2.66 (2026-12-04)."""
    return num_accepted + (num_accepted < num_drafts)


def run_gains(accept, cap: int) -> list[float]:
    """The chance that each of a request's first `cap` drafts is accepted (so each draft's
    expected tokens): `accept` is one acceptance a for every position (a, a^2, ..) or each
    position's acceptance given the ones before it were accepted (their running products;
    the last repeats past its end). Never rising with the position, so the best D drafts of
    a step are each request's first ones."""
    if isinstance(accept, (int, float)):
        return [accept ** j for j in range(1, cap + 1)]
    gains, run, p = [], 1.0, 0.5
    for j in range(cap):
        p = accept[j] if j < len(accept) else p
        run *= p
        gains.append(run)
    return gains


class AcceptanceTable:
    """Each draft position's acceptance given the positions before it were accepted, by the
    length of the match the proposer drafted from (`proposers.Draft.match`), learned from every
    verification (`record`, over the positions it tested: `verified_positions`).

    Why not one running a per request with a^j: a copy run, once its first drafts are
    right, goes on; its later positions are accepted far more often than its first. On
    SmolLM2's copy workload (suffix, 24 prompts' greedy outputs, drafts of 16 verified
    whole) the first position is accepted 29% of the time after a 1-token match, 52% after
    2, 77% after 3 and 86% after 8, and a position after an accepted one 80-100% whatever
    the match; the geometric a^j prices a long draft's tail at a fraction of what it
    yields, and one a prices a 1-token match like an 8-token one.

    A position with little evidence leans on the one before it in the same row (`weight`
    positions' worth of it), so a position never verified is priced like its predecessor:
    longer drafts get tried where the earlier positions hold, and learned from. A row's
    first position leans on the engine's pooled acceptance `prior`, or on the best first
    position of a shorter match where that is higher (`_first_leans`): acceptance rises with
    the match, so a long match is priced at least like the shorter ones. Leaning on the
    pooled acceptance alone, a fresh engine's first copy run stopped drafting: its first
    verifications followed 1-3-token matches (the quotes' starts) and pulled the pool to
    0.36-0.42, every long match with no evidence of its own was priced so and declined,
    and one copying stream made 1.03-1.07 tokens a step over its first ~600 tokens
    (SmolLM2, 2026-12-05), where a warm engine makes 2-3."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.accepted: dict[tuple[int, int], int] = {}
        self.tested: dict[tuple[int, int], int] = {}
        """(match length, draft position from 0) -> positions accepted / tested."""
        self._leans: tuple[float, list[int], list[float]] | None = None
        """`_first_leans`' answer for the prior it was made with; None after a `record`."""

    def record(self, match: int, num_drafts: int, num_accepted: int) -> None:
        accepted, tested = self.accepted, self.tested
        for j in range(verified_positions(num_drafts, num_accepted)):
            key = (match, j)
            tested[key] = tested.get(key, 0) + 1
            if j < num_accepted:
                accepted[key] = accepted.get(key, 0) + 1
        self._leans = None

    def _first_leans(self, prior: float) -> tuple[list[int], list[float]]:
        """The matches with a tested first position, ascending, and for each the lean of
        a longer match's first position: the highest of `prior` and the first-position
        estimates up to it (each itself leaning so). One pass, kept until the next
        `record` or another prior."""
        if self._leans is None or self._leans[0] != prior:
            matches = sorted(m for m, j in self.tested if j == 0)
            leans, lean = [], prior
            for m in matches:
                estimate = ((self.accepted.get((m, 0), 0) + self.weight * lean)
                            / (self.tested[(m, 0)] + self.weight))
                lean = max(lean, estimate)
                leans.append(lean)
            self._leans = (prior, matches, leans)
        return self._leans[1], self._leans[2]

    def _first_lean(self, match: int, prior: float) -> float:
        """What `match`'s first position leans on: `prior`, or the best first position
        of a shorter match (`_first_leans`)."""
        matches, leans = self._first_leans(prior)
        i = bisect_left(matches, match)
        return leans[i - 1] if i else prior

    def best(self, k: int, prior: float) -> list[float]:
        """The acceptances of the row (match length) whose first `k` drafts promise the
        most tokens: what a request's drafts are worth at best, before the proposer says
        which row they come from (`AdaptivePolicy.ask`); the prior's row if none is known."""
        best, best_tokens = None, -1.0
        for match in {m for m, _ in self.tested}:
            probs = self.probs(match, k, prior)
            tokens = sum(run_gains(probs, k))
            if tokens > best_tokens:
                best, best_tokens = probs, tokens
        return best if best is not None else self.probs(-1, k, prior)

    def probs(self, match: int, k: int, prior: float) -> list[float]:
        """The first `k` positions' acceptances for drafts from a match of `match` tokens."""
        accepted, tested, weight = self.accepted, self.tested, self.weight
        out, p = [], self._first_lean(match, prior)
        for j in range(k):
            key = (match, j)
            p = (accepted.get(key, 0) + weight * p) / (tested.get(key, 0) + weight)
            out.append(p)
        return out


class AdaptivePolicy:
    """Chooses draft counts per request and step (see the module docstring)."""

    def __init__(self, ceiling: int, terms: CostTerms, adaptive: bool = True) -> None:
        self.ceiling = ceiling
        self.terms = terms
        self.adaptive = adaptive
        self.accepted = 0
        self.tested = 0
        """Positions accepted / tested (`verified_positions`) over every request (the prior's
        evidence)."""
        self.table = AcceptanceTable(PRIOR_WEIGHT)
        """Per-position acceptance by match length: what a proposal's drafts are worth
        (`draft_probs`)."""
        self.times = StepTimes()
        """Measured decode step times by query rows (fed by the engine core's loop)."""
        self.propose_s = 0.0
        """The proposer's seconds per request asked (the median of its last
        PROPOSE_WINDOW steps, `observe_proposer`): engine-core time a step spends before
        its plan, not in the measured step times."""
        self._propose_recent: deque[float] = deque(maxlen=PROPOSE_WINDOW)
        self._propose_at = 0  # the measured step count when the proposer was last timed

    def prior(self) -> float:
        """The global acceptance per draft position (0.5 before any evidence)."""
        return (self.accepted + 1.0) / (self.tested + 2.0)

    def use_cost_model(self, model) -> None:
        """Price steps with a measured `StepCostModel` (advice/observers.py gives it)."""
        self.terms = CostTerms.from_model(model)

    def draft_probs(self, match: int, k: int) -> list[float]:
        """Each of k drafts' acceptance given the ones before it were accepted, for drafts
        the proposer found after a match of `match` tokens (`AcceptanceTable`)."""
        return self.table.probs(match, k, self.prior())

    def best_probs(self, k: int) -> list[float]:
        """The acceptances of the best-paying kind of draft (`AcceptanceTable.best`): a
        request's best case before the proposer runs."""
        return self.table.best(k, self.prior())

    def record(self, num_drafts: int, num_accepted: int, match: int | None = None) -> None:
        """One request's verified drafts: `num_accepted` of `num_drafts` kept; `match` the
        length of the match they were drafted from (None: not known, the pooled counts
        only)."""
        self.tested += verified_positions(num_drafts, num_accepted)
        self.accepted += num_accepted
        if match is not None:
            self.table.record(match, num_drafts, num_accepted)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` query rows (decodes and their drafts, no prefill chunk)
        took `seconds` at the workers."""
        self.times.observe(rows, seconds)

    def observe_proposer(self, seconds: float, asked: int) -> None:
        """The proposer took `seconds` for `asked` requests in one step."""
        if asked > 0 and seconds >= 0:
            self._propose_recent.append(seconds / asked)
            self.propose_s = statistics.median(self._propose_recent)
            self._propose_at = self.times.steps

    def _forget_stale_proposer(self) -> None:
        """Forget the proposer's time when it was not asked in the last STEP_STALE
        measured steps: what kept it from being asked may have passed."""
        if self._propose_recent and self.times.steps - self._propose_at > STEP_STALE:
            self._propose_recent.clear()
            self.propose_s = 0.0

    def ask(self, candidates: list[tuple[int, int, float]], base_tokens: float, budget: int,
            rows: int | None) -> list[bool]:
        """Which of `candidates` [(most drafts it may get, num_computed, acceptance)] the
        proposer is asked for drafts this step, before it runs (its time is engine-core time
        on the step's path). Each is asked as if it found all its drafts: where even that
        best case does not pass `MIN_GAIN` with the measured step times and the proposer's
        time for those asked, no one is asked, and a candidate whose acceptance is too low
        (its first draft not among the best case's) is not asked either, unless another
        with the same acceptance is (equal best cases are asked alike, not just as many as
        the best case drafts for). Before any step is measured, and with `"adaptive":
        false`, every candidate is asked."""
        if not self.adaptive or not self.times.count:
            return [True] * len(candidates)
        if rows is None:
            return [False] * len(candidates)  # a step with a prefill chunk drafts nothing
        self._forget_stale_proposer()
        caps = [min(n, self.ceiling) for n, _, _ in candidates]
        ks = self._choose_measured(candidates, caps, base_tokens, budget, rows,
                                   self.propose_s)
        paying = {_hashable(accept) for (_, _, accept), k in zip(candidates, ks) if k > 0}
        return [_hashable(accept) in paying for _, _, accept in candidates]

    def choose(self, candidates: list[tuple[int, int, float]], base_cost: float,
               base_tokens: float, budget: int, rows: int | None = None) -> list[int]:
        """Draft counts for `candidates` [(drafts available, num_computed, acceptance)], each
        a decode of the step (acceptance: one a for every position, or each position's given
        the ones before: `run_gains`); `base_cost` the rest of the step's cost (intercept included),
        `base_tokens` the tokens the rest yields; at most `budget` drafts in all. `rows`:
        the step's query rows before drafts where every entry is a decode (None where it
        has a prefill chunk): such a step is priced by the measured `StepTimes` once they
        know enough (`_choose_measured`)."""
        caps = [min(n, self.ceiling) for n, _, _ in candidates]
        if not self.adaptive:
            return _fit_budget(caps, budget)
        if rows is not None:
            ks = self._choose_measured(candidates, caps, base_tokens, budget, rows)
            if ks is not None:
                return ks
        elif self.times.count:
            # a step with a prefill chunk, once the engine's loop measures steps: no drafts.
            # It is compute-bound and no measurement prices its extra rows; the cost terms
            # below, left to price them, drafted on 32 chat streams at 24% acceptance and
            # ran at 0.89x (2026-12-04, SmolLM2, AVX2 EPYC, suffix)
            return [0] * len(candidates)
        terms = self.terms
        # cost and yield of each option k = 0 .. cap, per candidate
        options = []
        for (_, computed, accept), cap in zip(candidates, caps):
            tokens = [1.0]
            for gain in run_gains(accept, cap):
                tokens.append(tokens[-1] + gain)
            options.append([(tokens[k], terms.verify_entry(computed, k))
                            for k in range(cap + 1)])
        ks = [0] * len(candidates)
        ratio = self._ratio(options, ks, base_cost, base_tokens)
        for _ in range(8):  # Dinkelbach: a handful of rounds reach the fixed point
            ks = [max(range(len(opt)), key=lambda k: opt[k][0] - ratio * opt[k][1])
                  for opt in options]
            new_ratio = self._ratio(options, ks, base_cost, base_tokens)
            if new_ratio <= ratio * (1 + 1e-9):
                break
            ratio = new_ratio
        # each round's choice is at least as good as the last (Dinkelbach), so never
        # worse than no drafts at all
        return _fit_budget(ks, budget)

    def _choose_measured(self, candidates, caps: list[int], base_tokens: float,
                         budget: int, rows: int, per_request_s: float = 0.0
                         ) -> list[int] | None:
        """Draft counts for a decode step priced by measured step times (None before any
        step is measured; no drafts while none of `rows` rows or fewer is, so that the
        step without drafts is measured first).

        Such a step's time depends on its total query rows (the weights are read once a
        step, the arithmetic grows with every row, and the kernels change with the row
        count: on the AVX2 EPYC a step of 5 rows costs ~2.5x one of 1, and past 8 rows the
        fused layers stop; docs/speculative.md), so the choice is over D, the drafts in
        all: the best D drafts are the D largest marginal yields (`run_gains`: each
        request's fall with j, so taking the largest keeps every request's drafts a
        prefix), and D is the one whose (tokens) / (time of rows + D rows: `_step_costs`)
        is highest, ties to fewer drafts, and
        none unless that beats the step without drafts by `MIN_GAIN`. `per_request_s` is
        added to a drafting step's time for every request with drafts in it (the
        proposer's, when it is still to run: `ask`)."""
        times = self.times
        if not times.count:
            return None  # nothing measured yet (no engine loop feeds it): the cost terms
        if not times.known_at_or_below(rows):
            return [0] * len(candidates)  # measure the step without drafts first
        gains = sorted(((gain, j, i) for i, ((_, _, accept), cap)
                        in enumerate(zip(candidates, caps))
                        for j, gain in enumerate(run_gains(accept, cap), start=1)),
                       key=lambda g: (-g[0], g[1]))
        gains = gains[:max(0, budget)]
        seconds = _step_costs(times, rows, len(gains), self.terms.step_time)
        tokens = base_tokens + len(candidates)
        best_d, best = 0, tokens / seconds[0]
        no_drafts = best
        drafting = 0  # requests with drafts among the first d
        for d, (gain, j, _) in enumerate(gains, start=1):
            tokens += gain
            drafting += j == 1
            rate = tokens / (seconds[d] + per_request_s * drafting)
            if rate > best * (1 + 1e-9):
                best_d, best = d, rate
        if best < no_drafts * (1 + MIN_GAIN):
            best_d = 0
        ks = [0] * len(candidates)
        for _, _, i in gains[:best_d]:
            ks[i] += 1
        return ks

    @staticmethod
    def _ratio(options, ks, base_cost: float, base_tokens: float) -> float:
        tokens = base_tokens + sum(opt[k][0] for opt, k in zip(options, ks))
        cost = base_cost + sum(opt[k][1] for opt, k in zip(options, ks))
        return tokens / cost if cost > 0 else 0.0


def _step_costs(times: StepTimes, rows: int, most: int, prior) -> list[float]:
    """Seconds of the step with 0 .. `most` drafts on its `rows` rows, each at most what
    any more drafts cost and never under none: a step of more rows does not cost less, so
    a row count measured dearer than a larger one is noise (SmolLM2 on the loaded Zen 4
    EPYC, medians after a copying stream's 300 steps: 3 rows 17.9 ms, 4 rows 16.9, 5 rows
    15.5, so 2 or 3 drafts were never verified, and so never measured again, until those
    times went stale)."""
    seconds = [times.estimate(rows + d, prior) for d in range(most + 1)]
    least_above = times.least_above(rows, most)
    for d in range(1, most + 1):
        seconds[d] = max(seconds[0], min(seconds[d], least_above[d]))
    return seconds


def _hashable(accept):
    return accept if isinstance(accept, (int, float)) else tuple(accept)


def _fit_budget(ks: list[int], budget: int) -> list[int]:
    """Trim draft counts (from the last request) to at most `budget` in all."""
    total = sum(ks)
    i = len(ks) - 1
    while total > budget and i >= 0:
        cut = min(ks[i], total - budget)
        ks[i] -= cut
        total -= cut
        i -= 1
    return ks


class SpecStats:
    """Counters for /metrics (vLLM's spec_decode names): drafts, draft tokens, accepted
    tokens, accepted tokens per draft position."""

    def __init__(self, ceiling: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * ceiling

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
