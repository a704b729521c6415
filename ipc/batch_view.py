"""The live view of the batch (`tidal serve`'s page at `/`, `tidal top`): what the engine core
tells a frontend that asked for it in a `StatsQuery` (`view_since`), as `SchedulerStats.view`.

The engine core records one `StepRecord` per step only while a view was asked for in the last
few seconds (`engine_core/batch_view.py`); a frontend polls a few times a second and gets the
steps since the last one it saw, at most `MAX_STEPS_PER_VIEW` of them (the newest: at hundreds
of steps a second the page samples, the engine never waits for it). The conventions of
`ipc/messages.py` hold (array-like Structs, new fields at the end).
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)

MAX_STEPS_PER_VIEW = 64
"""Steps one answer carries at most (the newest); older ones are counted in `skipped`."""


class StepRequest(msgspec.Struct, **_STRUCT):
    """One request's part in a step."""

    req_id: str
    num_tokens: int
    """Tokens computed for it in this step."""
    prefill: bool
    """True while those tokens are its prompt's (a prefill chunk), False for a decode."""


class StepRecord(msgspec.Struct, **_STRUCT):
    """One step as the engine core planned and ran it."""

    step_id: int
    time: float
    """Wall-clock seconds (time.time()) when its tokens came back."""
    seconds: float
    """Its time at the workers."""
    num_tokens: int
    """Tokens scheduled, of --max-num-batched-tokens."""
    requests: list[StepRequest]
    preempted: list[str] = []
    """Requests this step's plan preempted (recomputed later)."""
    kv_blocks_used: int = 0
    """KV blocks held by requests after the step."""


class BatchView(msgspec.Struct, **_STRUCT):
    """What the page shows: the recent steps and the engine core's state now."""

    steps: list[StepRecord]
    skipped: int = 0
    """Steps since `view_since` left out of `steps` (only the newest are sent)."""
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    num_kv_blocks: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    """Free blocks that still hold a prefix-cache entry (reusable on a hit)."""
    waiting_by_priority: dict[int, int] = {}
    """Waiting requests per priority (lower runs first under --scheduling-policy priority)."""
    warnings: list[str] = []
    """The engine core's recent warnings (preemptions with what to change, the advisor's
    table), oldest first."""
