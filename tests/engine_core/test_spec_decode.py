"""Speculative decoding in the engine core (engine_core/spec_decode.py and the scheduler's
part), without processes: the config's checks, the proposers, the adaptive policy, and the
scheduler's drafts against a fake worker that verifies them greedily and keeps a token-level
KV cache (so a rejected draft's slot that is read before it is overwritten fails the test).
"""

from __future__ import annotations

import pytest

from sched_utils import (
    FakeWorker, make_request, make_scheduler, reference_tokens, step,
)
from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tidal.engine_core.proposers import Draft, NgramProposer, SuffixProposer
from tidal.engine_core.spec_decode import (
    STEP_SAMPLES, STEP_STALE, AcceptanceTable, AdaptivePolicy, CostTerms, StepTimes,
    parse_speculative_config, run_gains, verified_positions,
)
from tidal.ipc.messages import unpack_token_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def copying_model(period: int, slip_every: int = 0):
    """A fake model that repeats the token `period` back (what n-gram drafts guess), except
    at every `slip_every`-th position, where it says something new (a rejection)."""
    def model(tokens):
        n = len(tokens)
        if slip_every and n % slip_every == 0:
            return (tokens[-1] * 7 + n) % 997 + 1
        return tokens[n - period]
    return model


# -- config -----------------------------------------------------------------------------------


def test_config_parses_vllm_json_and_names_the_bad_key():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                 '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max,
            c.adaptive) == ("ngram", 4, 2, 4, True)
    assert parse_speculative_config(None) is None
    assert not parse_speculative_config({"method": "suffix", "num_speculative_tokens": 2,
                                         "adaptive": False}).adaptive
    for bad, key in [({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 1},
                      "lookahead"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                       "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                     ({"method": "ngram", "model": "/d", "num_speculative_tokens": 2}, "model"),
                     ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=key):
            parse_speculative_config(bad)


def test_a_model_key_alone_means_draft_model_and_pp_is_refused():
    c = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model, c.drafts_in_worker) == ("draft_model", "/some/draft", True)
    spec = SchedulerConfig(speculative_config={"method": "draft_model", "model": "/d",
                                               "num_speculative_tokens": 2})
    assert spec.draft_model == "/d"
    with pytest.raises(ValueError, match="speculative_config.model.*pipeline_parallel_size"):
        EngineConfig(ModelConfig("/m"), scheduler=spec,
                     parallel=ParallelConfig(pipeline_parallel_size=2))


def test_scheduler_config_takes_a_dict_or_json_and_refuses_bad_values():
    config = SchedulerConfig(speculative_config=NGRAM)  # LLM(speculative_config={...})
    assert parse_speculative_config(config.speculative_config).method == "ngram"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(speculative_config='{"method": "ngram"}')


# -- proposers ---------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    p = NgramProposer(parse_speculative_config(NGRAM))
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # "6 7" occurs at 1 and 5; "5 6 7"/"9 6 7"/"2 6 7" do not recur: the latest "6 7" wins
    assert p.propose("a", tokens).tokens == [1, 2, 6, 7]
    # the length of the n-gram the draft follows comes with it
    assert p.propose("a", tokens, k=2) == Draft([1, 2], 2)
    assert p.propose("a", [1, 2, 3]) == Draft([], 0)  # nothing recurs
    strict = NgramProposer(parse_speculative_config({**NGRAM, "prompt_lookup_min": 3}))
    assert strict.propose("a", tokens).tokens == []  # only 2 tokens match


def test_suffix_matches_own_tokens_then_earlier_requests_outputs():
    p = SuffixProposer(parse_speculative_config({"method": "suffix",
                                                 "num_speculative_tokens": 3}))
    assert p.propose("a", [1, 2, 3, 4, 1, 2]) == Draft([3, 4, 1], 2)
    assert p.propose("b", [9, 8, 40, 41]) == Draft([], 0)
    p.finished("a", [1, 2, 3, 4, 1, 2, 40, 41, 42, 43], num_prompt=4)
    assert p.propose("b", [9, 8, 40, 41]) == Draft([42, 43], 2)  # from a's output
    assert "a" not in p.own


def test_suffix_store_prefers_the_latest_output_and_forgets_the_oldest_beyond_its_size():
    p = SuffixProposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 2,
                                                 "suffix_cache_requests": 2}))
    p.finished("a", [0, 7, 8, 1, 2], num_prompt=1)
    p.finished("b", [0, 7, 8, 3, 4], num_prompt=1)
    assert p.propose("x", [5, 7, 8]).tokens == [3, 4]  # b, the latest, wins over a
    assert p.propose("y", [5, 50, 51]).tokens == []
    p.finished("c", [0, 50, 51, 60, 61], num_prompt=1)  # a leaves the store
    assert p.propose("x", [5, 7, 8]).tokens == [3, 4]  # b's n-grams stay
    p.finished("d", [0, 9, 9, 9], num_prompt=1)  # b leaves: no request holds 7 8 now
    assert p.propose("z", [5, 7, 8]).tokens == []
    assert p.propose("y", [5, 50, 51]).tokens == [60, 61]


# -- the adaptive policy ----------------------------------------------------------------------


def test_policy_drafts_for_one_stream_and_holds_back_when_they_do_not_pay():
    """Step cost 1 + n/32 for n tokens: one stream pays almost nothing per draft, so it takes
    every draft even at modest acceptance; 32 streams are compute-bound, where drafts pay
    only at high acceptance, and never when they are mostly rejected."""
    policy = AdaptivePolicy(4, CostTerms())
    assert policy.choose([(4, 100, 0.6)], 1.0, 0.0, 100) == [4]
    assert policy.choose([(4, 100, 0.05)], 1.0, 0.0, 100)[0] <= 1
    assert policy.choose([(4, 100, 0.1)] * 32, 1.0, 0.0, 1000) == [0] * 32
    busy = policy.choose([(4, 100, 0.9)] * 32, 1.0, 0.0, 1000)
    assert all(k >= 2 for k in busy)
    assert policy.choose([(3, 100, 0.9), (4, 100, 0.9)], 1.0, 0.0, 4) == [3, 1]  # the budget
    fixed = AdaptivePolicy(4, CostTerms(), adaptive=False)
    assert fixed.choose([(4, 100, 0.0)] * 3, 1.0, 0.0, 100) == [4, 4, 4]


def test_acceptance_counts_the_positions_verification_tested():
    """A draft's positions after its first rejection were never tried: 4 drafts of which the
    first is rejected are one failure, not four, so a per-position acceptance a is not
    underestimated for long drafts (the yield 1 + a + .. + a^k assumes each position is
    accepted with a given the ones before it were)."""
    assert verified_positions(4, 0) == 1
    assert verified_positions(4, 2) == 3
    assert verified_positions(4, 4) == 4
    policy = AdaptivePolicy(4, CostTerms())
    for accepted in (0, 4) * 50:  # all or nothing: half the drafts entirely right
        policy.record(4, accepted)
    assert policy.prior() == pytest.approx(201 / 252)


def test_run_gains_are_each_draft_s_chance_of_being_accepted():
    """One acceptance a for every position gives a, a^2, ..; per-position acceptances
    (each given the ones before were accepted) give their running products, the last one
    repeating past the list's end."""
    assert run_gains(0.5, 3) == pytest.approx([0.5, 0.25, 0.125])
    assert run_gains([0.5, 1.0, 0.8], 4) == pytest.approx([0.5, 0.5, 0.4, 0.32])
    assert run_gains([0.9], 0) == []


def test_acceptance_table_learns_each_position_by_the_match_it_was_drafted_from():
    """Drafts after a long match are right from the first position and go on; drafts after
    a 1-token match mostly fail at once, but once one is right the next is likely right too
    (a copy run has started): the table keeps each (match length, position) apart, counted
    over the positions verification tested, and a position with no evidence is priced like
    the one before it in the same row."""
    table = AcceptanceTable(weight=4.0)
    for _ in range(40):
        table.record(8, 4, 4)  # long match: all four accepted
        table.record(1, 4, 0)  # 1-token match: the first rejected (one position tested)
    for _ in range(10):
        table.record(1, 4, 4)
    long, short = table.probs(8, 4, prior=0.5), table.probs(1, 4, prior=0.5)
    assert long[0] > 0.9 and long[3] > 0.9
    assert short[0] < 0.3 and short[1] > 0.7  # after a right first draft, the run goes on
    assert table.probs(8, 6, prior=0.5)[5] == pytest.approx(long[3])  # never tested: as before
    assert table.probs(3, 2, prior=0.5) == pytest.approx([0.5, 0.5])  # no evidence: the prior
    assert table.best(4, prior=0.5) == pytest.approx(long)


def test_a_long_match_without_evidence_is_priced_like_the_best_shorter_one():
    """Acceptance rises with the match, so a row's first position leans on the best first
    position of a shorter match where that beats the pooled acceptance; a shorter row
    that fails does not pull a longer one below the pool."""
    table = AcceptanceTable(weight=4.0)
    for _ in range(30):
        table.record(1, 4, 0)  # 1-token matches fail at once
    for _ in range(10):
        table.record(3, 4, 4)  # 3-token matches are right
    three = table.probs(3, 2, prior=0.3)
    assert three[0] > 0.7
    assert table.probs(8, 2, prior=0.3) == pytest.approx([three[0], three[0]])
    assert table.probs(2, 1, prior=0.3) == pytest.approx([0.3])  # the pool beats match 1's
    assert table.probs(1, 1, prior=0.3)[0] < 0.1


def test_a_fresh_engine_drafts_a_long_match_while_short_ones_hold_the_pool_down():
    """A copy run's first verifications follow the quotes' starts (short matches, most
    failing): the pooled acceptance falls, yet a long match, not verified yet, is drafted
    on the strength of the shorter matches that held (it was declined at the pool's
    acceptance, and one copying stream made 1.03 tokens a step for its first ~600)."""
    policy = measured_policy([1, 5])
    for _ in range(100):
        policy.record(4, 0, match=1)
    for _ in range(10):
        policy.record(4, 4, match=3)
    assert policy.prior() < 0.3
    [drafts] = policy.choose([(4, 100, policy.draft_probs(8, 4))], 0.0, 0.0, 100, rows=1)
    assert drafts >= 2  # as many as the EPYC's step times pay for at ~0.8 a position
    assert policy.choose([(4, 100, policy.prior())], 0.0, 0.0, 100, rows=1) == [0]


def test_measured_policy_prices_drafts_by_the_match_they_follow():
    """With the EPYC's step times one stream verifies four drafts that follow an 8-token
    match known to be copied, and none after a 1-token match known to fail, in the same
    engine; the best case (`ask`) is the best-paying match's, so requests are still asked
    for drafts while most of its matches are short ones that fail (one running acceptance
    stopped asking for good: 1.03 tokens a step on the copy workload)."""
    policy = measured_policy([1, 5])
    for _ in range(20):
        policy.record(4, 4, match=8)
    for _ in range(200):
        policy.record(4, 0, match=1)
    assert policy.prior() < 0.5  # the pooled acceptance is low
    assert policy.choose([(4, 100, policy.draft_probs(8, 4))], 0.0, 0.0, 100, rows=1) == [4]
    assert policy.choose([(4, 100, policy.draft_probs(1, 4))], 0.0, 0.0, 100, rows=1) == [0]
    assert policy.ask([(4, 100, policy.best_probs(4))], 0.0, 100, rows=1) == [True]
    assert policy.ask([(4, 100, policy.prior())], 0.0, 100, rows=1) == [False]


def test_policy_asks_requests_with_the_same_best_case_alike():
    """The best case of one draft's worth (rows 3 cost 1.2x rows 2, rows 4 twice) drafts
    for one of two equal requests; both are asked, since either may find the draft."""
    policy = measured_policy([2, 3, 4], step_ms=lambda rows: {2: 10.0, 3: 12.0}.get(rows, 20.0))
    assert policy.choose([(4, 100, 0.9)] * 2, 0.0, 0.0, 100, rows=2) == [1, 0]
    assert policy.ask([(4, 100, 0.9)] * 2, 0.0, 100, rows=2) == [True, True]


def epyc_step_ms(rows: int) -> float:
    """SmolLM2's decode step on the 2-vCPU AVX2 EPYC, by query rows (the shape measured
    there: 5 rows ~2.5x one, compute-bound; past 8 rows the fused layers stop and every
    row costs more)."""
    return 10.0 + 6.0 * rows if rows <= 8 else 40.0 + 7.5 * rows


def measured_policy(rows_seen, step_ms=epyc_step_ms) -> AdaptivePolicy:
    policy = AdaptivePolicy(4, CostTerms())
    for rows in rows_seen:
        for _ in range(STEP_SAMPLES):
            policy.observe_step(rows, step_ms(rows) / 1000)
    return policy


def test_step_times_trust_a_row_count_after_a_few_steps_and_fill_the_gaps():
    times = StepTimes()
    prior = CostTerms().step_time
    times.observe(4, 0.010)
    assert not times.known_at_or_below(4)  # one step is not enough
    for rows, seconds in [(4, 0.010), (4, 0.010), (8, 0.020), (8, 0.020), (8, 0.020)]:
        times.observe(rows, seconds)
    assert times.known_at_or_below(4) and not times.known_at_or_below(3)
    assert times.estimate(4, prior) == pytest.approx(0.010)
    assert times.estimate(6, prior) == pytest.approx(0.015)  # between two measured
    assert times.estimate(16, prior) == pytest.approx(0.040)  # the last two's line
    lone = StepTimes()
    for _ in range(STEP_SAMPLES):
        lone.observe(8, 0.020)
    # one measured: the prior's shape (1 + rows / 32) scaled to it
    assert lone.estimate(16, prior) == pytest.approx(0.020 * (1 + 16 / 32) / (1 + 8 / 32))
    times.observe(4, 0.200)  # a step that waited for the CPU: no matter
    assert times.estimate(4, prior) == pytest.approx(0.010)
    for _ in range(20):  # a slower machine now: the recent steps count
        times.observe(4, 0.030)
    assert times.estimate(4, prior) == pytest.approx(0.030)


def test_step_times_forget_a_row_count_not_measured_for_a_while():
    """A verification step's time measured under load stops drafting, so it would never be
    measured again: after STEP_STALE steps without it, the policy estimates it afresh (and
    drafts, to measure it again)."""
    policy = measured_policy([1], step_ms=lambda rows: 16.0)
    for _ in range(STEP_SAMPLES):
        policy.observe_step(5, 0.100)  # 6x a 1-row step: a loaded machine
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [0]
    for _ in range(STEP_STALE + 16):
        policy.observe_step(1, 0.016)
    assert 5 not in policy.times.count
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [4]


def test_measured_policy_drafts_only_when_tokens_per_second_go_up():
    """With the EPYC's measured step times (5 rows 2.5x one), one copying stream
    (acceptance 0.9) gains from every draft, at 0.8 from two (a third's 0.51 tokens cost
    more than its row), one chat stream (0.3) from none; four copying streams do not pay
    for 16 drafts (20 rows cost 5.6x 4 rows, past the fused layers) but do for one each;
    32 chat streams get none."""
    one = measured_policy([1, 5])
    assert one.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [4]
    assert one.choose([(4, 100, 0.8)], 0.0, 0.0, 100, rows=1) == [2]
    assert one.choose([(4, 100, 0.3)], 0.0, 0.0, 100, rows=1) == [0]
    four = measured_policy([4, 8, 20])
    assert four.choose([(4, 100, 0.9)] * 4, 0.0, 0.0, 100, rows=4) == [1] * 4
    assert four.choose([(4, 100, 0.3)] * 4, 0.0, 0.0, 100, rows=4) == [0] * 4
    many = measured_policy([32, 64])
    assert many.choose([(4, 100, 0.3)] * 32, 0.0, 0.0, 1000, rows=32) == [0] * 32
    # the chosen drafts are the highest-acceptance requests' first positions
    assert four.choose([(4, 100, 0.2), (4, 100, 0.9), (4, 100, 0.2), (4, 100, 0.2)],
                       0.0, 0.0, 100, rows=4)[0] == 0


def test_measured_policy_prices_fewer_drafts_at_most_what_more_cost():
    """A step of more rows does not cost less: where 3 and 4 rows were measured dearer
    than 5 (noise), a proposal of two drafts is priced at 5 rows' time and verified whole
    (at 3 rows' 17.9 ms the second would not pay: 2.44 tokens in 17.9 ms against 1.8 in
    12.7)."""
    times = {1: 7.5, 3: 17.9, 4: 16.9, 5: 15.5}
    policy = measured_policy(list(times), step_ms=times.get)
    assert policy.choose([(2, 100, 0.8)], 0.0, 0.0, 100, rows=1) == [2]
    assert policy.choose([(4, 100, 0.8)], 0.0, 0.0, 100, rows=1) == [4]


def test_measured_policy_drafts_nothing_for_a_gain_within_the_noise():
    """Drafts that promise under MIN_GAIN more tokens per second than none are not made:
    one stream whose step of 2 rows costs 1.6x one of 1 row breaks even at acceptance
    0.6 (1.6 tokens for 1.6x the time), so at 0.62 (1% more) it drafts nothing and at 0.8
    (12.5% more) one draft."""
    policy = measured_policy([1, 2], step_ms=lambda rows: 10.0 if rows == 1 else 16.0)
    assert policy.choose([(1, 100, 0.62)], 0.0, 0.0, 100, rows=1) == [0]
    assert policy.choose([(1, 100, 0.8)], 0.0, 0.0, 100, rows=1) == [1]


def test_measured_policy_drafts_nothing_in_a_step_with_a_prefill_chunk():
    """Once steps are measured, a step with a prefill chunk (rows None) gets no drafts:
    its extra rows are priced by no measurement, and it is compute-bound."""
    policy = measured_policy([1, 5])
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [4]
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=None) == [0]


def test_measured_policy_measures_the_step_without_drafts_first():
    policy = measured_policy([5])  # only verification steps measured so far
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [0]
    for _ in range(STEP_SAMPLES):
        policy.observe_step(1, epyc_step_ms(1) / 1000)
    assert policy.choose([(4, 100, 0.9)], 0.0, 0.0, 100, rows=1) == [4]


def test_policy_asks_the_proposer_only_where_the_best_case_pays():
    """Before the proposer runs, each request is priced as if it found all its drafts: with
    the EPYC's step times 32 chat streams (0.3) are asked nothing, one copying stream (0.9)
    is; among four streams only those whose first draft the best case would take; a step
    with a prefill chunk asks no one once steps are measured; a proposer whose time per
    request exceeds what its drafts save is not asked."""
    many = measured_policy([32, 64])
    assert many.ask([(4, 100, 0.3)] * 32, 0.0, 1000, rows=32) == [False] * 32
    one = measured_policy([1, 5])
    assert one.ask([(4, 100, 0.9)], 0.0, 100, rows=1) == [True]
    assert one.ask([(4, 100, 0.9)], 0.0, 100, rows=None) == [False]
    four = measured_policy([4, 8, 20])
    assert four.ask([(4, 100, 0.2), (4, 100, 0.9), (4, 100, 0.2), (4, 100, 0.9)], 0.0, 100,
                    rows=4) == [False, True, False, True]
    # one stream gains (4.1 tokens in 40 ms against 1 in 16 ms); a proposer taking 30 ms a
    # request (the median of its recent steps) makes that 4.1 in 70 ms: a loss
    for _ in range(2):
        one.observe_proposer(0.030, 1)
    assert one.propose_s == pytest.approx(0.030)
    assert one.ask([(4, 100, 0.9)], 0.0, 100, rows=1) == [False]
    unmeasured = AdaptivePolicy(4, CostTerms())  # no engine loop: everyone is asked
    assert unmeasured.ask([(4, 100, 0.1)] * 2, 0.0, 100, rows=2) == [True, True]


def test_one_slow_proposer_call_does_not_stop_the_asking():
    """The proposer's time is the median of its recent steps, so one slow call (a pause
    in the engine core) does not price every ask out while the acceptance evidence is
    thin; and a time that kept the proposer from being asked is forgotten after
    STEP_STALE measured steps, so a slowness that passed is measured again."""
    policy = AdaptivePolicy(4, CostTerms())
    for rows, ms in {1: 7.0, 2: 9.2, 3: 11.3, 5: 14.9}.items():  # SmolLM2, Zen 4 EPYC
        for _ in range(STEP_SAMPLES):
            policy.observe_step(rows, ms / 1000)
    policy.record(4, 1, match=2)
    policy.record(4, 0, match=1)
    best = policy.best_probs(4)  # thin evidence: ~0.5 a position
    policy.observe_proposer(0.020, 1)  # one 20 ms call
    for _ in range(3):
        policy.observe_proposer(0.00005, 1)
    assert policy.ask([(4, 100, best)], 0.0, 100, rows=1) == [True]
    slow = AdaptivePolicy(4, CostTerms())
    for rows, ms in {1: 7.0, 2: 9.2, 3: 11.3, 5: 14.9}.items():
        for _ in range(STEP_SAMPLES):
            slow.observe_step(rows, ms / 1000)
    for _ in range(3):
        slow.observe_proposer(0.020, 1)  # slow for a while: not asked
    assert slow.ask([(4, 100, best)], 0.0, 100, rows=1) == [False]
    for _ in range(STEP_STALE + 1):
        slow.observe_step(1, 0.007)
    assert slow.ask([(4, 100, best)], 0.0, 100, rows=1) == [True]


def test_scheduler_asks_no_proposer_for_chat_streams_once_steps_say_drafts_do_not_pay():
    sched = make_scheduler(block_size=4, speculative_config=NGRAM)
    calls = []
    propose = sched.drafting.proposer.propose
    sched.drafting.proposer.propose = lambda *a, **kw: calls.append(a[0]) or propose(*a, **kw)
    for i in range(8):
        sched.add(make_request(f"r{i}", [3, 4, 3, 4, 5 + i], max_tokens=40))
    worker = FakeWorker(4, model=lambda tokens: (tokens[-1] * 7 + len(tokens)) % 997 + 1)
    def step_s(rows):  # memory-bound: a draft's row costs a tenth of the step
        return 0.010 + 0.001 * rows
    for rows in (8, 16, 40):
        for _ in range(STEP_SAMPLES):
            sched.drafting.policy.observe_step(rows, step_s(rows))
    for _ in range(100):
        sched.drafting.policy.record(4, 0)  # drafts have failed so far
    for _ in range(6):
        plan, _ = step(sched, worker)
        sched.step_ran(plan, step_s(plan.total_num_scheduled_tokens))
    assert calls == []  # the prompts' step has a prefill chunk, the decodes do not pay
    sched.drafting.policy.record(1000, 995)  # had they been right, they would be asked
    step(sched, worker)
    assert len(calls) == 8


def test_scheduler_feeds_decode_step_times_to_the_policy():
    """The engine core tells the scheduler each plan's time; steps of decodes and their
    drafts teach the policy (by query rows), steps with a prefill chunk do not."""
    sched = make_scheduler(block_size=4, speculative_config=NGRAM)
    worker = FakeWorker(4, model=copying_model(period=2))
    sched.add(make_request("a", [3, 4, 3, 4], max_tokens=30))
    seen = []
    for _ in range(12):
        plan, _ = step(sched, worker)
        sched.step_ran(plan, 0.001 * plan.total_num_scheduled_tokens)
        seen.append(plan.total_num_scheduled_tokens)
    times = sched.drafting.policy.times
    assert seen[0] == 4 and 4 not in times.count  # the prompt's step
    assert seen[1] > 1  # nothing measured yet: drafts priced by the cost terms
    assert times.count.get(1, 0) >= STEP_SAMPLES  # then steps without drafts, measured
    assert any(rows > 1 for rows in times.count)


# -- the scheduler ----------------------------------------------------------------------------


def run_to_end(sched, worker, max_steps=500):
    outputs: dict[str, list[int]] = {}
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        plan, outs = step(sched, worker)
        plans.append(plan)
        for client_outs in outs.values():
            for o in client_outs:
                outputs.setdefault(o.req_id, []).extend(unpack_token_ids(o.new_token_ids))
    assert not sched.has_unfinished_requests()
    return outputs, plans


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_outputs_equal_plain_decoding_with_drafts_accepted_and_rejected(method):
    model = copying_model(period=5, slip_every=7)
    spec = NGRAM if method == "ngram" else {"method": "suffix", "num_speculative_tokens": 4}
    sched = make_scheduler(block_size=4, num_blocks=400, max_model_len=256,
                           speculative_config=spec)
    worker = FakeWorker(4, model=model)
    prompts = {f"r{i}": [10 + i, 20, 30 + i, 40, 50] for i in range(4)}
    for req_id, prompt in prompts.items():
        sched.add(make_request(req_id, prompt, max_tokens=30))
    outputs, plans = run_to_end(sched, worker)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == reference_tokens(prompt, max_tokens=30, max_model_len=256,
                                                   model=model)
    stats = sched.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert any(c.spec_token_ids for p in plans for c in p.cached_requests)
    assert sched.block_pool.free_queue.num_free == 400 - 1  # every block back


def test_draft_model_plans_carry_counts_and_outputs_equal_plain_decoding():
    """draft_model: the plan says how many drafts (the worker makes them), never which;
    outputs equal plain decoding with drafts accepted and rejected; the policy learns."""
    target = copying_model(period=5, slip_every=7)
    sched = make_scheduler(block_size=4, num_blocks=400, max_model_len=256,
                           speculative_config={"model": "/draft", "num_speculative_tokens": 3})
    worker = FakeWorker(4, model=target, draft_model=copying_model(period=5))
    prompts = {f"r{i}": [10 + i, 20, 30 + i, 40, 50] for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add(make_request(req_id, prompt, max_tokens=30))
    outputs: dict[str, list[int]] = {}
    plans = []
    while sched.has_unfinished_requests():
        plan, outs = step(sched, worker)
        sched.step_ran(plan, 0.001 * plan.total_num_scheduled_tokens)
        plans.append(plan)
        for client_outs in outs.values():
            for o in client_outs:
                outputs.setdefault(o.req_id, []).extend(unpack_token_ids(o.new_token_ids))
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == reference_tokens(prompt, max_tokens=30, max_model_len=256,
                                                   model=target)
    cached = [c for p in plans for c in p.cached_requests]
    assert any(c.num_model_drafts for c in cached) and not any(c.spec_token_ids for c in cached)
    assert all(c.num_scheduled_tokens == 1 + c.num_model_drafts for c in cached)
    stats = sched.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert any(rows > 1 for rows in sched.drafting.policy.times.count)  # steps with drafts


def test_drafts_count_against_the_budget_and_stop_inside_the_run_truncates():
    model = copying_model(period=2)
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                           speculative_config={**NGRAM, "adaptive": False})
    worker = FakeWorker(4, model=model)
    sched.add(make_request("a", [3, 4, 3, 4], max_tokens=40, eos=4, min_tokens=5))
    sched.add(make_request("b", [5, 6, 5, 6], max_tokens=9))
    outputs, plans = run_to_end(sched, worker)
    assert all(p.total_num_scheduled_tokens <= 8 for p in plans)
    assert any(c.spec_token_ids for p in plans for c in p.cached_requests)
    assert outputs["a"] == reference_tokens([3, 4, 3, 4], max_tokens=40, max_model_len=4096,
                                            eos=4, min_tokens=5, model=model)
    assert outputs["b"] == [5, 6] * 4 + [5]  # max_tokens inside an accepted run


def test_preemption_drops_drafts_and_recomputes():
    model = copying_model(period=3, slip_every=5)
    sched = make_scheduler(block_size=4, num_blocks=9, max_model_len=32,
                           speculative_config={**NGRAM, "adaptive": False})
    worker = FakeWorker(4, model=model)
    prompts = {f"r{i}": [7 + i, 8, 9] for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add(make_request(req_id, prompt, max_tokens=20))
    outputs, _ = run_to_end(sched, worker)
    assert sched.num_preemptions > 0
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == reference_tokens(prompt, max_tokens=20, max_model_len=32,
                                                   model=model)


def test_requests_needing_more_than_plain_sampling_never_draft():
    sched = make_scheduler(block_size=4, speculative_config=NGRAM)
    worker = FakeWorker(4, model=copying_model(period=2))
    request = make_request("lp", [3, 4, 3, 4], max_tokens=8)
    request.sampling = type(request.sampling)(max_tokens=8, logprobs=1)
    sched.add(request)
    _, plans = run_to_end(sched, worker)
    assert not any(c.spec_token_ids for p in plans for c in p.cached_requests)
