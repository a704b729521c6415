"""LoRA in the engine core (docs/lora.md, engine_core/lora.py): a step uses at most
max_loras adapters, the plan carries the slot loads, one id names one adapter, and the
adapter is part of the prefix cache's block hash."""

from __future__ import annotations

import dataclasses

import pytest
from sched_utils import FakeWorker, make_config, make_request, step

from tidal.engine_core.config import LoRAConfig
from tidal.engine_core.kv_cache_manager import KVCacheManager
from tidal.engine_core.scheduler import Scheduler
from tidal.ipc.messages import LoRARequest


def _lora_scheduler(max_loras: int) -> Scheduler:
    config = dataclasses.replace(make_config(), lora=LoRAConfig(enable_lora=True,
                                                                max_loras=max_loras))
    return Scheduler(config, 1000, 256)


def test_a_step_uses_at_most_max_loras_adapters_and_the_slots_follow():
    """max_loras=1: the base model and one adapter run together; a request of a second
    adapter waits (skipped, not blocking the base request behind it) until the first
    adapter's requests are done, then its load goes out in the plan that admits it."""
    sched = _lora_scheduler(1)
    worker = FakeWorker(16)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for req_id, lora, max_tokens in (("ra", a, 2), ("rb", b, 2), ("base", None, 4)):
        request = make_request(req_id, 5, max_tokens=max_tokens)
        request.lora = lora
        sched.add(request)
    plan, _ = step(sched, worker)
    assert [n.req_id for n in plan.new_requests] == ["ra", "base"]
    assert [(s.slot, s.lora.lora_name) for s in plan.lora_slots] == [(0, "a")]
    assert [n.lora_int_id for n in plan.new_requests] == [1, 0]
    plan, _ = step(sched, worker)  # ra finishes (2 tokens)
    plan, _ = step(sched, worker)
    assert [n.req_id for n in plan.new_requests] == ["rb"]
    assert [(s.slot, s.lora.lora_name) for s in plan.lora_slots] == [(0, "b")]


def test_an_id_names_one_adapter():
    sched = _lora_scheduler(2)
    request = make_request("r1", 5)
    request.lora = LoRARequest("a", 1, "/a")
    sched.add(request)
    other = make_request("r2", 5)
    other.lora = LoRARequest("b", 1, "/b")
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a'"):
        sched.add(other)


def test_without_enable_lora_a_lora_request_is_refused():
    sched = Scheduler(make_config(), 1000, 256)
    request = make_request("r1", 5)
    request.lora = LoRARequest("a", 1, "/a")
    with pytest.raises(ValueError, match="needs an engine started with --enable-lora"):
        sched.add(request)


def test_the_adapter_is_part_of_the_block_hash():
    """The same tokens under two adapters and the base model: three different chains."""
    kv = KVCacheManager(100, 16)
    hashes = []
    for lora in (None, LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")):
        request = make_request("r", [7] * 40)
        request.lora = lora
        kv.ensure_block_hashes(request, 2)
        hashes.append(tuple(request.block_hashes))
    assert len(set(hashes)) == 3
