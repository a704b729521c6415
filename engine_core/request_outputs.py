"""What one step's results make of a request, for `Scheduler.update`: the stop check, the
fields only its first output carries, and its prompt logprobs, kept in position order as
they arrive in pieces and handed over in one with its first output."""

from __future__ import annotations

import logging

import msgspec

from .request import Request, RequestStatus
from ..ipc.frontend_messages import EngineCoreOutput
from ..ipc.messages import PromptLogprobs, drop_prompt_positions, join_prompt_logprobs

logger = logging.getLogger("tidal.engine_core.scheduler")  # its records are the scheduler's


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """EOS (unless ignore_eos) or a stop token, once more than min_tokens tokens exist;
    then max_tokens or the context length."""
    num_output = len(request.output_token_ids)
    if num_output > request.min_tokens:
        if token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def mark_first_output(request: Request, out: EngineCoreOutput) -> None:
    """Give `out` the fields only a request's first output carries (queue time, cached
    tokens), unless it had its first output already."""
    if not request.first_output_sent:
        request.first_output_sent = True
        out.num_cached_tokens = request.num_cached_tokens
        out.queue_time = request.queue_time


def add_prompt_logprobs(requests: dict[str, Request], parts: list[PromptLogprobs],
                        step_id: int) -> None:
    """Keep each request's prompt logprobs in position order until its first output.
    A request recomputing its prompt after a preemption sends positions again: those
    already here are dropped (results of steps planned before it was preempted are
    dropped whole, as its tokens are). `requests`: the unfinished ones, by id."""
    for part in parts:
        request = requests.get(part.req_id)
        if (request is None or step_id < request.discard_before_step
                or request.prompt_logprob_parts is None):
            continue
        known = request.next_prompt_logprob - part.start
        if known < 0:
            logger.error("request %r: prompt logprobs from position %d arrived while %d "
                         "was expected; dropped", part.req_id, part.start,
                         request.next_prompt_logprob)
            continue
        if known >= part.num_positions:
            continue
        if known:
            part = drop_prompt_positions(part, known)
        request.prompt_logprob_parts.append(part)
        request.next_prompt_logprob = part.start + part.num_positions


def take_prompt_logprobs(request: Request) -> PromptLogprobs:
    """The request's prompt logprobs in one piece (empty for a one-token prompt); from now on
    it wants none, so a resume after a preemption neither recomputes them nor skips the
    prefix cache."""
    parts = request.prompt_logprob_parts
    request.prompt_logprob_parts = None
    num_logprobs = request.sampling.prompt_logprobs
    request.sampling = msgspec.structs.replace(request.sampling, prompt_logprobs=None)
    if not parts:
        return PromptLogprobs(request.req_id, 1, num_logprobs, b"", b"", b"")
    return join_prompt_logprobs(parts)
