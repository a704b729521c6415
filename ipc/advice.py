"""The engine core's side conversation with its preemption advisor, a child process
(`python -m tidal.engine_core.advice.advise FILE`, started by
`engine_core/advice/preemption_advice.py`): the core writes a `PreemptionWindow` as msgpack to
FILE; the child writes a `PreemptionPrediction` as msgpack to its stdout. The conventions of
`ipc/messages.py` hold (array-like Structs, new fields at the end).
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


class WindowRequest(msgspec.Struct, **_STRUCT):
    """One request the engine core saw, as a simulator replays it (never its tokens)."""

    arrival_time: float
    """Seconds on the core's clock (only differences matter)."""
    prompt_len: int
    output_len: int
    """Tokens generated (so far, for a request still running when the window was taken)."""
    prefix_hashes: bytes
    """Chained 64-bit hashes, 8 bytes each, of the prompt's full blocks of
    `PreemptionWindow.block_tokens` tokens (the prefix cache's hashes, cut to 64 bits):
    equal first k hashes = equal first k blocks."""
    priority: int = 0
    num_preemptions: int = 0
    """Times the engine preempted it."""
    first_token_time: float = 0.0
    finish_time: float = 0.0
    """When its first token came and when it finished, on the core's clock (0: not yet): the
    pace the engine really decoded at, which the simulator calibrates its step times to."""


class PreemptionWindow(msgspec.Struct, **_STRUCT):
    """Engine core -> advisor: the traffic around a spell of preemptions, and the engine it
    ran on."""

    engine_config: str
    """`encode_engine_config` of the core's config."""
    num_kv_blocks: int
    max_model_len: int
    step_cost_model: str
    """Path of the step cost model file the simulator times steps with."""
    requests: list[WindowRequest]
    num_unfinished: int = 0
    """Requests still running when the window was taken (their output_len is a lower bound)."""
    block_tokens: int = 16
    """Tokens per hashed prompt block (the engine's block size)."""


class PreemptionPrediction(msgspec.Struct, **_STRUCT):
    """Advisor -> engine core: what the simulator predicts for the window, as configured and
    with each flag change the preemption warning suggests."""

    summary: str
    """One sentence for the preemption warnings that follow ("with --max-num-seqs 48: no
    preemptions at that load ...")."""
    report: str
    """The table behind it: one line per setting simulated."""
