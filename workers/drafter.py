"""Speculative decoding with a draft model (`"method": "draft_model"`): a smaller model with
the target's vocabulary, held by every worker beside the target, makes each step's drafts.

The engine core plans as for any proposer, but the plan carries only how many drafts each
request verifies (`CachedRequestData.num_model_drafts`); the scheduler already gave those
requests KV slots for their 1 + k positions. Before the target's forward, `Drafter.draft`:

1. runs the draft model over the step's known rows: every prefill chunk and decode token of
   every request, so the draft's KV cache keeps up with the target's (one forward);
2. for a request with k drafts, whose last known token sits at position L: the argmax of
   the draft's logits at L is d1; then k - 1 forwards of one row per request (d_j at
   position L + j) give d2 .. dk;
3. writes the drafts after the request's known tokens in the persistent batch, where
   `spec_token_ids` would have put them, so the target verifies them unchanged
   (`Sampler.verify`). Greedy drafts are deterministic (q one-hot), which keeps the
   rejection sampler of sampled requests exact.

The draft's KV cache has the target's block count and block size and is indexed by the SAME
block tables and slot mapping: the engine core's block pool, prefix cache and preemption need
nothing new. Its bytes per block count in the KV memory sizing (`kv_block_bytes`).

Invariant (what each row's draft KV holds): `valid[row]` is the end of the positions the
draft has written for that row; positions below min(valid, num_computed) hold the KV of the
request's real tokens. Drafting writes positions L+1 .. L+k-1 with guesses: those the target
accepts are its real tokens, the rejected ones are past the new num_computed, so the next
step's draft rows start at min(num_computed, valid) and overwrite them before anything reads
them. When every draft is accepted, dk (position L+k) was never run through the draft; the
next step's rows then start at valid = L + k and compute it (one row more, no extra forward).
A prefix-cached block is assumed computed by the draft too (every position the target
computed was computed by the draft in the same or the next step); the one exception, a
request that ends right after a step that accepted all its drafts, leaves one stale draft
position in a block another request may reuse: only that request's drafts can suffer, never
its output (the target verifies every draft).

Tensor parallelism: the draft is sharded like the target (same TP group), so every rank
computes the same logits after the all-reduces and all-gather and takes the same argmax.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import AttentionInputs, AttentionMetadata, kv_block_bytes
from .persistent_batch import PersistentBatch


class Drafter:
    """The draft model, its KV cache and where each row's draft KV ends."""

    def __init__(self, model, args, backend, block_size: int, num_kv_heads: int,
                 max_num_seqs: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.args, self.backend = model, args, backend
        self.block_size, self.num_kv_heads = block_size, num_kv_heads
        self.head_dim = args.head_dim
        self.device, self.dtype = device, dtype
        self.kv_caches: list = []
        self.valid = np.zeros(max_num_seqs, np.int64)
        """Per persistent-batch row: the end of the positions the draft has written (see the
        module docstring's invariant)."""

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one KV block of the draft takes on this rank (K and V, every layer)."""
        return kv_block_bytes(self.backend, self.model.num_layers, self.block_size,
                              self.num_kv_heads, self.head_dim, self.dtype)

    def init_kv_cache(self, allocate, num_blocks: int) -> list:
        """Allocate the draft's cache with the target's `allocate(num_blocks, num_layers,
        num_kv_heads, head_dim)`; returns its tensors (for the CPU's page commit)."""
        self.kv_caches = allocate(num_blocks, self.model.num_layers, self.num_kv_heads,
                                  self.head_dim)
        return [t for layer in self.kv_caches for t in layer]

    @torch.inference_mode()
    def draft(self, batch: PersistentBatch, rows: np.ndarray, num_scheduled: np.ndarray,
              is_new: np.ndarray) -> None:
        """Keep the draft KV up with this step's known rows and write each drafting row's
        `batch.num_model_drafts[row]` drafts into the batch (`PersistentBatch.set_drafts`).
        `is_new`: rows that joined with this plan (their draft KV starts at num_computed)."""
        k = batch.num_model_drafts[rows]
        computed = batch.num_computed[rows]
        end = computed + num_scheduled - k  # the known rows end here
        self.valid[rows[is_new]] = computed[is_new]
        start = np.minimum(computed, self.valid[rows])
        counts = end - start
        drafting = np.nonzero(k > 0)[0]
        hidden = self._forward(batch, rows, start, counts)
        if not len(drafting):
            self.valid[rows] = end
            return
        last = np.cumsum(counts)[drafting] - 1
        tokens = self._argmax(hidden[self._dev(last)])
        out = [tokens]
        kd = k[drafting]
        for j in range(1, int(kd.max())):
            active = kd > j
            prev = out[-1][active]
            who = drafting[active]
            positions = end[who] - 1 + j
            hidden = self._forward(batch, rows[who], positions, np.ones(len(who), np.int64),
                                   token_ids=prev)
            step = np.zeros(len(drafting), np.int64)
            step[active] = self._argmax(hidden)
            out.append(step)
        drafts = np.stack(out, axis=1)  # [drafting, max k]
        for i, row_index in enumerate(drafting):
            batch.set_drafts(int(rows[row_index]), drafts[i, :kd[i]].astype(np.int32))
        self.valid[rows] = end
        self.valid[rows[drafting]] = end[drafting] - 1 + kd

    def _argmax(self, hidden: torch.Tensor) -> np.ndarray:
        return self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy().astype(np.int64)

    def _forward(self, batch: PersistentBatch, rows: np.ndarray, start: np.ndarray,
                 counts: np.ndarray, token_ids: np.ndarray | None = None) -> torch.Tensor:
        """The draft's hidden states for `counts[i]` positions from `start[i]` of each row
        (tokens from the batch, or `token_ids`, one per row), its KV written on the way."""
        bs = self.block_size
        qsl = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        offsets = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], counts)
        positions = np.repeat(start, counts) + offsets
        token_rows = np.repeat(rows, counts)
        if token_ids is None:
            token_ids = batch.token_ids[token_rows, positions]
        slots = (batch.block_table[token_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        seq_lens = start + counts
        width = max(1, int((seq_lens.max() + bs - 1) // bs))
        meta = AttentionMetadata(
            slot_mapping=self._dev(slots),
            block_tables=self._dev(np.ascontiguousarray(batch.block_table[rows, :width]),
                                   torch.int32),
            query_start_loc=self._dev(qsl, torch.int32),
            seq_lens=self._dev(seq_lens, torch.int32))
        plan = self.backend.prepare(meta, bs, self.num_kv_heads, self.head_dim, self.dtype)
        return self.model(self._dev(token_ids), self._dev(positions), self.kv_caches,
                          AttentionInputs(meta, plan), None)

    def _dev(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype).to(self.device)
