"""A worker's grammar compiles run off the step path with a timeout, a request without a token
to stop on is refused rather than crashing the worker, and compiled grammars are cached only
up to a byte limit (issue 39)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from tidal.frontend.structured_output import GrammarChecker
from tidal.ipc.frontend_messages import EngineInfo
from tidal.ipc.messages import SamplingParams, StructuredOutputsParams
from tidal.ipc.worker_messages import GrammarToCompile
from tidal.workers.structured_output import GrammarError, StructuredOutputs

SLOW = StructuredOutputsParams(json={  # seconds to compile (a 1000-way object)
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,30}"} for i in range(1000)},
    "required": [f"p{i}" for i in range(1000)],
})
FAST = StructuredOutputsParams(regex="[0-9]{3}")


def test_a_compile_runs_on_its_thread_and_is_reported_once(tiny_llama):
    grammars = StructuredOutputs(tiny_llama, 512)
    grammars.compiler()  # loaded up front: the timeout does not count the first load
    grammars.start([GrammarToCompile("fast", FAST)])
    deadline = time.monotonic() + 30
    ready = []
    while not ready and time.monotonic() < deadline:
        ready, failed = grammars.poll(wait=0.05)
        assert failed == []
    assert ready == ["fast"] and not grammars.pending()
    assert grammars.poll() == ([], [])
    grammars.add("fast", FAST, np.array([1]), np.array([], np.int64))
    assert len(grammars) == 1
    grammars.forget("fast")
    assert len(grammars) == 0 and grammars.compiles == {}


def test_a_compile_past_the_timeout_fails_its_request_naming_the_flag(tiny_llama):
    grammars = StructuredOutputs(tiny_llama, 512, compile_timeout=0.2)
    grammars.compiler()
    start = time.monotonic()
    grammars.start([GrammarToCompile("slow", SLOW)])
    assert time.monotonic() - start < 0.1  # start returns at once
    failed = []
    while not failed:
        assert time.monotonic() - start < 30
        _, failed = grammars.poll(wait=0.05)
    (failure,) = failed
    assert failure.req_id == "slow"
    assert "within 0.2 s of CPU time (--structured-outputs-compile-timeout)" in failure.error
    with pytest.raises(GrammarError, match="--structured-outputs-compile-timeout"):
        grammars.add("slow", SLOW, np.array([1]), np.array([], np.int64))


def test_a_request_without_a_stop_token_is_refused_not_a_crash(tiny_llama):
    grammars = StructuredOutputs(tiny_llama, 512)
    with pytest.raises(GrammarError, match="needs a token to stop on"):
        grammars.add("r", FAST, np.array([], np.int64), np.array([], np.int64))


def test_compiled_grammars_are_cached_up_to_the_byte_limit(tiny_llama):
    limit = 2 * 2**20
    grammars = StructuredOutputs(tiny_llama, 512, cache_bytes=limit)
    for i in range(40):  # ~0.1-0.4 MB each: an unbounded cache would hold them all
        spec = StructuredOutputsParams(json={"type": "object", "properties": {
            f"k{i}_{j}": {"type": "integer"} for j in range(20)}})
        spec.compile_with(grammars.compiler())
    assert 0 < grammars.compiler().get_cache_size_bytes() <= limit


def _checker(tokenizer_path: str, **limits) -> GrammarChecker:
    info = EngineInfo(model=tokenizer_path, max_model_len=512, num_kv_blocks=8, block_size=16,
                      max_num_seqs=4, max_num_batched_tokens=64, vocab_size=512, **limits)
    return GrammarChecker(PreTrainedTokenizerFast.from_pretrained(tokenizer_path), info, 2)


def test_the_frontend_check_refuses_a_slow_schema_within_the_timeout(tiny_llama):
    checker = _checker(tiny_llama, structured_outputs_compile_timeout=0.3)
    checker.check(SamplingParams(structured_outputs=FAST))  # loads the compiler
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"structured_outputs.json did not compile within "
                                         r"0.3 s of CPU time \(--structured-outputs-compile"):
        checker.check(SamplingParams(structured_outputs=SLOW))
    assert time.monotonic() - start < 10.0  # 0.3 s of CPU, on however busy a machine


def test_the_frontend_check_refuses_a_schema_over_the_size_limit_without_compiling(tiny_llama):
    checker = _checker(tiny_llama, structured_outputs_max_bytes=1000)
    with pytest.raises(ValueError, match="over the limit of 1000"):
        checker.check(SamplingParams(structured_outputs=SLOW))
    assert checker._compiler is None
