"""The worker's persistent batch: every request it holds, one row each, in numpy arrays.

A plan carries full data only for requests the worker has not seen (`NewRequestData`) and
deltas for the rest (`CachedRequestData`), so the state lives here between steps:

    row r:  token_ids[r, :num_tokens[r]]        prompt, then every token sampled so far
            block_table[r, :num_blocks[r]]      the request's KV blocks (append-only)
            num_computed[r]                     tokens already in the KV cache
            temperature[r], top_k[r], ...       sampling parameters
            num_prompt_logprobs[r]              top alternatives per prompt position, -1 off
            token_ids[r, num_tokens[r]:num_tokens[r] + num_spec[r]]
                                                this step's draft tokens (speculative
                                                decoding), never counted in num_tokens

The worker appends each token it samples to its row itself (`append_sampled`), so with async
scheduling the "placeholder" the engine core schedules is simply that token.

A new request whose own data the worker cannot run (a token id outside the vocabulary, say)
is refused with `BadRequestData` before it takes a row: the engine core checks the same
first, so this only guards against a core that let one through.
"""

from __future__ import annotations

import numpy as np

from ..ipc.messages import INT32_MAX, unpack_token_ids
from ..ipc.worker_messages import CachedRequestData, NewRequestData


class BadRequestData(ValueError):
    """A request's own data is unusable (the message names the field): that request fails
    alone, the worker goes on."""


class PersistentBatch:
    """Rows of request state; rows are reused after a request leaves."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int):
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.vocab_size = vocab_size
        self.req_id_to_row: dict[str, int] = {}  # req_id -> row
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives the lowest
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.output_start = np.zeros(max_num_reqs, dtype=np.int64)
        """Where the tokens that penalties count as output begin: prompt_len, less the
        prompt's resumed tokens (NewRequestData.num_resumed_tokens)."""
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # 0: the base model
        self.num_spec = np.zeros(max_num_reqs, dtype=np.int64)  # drafts this step
        self.num_model_drafts = np.zeros(max_num_reqs, dtype=np.int64)
        """Drafts the draft model must make for the row this step (`workers/drafter.py`);
        num_spec becomes this once they are written."""
        self._init_sampling_arrays(max_num_reqs)

    def _init_sampling_arrays(self, n: int) -> None:
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.seed = np.zeros(n, dtype=np.int64)
        self.seeded = np.zeros(n, dtype=bool)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # -1: no logprobs wanted
        self.num_prompt_logprobs = np.full(n, -1, dtype=np.int64)  # -1: none wanted
        self.stop_ids: list[np.ndarray] = [np.zeros(0, np.int64)] * n  # EOS + stop_token_ids

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def remove(self, req_id: str) -> None:
        """Drop a finished or preempted request (unknown ids are ignored)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def add(self, req: NewRequestData) -> int:
        """Take a row for a request the worker has not seen (or resumed after preemption).
        BadRequestData, before any row is taken, when the request's data is unusable."""
        self.remove(req.req_id)
        tokens = np.frombuffer(unpack_token_ids(req.token_ids), dtype=np.int32)
        _check_request_data(req, tokens, self.vocab_size)
        _check_new(req, len(tokens), self.max_model_len, self.max_blocks_per_req)
        if not self.free_rows:
            raise ValueError(f"more than max_num_seqs={self.max_num_reqs} requests in the "
                             f"worker's batch (adding {req.req_id!r})")
        row = self.free_rows.pop()
        self.req_id_to_row[req.req_id] = row
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.prompt_len[row] = req.prompt_len
        self.output_start[row] = req.prompt_len - req.num_resumed_tokens
        self.num_computed[row] = req.num_computed_tokens
        self.num_spec[row] = 0
        self.num_model_drafts[row] = 0
        self.lora_id[row] = req.lora_int_id
        self.num_blocks[row] = 0
        self._append_blocks(row, req.block_ids, req.req_id)
        self._set_sampling(row, req)
        return row

    def update(self, req: CachedRequestData) -> int:
        """Apply a delta to a request already held."""
        row = self.req_id_to_row.get(req.req_id)
        if row is None:
            raise ValueError(f"cached request {req.req_id!r} is not in the worker's batch")
        self.num_computed[row] = req.num_computed_tokens
        self._append_blocks(row, req.new_block_ids, req.req_id)
        if req.new_token_ids:  # pipeline parallelism: tokens the last stage sampled
            self._append_tokens(row, np.frombuffer(unpack_token_ids(req.new_token_ids),
                                                   dtype=np.int32), req.req_id)
        self.num_spec[row] = 0
        if req.spec_token_ids:
            self.set_drafts(row, np.frombuffer(unpack_token_ids(req.spec_token_ids),
                                               dtype=np.int32))
        self.num_model_drafts[row] = 0
        if req.num_model_drafts:
            k = req.num_model_drafts
            if k < 0 or req.spec_token_ids or k >= req.num_scheduled_tokens or \
                    int(self.num_tokens[row]) + k > self.max_model_len:
                raise ValueError(f"request {req.req_id!r}: num_model_drafts={k} must be "
                                 f"positive, fewer than num_scheduled_tokens, within "
                                 f"max_model_len and without spec_token_ids")
            self.num_model_drafts[row] = k
        return row

    def set_drafts(self, row: int, drafts: np.ndarray) -> None:
        """Write this step's draft tokens after the row's known tokens (not counted in
        num_tokens: the verified ones are appended by `append_sampled`). They come in the
        plan (`update`) or from the draft model (`workers/drafter.py`)."""
        start = int(self.num_tokens[row])
        end = start + len(drafts)
        if end > self.max_model_len:
            raise ValueError(f"request {self._req_id(row)!r}: {len(drafts)} draft tokens "
                             f"after {start} would pass max_model_len ({self.max_model_len})")
        if len(drafts) and (int(drafts.min()) < 0 or int(drafts.max()) >= self.vocab_size):
            raise ValueError(f"request {self._req_id(row)!r}: draft token ids outside the "
                             "vocabulary")
        self.token_ids[row, start:end] = drafts
        self.num_spec[row] = len(drafts)

    def _req_id(self, row: int) -> str:
        """The id of the request in `row`, for error messages (a scan of the held rows)."""
        return next(req_id for req_id, r in self.req_id_to_row.items() if r == row)

    def _append_tokens(self, row: int, token_ids: np.ndarray, req_id: str) -> None:
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(f"request {req_id!r} would hold {end} tokens, more than "
                             f"max_model_len ({self.max_model_len})")
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def append_many(self, row: int, token_ids: np.ndarray) -> None:
        """Append a row's verified tokens (speculative decoding), up to max_model_len."""
        start = int(self.num_tokens[row])
        token_ids = token_ids[:max(0, self.max_model_len - start)]
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append each row's sampled token (rows already at max_model_len keep theirs)."""
        room = self.num_tokens[rows] < self.max_model_len
        rows, token_ids = rows[room], token_ids[room]
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def _append_blocks(self, row: int, block_ids: list[int], req_id: str) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"request {req_id!r} has {end} KV blocks, more than "
                             f"max_model_len / block_size allows ({self.max_blocks_per_req})")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _set_sampling(self, row: int, req: NewRequestData) -> None:
        sp = req.sampling
        self.temperature[row] = sp.temperature
        self.top_k[row] = max(sp.top_k, 0)
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.min_tokens[row] = sp.min_tokens
        self.seeded[row] = sp.seed is not None
        self.seed[row] = sp.seed if sp.seed is not None else 0
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        eos = getattr(req, "eos_token_id", None)
        stop = list(sp.stop_token_ids) + ([eos] if eos is not None else [])
        self.stop_ids[row] = np.asarray(stop, dtype=np.int64)


def _check_request_data(req: NewRequestData, tokens: np.ndarray, vocab_size: int) -> None:
    """BadRequestData for what the embedding, the stop-id arrays or the logprobs top-k could
    not take (the sampling ranges were checked when the plan decoded)."""
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise BadRequestData(f"token_ids of request {req.req_id!r} contain {bad}, outside the "
                             f"vocabulary [0, {vocab_size})")
    eos = req.eos_token_id
    if eos is not None and not 0 <= eos <= INT32_MAX:
        raise BadRequestData(f"eos_token_id of request {req.req_id!r} must be in "
                             f"[0, {INT32_MAX}], got {eos}")
    if any(not 0 <= t <= INT32_MAX for t in req.sampling.stop_token_ids):
        raise BadRequestData(f"stop_token_ids of request {req.req_id!r} must be in "
                             f"[0, {INT32_MAX}]")
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(req.sampling, field)
        if value is not None and value > vocab_size:
            raise BadRequestData(f"{field} of request {req.req_id!r} must be at most the "
                                 f"vocabulary size {vocab_size}, got {value}")


def _check_new(req: NewRequestData, num_tokens: int, max_model_len: int,
               max_blocks: int) -> None:
    if num_tokens > max_model_len:
        raise ValueError(f"request {req.req_id!r} has {num_tokens} tokens, more than "
                         f"max_model_len={max_model_len}")
    if not 0 <= req.num_resumed_tokens < max(req.prompt_len, 1):
        raise ValueError(f"request {req.req_id!r}: num_resumed_tokens="
                         f"{req.num_resumed_tokens} must be in [0, prompt_len={req.prompt_len})")
    if req.num_computed_tokens + req.num_scheduled_tokens > num_tokens:
        raise ValueError(f"request {req.req_id!r}: num_computed_tokens="
                         f"{req.num_computed_tokens} + num_scheduled_tokens="
                         f"{req.num_scheduled_tokens} exceeds its {num_tokens} tokens")
