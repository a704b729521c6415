"""benchmarks/spec_ceiling.py's replay: what each policy yields over walks of known accepted
runs, and that the engine's own AdaptivePolicy, replayed, drafts where drafts pay and not
where they do not."""

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "spec_ceiling.py"


@pytest.fixture(scope="module")
def ceiling():
    spec = importlib.util.spec_from_file_location("tidal_bench_spec_ceiling", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# one answer of 41 decode positions where every draft of 16 is right all the way (a copy),
# and one of 41 where no draft token is (a chat whose proposals all miss)
COPYING = [[(8, 16, 16)] * 41]
MISSING = [[(2, 16, 0)] * 41]
CPU_COST = [1.0 + 0.27 * k for k in range(17)]


def test_fixed_counts_yield_their_runs_and_pay_their_rows(ceiling):
    per_step, speed = ceiling.replay(COPYING, CPU_COST, ceiling.fixed(4))
    # 41 positions in steps of 5 tokens (the last step has 1 left and no room for drafts)
    assert per_step == pytest.approx(41 / 9)
    assert speed == pytest.approx(41 / (8 * CPU_COST[4] + 1))
    # one token a step, each paying for 4 rejected drafts, fewer in the last 4 steps, where
    # the answer has fewer tokens left (as max_tokens trims an engine's drafts)
    cost = 37 * CPU_COST[4] + CPU_COST[3] + CPU_COST[2] + CPU_COST[1] + CPU_COST[0]
    assert ceiling.replay(MISSING, CPU_COST, ceiling.fixed(4)) == pytest.approx(
        (1.0, 41 / cost))


def test_the_oracle_drafts_exactly_the_accepted_run(ceiling):
    assert ceiling.replay(MISSING, CPU_COST, ceiling.oracle)[1] == pytest.approx(1.0)
    per_step, _ = ceiling.replay(COPYING, CPU_COST, ceiling.oracle)
    assert per_step > 10  # 16 drafts a step, all kept


def test_the_adaptive_policy_drafts_where_it_pays_and_not_where_it_does_not(ceiling):
    _, copying = ceiling.replay(COPYING * 4, CPU_COST, ceiling.adaptive(4, CPU_COST))
    assert copying > 1.8  # at most 5 tokens for 2.08 of cost a step once it has learned
    _, missing = ceiling.replay(MISSING * 4, CPU_COST, ceiling.adaptive(4, CPU_COST))
    assert missing > 0.9  # a few probing drafts, then none


def test_the_best_count_per_match_length_is_fit_on_the_walks(ceiling):
    walks = COPYING + MISSING  # match 8 always copies, match 2 never does
    _, speed = ceiling.replay(walks, CPU_COST, ceiling.best_per_match(walks, CPU_COST))
    _, oracle = ceiling.replay(walks, CPU_COST, ceiling.oracle)
    assert speed == pytest.approx(oracle)
