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
from tidal.engine_core.config import SchedulerConfig
from tidal.engine_core.spec_decode import (
    AdaptivePolicy, CostTerms, NgramProposer, SuffixProposer, expected_tokens,
    parse_speculative_config,
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
                     ({"model": "/some/draft", "num_speculative_tokens": 2}, "draft_model"),
                     ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=key):
            parse_speculative_config(bad)


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
    assert p.propose("a", tokens) == [1, 2, 6, 7]
    assert p.propose("a", tokens, k=2) == [1, 2]
    assert p.propose("a", [1, 2, 3]) == []  # nothing recurs
    strict = NgramProposer(parse_speculative_config({**NGRAM, "prompt_lookup_min": 3}))
    assert strict.propose("a", tokens) == []  # only 2 tokens match


def test_suffix_matches_own_tokens_then_earlier_requests_outputs():
    p = SuffixProposer(parse_speculative_config({"method": "suffix",
                                                 "num_speculative_tokens": 3}))
    assert p.propose("a", [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert p.propose("b", [9, 8, 40, 41]) == []
    p.finished("a", [1, 2, 3, 4, 1, 2, 40, 41, 42, 43], num_prompt=4)
    assert p.propose("b", [9, 8, 40, 41]) == [42, 43]  # from a's output
    assert "a" not in p.own


# -- the adaptive policy ----------------------------------------------------------------------


def test_expected_tokens_is_one_plus_a_geometric_run():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


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


def test_policy_acceptance_estimate_follows_evidence():
    policy = AdaptivePolicy(4, CostTerms())
    assert policy.alpha(0, 0) == pytest.approx(0.5)
    policy.record(100, 90)
    assert policy.alpha(0, 0) > 0.85
    assert policy.alpha(0, 40) < 0.2  # its own record outweighs the prior


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
