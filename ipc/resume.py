"""Resubmission: the request that continues a completion on another engine core after the
tokens already delivered (prompt plus those tokens, lengths reduced, everything else the
same), and the finish of one whose final output was lost with its core. Frontends heal a lost
core with it (`frontend/output_processor.py`), and so does the data-parallel router when one
of its cores dies (`engine_core/dp_router.py`). No IO.
"""

from __future__ import annotations

import msgspec

from .messages import SamplingParams


def resume_params(params: SamplingParams, delivered: list[int]) -> SamplingParams | None:
    """The engine-side params that continue a completion after `delivered` tokens, sent with
    prompt + delivered as the new prompt: max_tokens and min_tokens less what was delivered,
    all else (seed, stops, penalties) unchanged; a max_tokens of None (up to the context
    length) stays None. None when nothing is left to generate.

    A seeded request draws the same numbers: the worker hashes (seed, absolute position),
    and the positions are the same. Penalties and a structured output's grammar stay the
    same because the AddRequest says how many of its prompt's tokens were generated
    (`num_resumed_tokens`): penalties count them as output, the grammar replays them.
    """
    left = None if params.max_tokens is None else params.max_tokens - len(delivered)
    if left is not None and left <= 0:
        return None
    # prompt logprobs come with the first token: once one was delivered they were too, and
    # the new prompt's would cover the delivered tokens as well
    prompt_logprobs = params.prompt_logprobs if not delivered else None
    return msgspec.structs.replace(params, max_tokens=left,
                                   min_tokens=max(0, params.min_tokens - len(delivered)),
                                   prompt_logprobs=prompt_logprobs)


def lost_finish(params: SamplingParams, delivered: list[int],
                eos_token_id: int | None) -> tuple[str, int | None]:
    """(finish_reason, stop_reason) of a completion that had all its tokens delivered but
    whose finish was lost with the core: "stop" when its last token is a stop token (or
    EOS) past min_tokens, else "length"."""
    last = delivered[-1] if delivered else None
    if last is not None and len(delivered) > params.min_tokens:
        if last in params.stop_token_ids:
            return "stop", last
        if last == eos_token_id and not params.ignore_eos:
            return "stop", None
    return "length", None
