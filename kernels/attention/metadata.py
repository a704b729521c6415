"""`AttentionMetadata`: the layout of one step's batch, as every attention backend reads it.

The model runner builds one per step and passes it, with the backend's per-step plan (see
`AttentionBackend.prepare`), explicitly down through the model's forward; nothing about the
batch is kept in module state. The exact conventions are in `kernels/attention/reference.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout: a pure description of the batch, nothing derived from it.

    Requests are packed in plan order; request i owns query rows
    [query_start_loc[i], query_start_loc[i+1]).
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) of each new token;
    -1 for a padding row (nothing written)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks_per_seq] int32: each request's block ids, padded with 0."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: prefix sums of the new-token counts."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: tokens in the cache per request, including this step's."""
