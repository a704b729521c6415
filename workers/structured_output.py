"""Grammar matchers of the requests in a worker's batch that carry `structured_outputs`.

Where each part happens, and why:

- The frontend compiles every constraint once before sending it (it has the tokenizer), so a
  schema / regex / grammar that does not compile is a ValueError or an HTTP 400 naming the
  field, and never reaches the engine. The engine core only checks the shape
  (`StructuredOutputsParams.__post_init__`): it never imports xgrammar (xgrammar imports torch).
- Each worker rank compiles the constraint again, off the step path: a compiled grammar
  holds per-token mask caches of megabytes, too big for the wire. The engine core sends it
  in `BatchPlan.grammars` before it first schedules the request; `start` hands it to a
  thread of its own (xgrammar releases the GIL while it compiles: a 13 s compile on this
  project's 2-core VM left the step loop's largest gap at 0.02 s), and `poll` reports the
  compiles that ended, which the reporting rank sends back in `SampledTokens.grammars_ready`
  or, for one that does not compile or runs past `grammar_compile_timeout` seconds of CPU time, `failed`. The
  request waits in the engine core meanwhile; the batch goes on. xgrammar's compiler cache
  (bounded by `grammar_cache_bytes`, least recently used out) makes a repeated constraint,
  the common case, free. A timed-out compile cannot be stopped: it ends on its thread, and
  later compiles wait behind it (their own timeouts still count).
- A constraint that fails anyway when the request joins the batch (a core reached by a
  frontend that did not check) is refused for that request alone (`BadRequestData`).
- A matcher follows its request's tokens in the worker, which appends every token it samples
  itself (sync and async scheduling alike), so the mask for step N+1 always follows the token
  of step N. A request that joins the batch (first scheduling, resumed after a preemption by
  recompute, or after the workers were replaced) gets a fresh matcher that is replayed over
  the tokens it already generated (`token_ids[prompt_len - num_resumed_tokens:]`). Chunked prefill
  samples nothing until the prompt's end, so it never moves the matcher.
- Every tensor-parallel rank samples (identical logits, the same matchers, the same masks),
  so the ranks agree on every token without sending one.

The matcher's stop tokens are the request's own (EOS unless ignore_eos, and stop_token_ids):
exactly the tokens on which the engine core finishes it, so a complete grammar ends the
request with finish reason "stop" the step it allows nothing but those.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ipc.grammar import CompileTimer, compile_threads, make_compiler, timeout_error
from ..ipc.messages import StructuredOutputsParams
from ..ipc.worker_messages import GrammarToCompile, RequestFailure
from .persistent_batch import BadRequestData

logger = logging.getLogger(__name__)

POLL_WAIT = 0.05
"""Seconds a worker with nothing to compute waits for a compile to end before it answers a
plan (`BatchPlan.awaits_grammars`): the engine core's poll rate while only grammars are left."""


class GrammarError(BadRequestData):
    """A request's constraint cannot be compiled or replayed (the message names the field)."""


@dataclass
class _Compile:
    """One request's grammar compile on the compile thread."""

    spec: StructuredOutputsParams
    future: concurrent.futures.Future | None = None
    timer: CompileTimer = field(default_factory=CompileTimer)  # CPU seconds once it began
    reported: bool = False  # `poll` has said how it ended
    error: str | None = None  # why it failed (a compile error, or the timeout)


class StructuredOutputs:
    """req_id -> xgrammar matcher, for the requests of the batch that are constrained, and
    req_id -> their grammars' compiles, from `start` until the request finishes (`forget`).

    The tokenizer and compiler are loaded on the first constrained request, so a worker that
    never sees one never imports xgrammar.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, compile_timeout: float = 10.0,
                 cache_bytes: int = 512 * 2**20):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (the logits' width), >= the tokenizer's
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        self._compiler = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.compiles: dict[str, _Compile] = {}
        self.matchers: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.matchers)

    def compiler(self):
        if self._compiler is None:
            tokenizer = _load_tokenizer(self.tokenizer_path)
            self._compiler = make_compiler(tokenizer, self.vocab_size, self.cache_bytes)
        return self._compiler

    # -- compiles, off the step path ----------------------------------------------------------

    def start(self, jobs: list[GrammarToCompile]) -> None:
        """Begin compiling each job's grammar on the compile thread; return at once."""
        if self._pool is None:
            self._pool = compile_threads(1, "grammar-compile")
        for job in jobs:
            c = _Compile(job.spec)
            c.future = self._pool.submit(self._compile, c)
            self.compiles[job.req_id] = c

    def _compile(self, c: _Compile):
        """On the compile thread. The timeout counts the thread's CPU time from here, after
        the wait for the thread and the compiler's first load: a busy machine (the thread runs
        at nice 10) slows a compile without bringing it nearer its timeout."""
        compiler = self.compiler()
        c.timer.start()
        return c.spec.compile_with(compiler)

    def pending(self) -> bool:
        """Whether a compile has not been reported yet."""
        return any(not c.reported for c in self.compiles.values())

    def poll(self, wait: float = 0.0) -> tuple[list[str], list[RequestFailure]]:
        """(requests whose grammar compiled, requests whose grammar failed) among those not
        reported yet; with `wait`, first wait up to that many seconds for one to end."""
        waiting = [c.future for c in self.compiles.values() if not c.reported]
        if wait > 0 and waiting:
            concurrent.futures.wait(waiting, wait, concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for req_id, c in self.compiles.items():
            if c.reported:
                continue
            if c.future.done():
                error = c.future.exception()
                if error is None:
                    ready.append(req_id)
                else:
                    c.error = str(error) if isinstance(error, ValueError) else (
                        f"structured_outputs.{c.spec.kind} does not compile: {error}")
            elif c.timer.seconds() > self.compile_timeout:
                c.error = timeout_error(c.spec, self.compile_timeout)
            else:
                continue
            c.reported = True
            if c.error is not None:
                failed.append(RequestFailure(req_id, c.error))
        return ready, failed

    def _compiled(self, req_id: str, spec: StructuredOutputsParams):
        """The request's compiled grammar: its compile's (waited for where this rank is behind
        the reporting one), else compiled here and now (a plan that sent no grammar first).
        GrammarError when it failed."""
        c = self.compiles.get(req_id)
        try:
            if c is None:
                return spec.compile_with(self.compiler())
            if c.error is not None:
                raise ValueError(c.error)
            return c.future.result()
        except ValueError as e:
            raise GrammarError(f"{e} (request {req_id!r})") from None

    # -- matchers -----------------------------------------------------------------------------

    def add(self, req_id: str, spec: StructuredOutputsParams, stop_ids: np.ndarray,
            generated: np.ndarray) -> None:
        """A matcher for a request joining the batch, replayed over the tokens it already
        generated. GrammarError when the constraint does not compile, the request has no
        token to stop on, or the tokens do not follow it."""
        import xgrammar

        self.matchers.pop(req_id, None)
        if len(stop_ids) == 0:  # xgrammar refuses a matcher without stop tokens
            raise GrammarError(f"structured_outputs of request {req_id!r} needs a token to "
                               "stop on: it has no EOS token and no stop_token_ids")
        compiled = self._compiled(req_id, spec)
        matcher = xgrammar.GrammarMatcher(compiled,
                                          override_stop_tokens=[int(t) for t in stop_ids])
        for i, token in enumerate(generated.tolist()):
            if not matcher.accept_token(token):
                raise GrammarError(f"structured_outputs of request {req_id!r}: its token "
                                   f"{i} ({token}) does not follow the {spec.kind} grammar")
        self.matchers[req_id] = matcher

    def forget(self, req_id: str) -> None:
        """The request finished: drop its matcher and its compile."""
        self.matchers.pop(req_id, None)
        self.compiles.pop(req_id, None)

    def remove(self, req_id: str) -> None:
        """The request left the batch (preempted): drop its matcher, keep its compile."""
        self.matchers.pop(req_id, None)

    def bitmask(self, req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [M, ceil(vocab / 32)] int32, rows [M] int64) for the sampling rows whose
        request is constrained and not finished yet; None when there are none. Bit j of a row
        (word j // 32, bit j % 32) is 1 where token j is allowed."""
        import xgrammar

        rows = [i for i, r in enumerate(req_ids)
                if r in self.matchers and not self.matchers[r].is_terminated()]
        if not rows:
            return None
        mask = xgrammar.allocate_token_bitmask(len(rows), self.vocab_size)
        for k, i in enumerate(rows):
            self.matchers[req_ids[i]].fill_next_token_bitmask(mask, k)
        return mask, torch.tensor(rows, dtype=torch.int64)

    def accept(self, req_ids: list[str], token_ids: np.ndarray) -> None:
        """Advance each constrained request's matcher by the token it sampled. A token the
        matcher takes no more (sampled after its request's stop token, under async
        scheduling, and about to be dropped by the engine core) is ignored."""
        for req_id, token in zip(req_ids, token_ids.tolist()):
            matcher = self.matchers.get(req_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token):
                logger.error("request %r sampled token %d outside its grammar; it goes on "
                             "unconstrained", req_id, token)
                self.matchers.pop(req_id)


def _load_tokenizer(path: str):
    """The folder's fast tokenizer. From its tokenizer.json directly when there is one:
    AutoTokenizer's first call imports transformers' model registry, 2.5-5 s per worker
    process on a busy 2-core machine against 0.05 s (the vocabulary, which is all xgrammar
    reads, is the same)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
