"""`EngineCore` (core.py) on the in-process fake executor: how many plans it keeps in flight,
and that the depth changes timing, never tokens."""

import logging

import pytest
from fake_executor import FakeExecutor
from sched_utils import FakeWorker, make_request, make_scheduler, output_tokens, reference_tokens

from tidal.engine_core.core import EngineCore


@pytest.fixture(autouse=True)
def _quiet_preemption_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="tidal.engine_core.scheduler")


def _run(core: EngineCore, req_ids) -> dict[str, list[int]]:
    """Step until every request finished; each request's tokens."""
    tokens = {r: [] for r in req_ids}
    while core.has_work():
        outputs = core.step()
        assert outputs is not None  # the fake executor always answers
        for r in tokens:
            tokens[r] += output_tokens(outputs, r)
        core.scheduler.check_invariants()
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_equal_the_reference_under_preemption(async_scheduling):
    """A tight pool (8 blocks of 16, 112 tokens) and 6 requests of 20-50 prompt tokens force
    preemptions; every request still gets exactly the fake model's tokens."""
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=48,
                           async_scheduling=async_scheduling)
    executor = FakeExecutor(FakeWorker(16))
    core = EngineCore(sched, executor, sched.config.pipeline_depth)
    prompts = {str(i): [i + 1] * (20 + 6 * i) for i in range(6)}
    for req_id, prompt in prompts.items():
        sched.add(make_request(req_id, prompt, max_tokens=30))
    tokens = _run(core, prompts)
    assert sched.num_preemptions > 0
    assert tokens == {r: reference_tokens(p, max_tokens=30, max_model_len=112)
                      for r, p in prompts.items()}
    assert executor.max_pending == (2 if async_scheduling else 1)

