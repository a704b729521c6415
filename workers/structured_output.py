"""Grammar matchers of the requests in a worker's batch that carry `structured_outputs`.

Where each part happens, and why:

- The frontend compiles every constraint once before sending it (it has the tokenizer), so a
  schema / regex / grammar that does not compile is a ValueError or an HTTP 400 naming the
  field, and never reaches the engine. The engine core only checks the shape
  (`StructuredOutputsParams.__post_init__`): it never imports xgrammar (xgrammar imports torch).
- Each worker rank compiles the constraint again when the request joins its batch: a compiled
  grammar holds per-token mask caches of megabytes, too big for the wire, and xgrammar's
  compiler cache makes a repeated constraint (the common case) free. One that fails here
  anyway (a core reached by a frontend that did not check) is refused for that request alone
  (`BadRequestData`).
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

import logging
import os

import numpy as np
import torch

from ..ipc.messages import StructuredOutputsParams
from .persistent_batch import BadRequestData

logger = logging.getLogger(__name__)


class GrammarError(BadRequestData):
    """A request's constraint cannot be compiled or replayed (the message names the field)."""


class StructuredOutputs:
    """req_id -> xgrammar matcher, for the requests of the batch that are constrained.

    The tokenizer and compiler are loaded on the first constrained request, so a worker that
    never sees one never imports xgrammar.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (the logits' width), >= the tokenizer's
        self._compiler = None
        self.matchers: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.matchers)

    def compiler(self):
        if self._compiler is None:
            import xgrammar

            tokenizer = _load_tokenizer(self.tokenizer_path)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def add(self, req_id: str, spec: StructuredOutputsParams, stop_ids: np.ndarray,
            generated: np.ndarray) -> None:
        """A matcher for a request joining the batch, replayed over the tokens it already
        generated. GrammarError when the constraint does not compile or the tokens do not
        follow it."""
        import xgrammar

        self.matchers.pop(req_id, None)
        try:
            compiled = spec.compile_with(self.compiler())
        except ValueError as e:
            raise GrammarError(f"{e} (request {req_id!r})") from None
        matcher = xgrammar.GrammarMatcher(compiled,
                                          override_stop_tokens=[int(t) for t in stop_ids])
        for i, token in enumerate(generated.tolist()):
            if not matcher.accept_token(token):
                raise GrammarError(f"structured_outputs of request {req_id!r}: its token "
                                   f"{i} ({token}) does not follow the {spec.kind} grammar")
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
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
