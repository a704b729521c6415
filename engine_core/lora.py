"""Which LoRA adapters sit in the workers' slots (the engine core's half of LoRA; the
workers' half, stacked weights and the batched product, is `workers/lora.py`).

The workers hold `max_loras` slots of stacked adapter weights. The engine core decides what
each slot holds, step by step, and tells every rank in the plan (`BatchPlan.lora_slots`):

- The adapters of running requests are resident, each in its own slot. So a waiting request
  of an adapter that is not resident is admitted only while some slot holds no running
  request's adapter (`can_admit`); the scheduler skips it otherwise, as vLLM does, so a step
  never uses more than max_loras adapters.
- Admitting such a request takes the least recently used slot that no running request needs
  and sends the adapter (its path, never tensors) to every rank in the next plan. Workers run
  plans in order, so the steps still in flight keep the slot's old adapter until they ran.
- New workers hold nothing: `reset` forgets every slot, and admissions load them again.

One id is one adapter: a request naming an id the core knows under another name or path is
refused (`check`), so an id in the prefix cache's block hashes (`KVCacheManager`) means one
set of weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ..ipc.messages import LoRARequest
from ..ipc.worker_messages import LoRASlot


class LoRASlots:
    """The engine core's map of adapter slots (see the module docstring)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        """lora_int_id -> slot, least recently admitted first."""
        self.known: dict[int, LoRARequest] = {}
        """lora_int_id -> the adapter it names (kept while the core has seen it)."""
        self._pending: list[LoRASlot] = []
        """Loads for the next plan."""

    def check(self, lora: LoRARequest) -> None:
        """ValueError when the id already names another adapter."""
        seen = self.known.get(lora.lora_int_id)
        if seen is not None and (seen.lora_name, seen.lora_path) != (lora.lora_name,
                                                                       lora.lora_path):
            raise ValueError(f"lora_request lora_int_id {lora.lora_int_id} already names "
                             f"adapter {seen.lora_name!r} at {seen.lora_path!r}; give "
                             f"{lora.lora_name!r} an id of its own")
        self.known[lora.lora_int_id] = lora

    def can_admit(self, lora: LoRARequest | None, in_use: set[int]) -> bool:
        """Whether a request of `lora` may join running requests whose adapters are
        `in_use` (ids): the base model always may, an adapter while the step would use
        at most max_loras of them."""
        return lora is None or lora.lora_int_id in in_use or len(in_use) < self.max_loras

    def admit(self, lora: LoRARequest, in_use: set[int]) -> None:
        """Make `lora` resident (a request of it is admitted; `can_admit` held): keep its slot,
        or take the least recently used slot no id of `in_use` holds and queue the load."""
        lora_id = lora.lora_int_id
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in in_use)
            slot = self.slot_of.pop(victim)
        self.slot_of[lora_id] = slot
        self._pending.append(LoRASlot(slot, lora))

    def take_loads(self) -> list[LoRASlot]:
        """The loads the next plan carries."""
        loads, self._pending = self._pending, []
        return loads

    def reset(self) -> None:
        """New workers hold no adapter: every slot is empty again."""
        self.slot_of.clear()
        self._pending.clear()


def adapters_in_use(requests: Iterable) -> set[int]:
    """The adapter ids of these requests (each with a `lora` attribute)."""
    return {r.lora.lora_int_id for r in requests if r.lora is not None}
