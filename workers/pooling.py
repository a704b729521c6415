"""The worker's side of embeddings (`--runner pooling`, `ipc/pooling.py`): the model built
without its LM head, and each pooling request's prompt pooled into one vector.

A pooling request is a prefill only. Its chunks come step after step (chunked prefill); the
step that computes its last prompt token pools it, and nothing is sampled:

    LAST  the final hidden state of the last prompt token (that step's last row of it)
    CLS   the first prompt token's, kept from the step that computed position 0
    MEAN  a float32 running sum over every chunk's rows, divided by the prompt length at the
          end: the engine core never lets a MEAN or CLS request read the prefix cache
          (`Request.skips_prefix_cache`), so every position's hidden state passes here once;
          a preemption drops the partial sum with the request, which restarts from 0

then the first `dimensions` numbers (Matryoshka) and the L2 normalisation, in float32.
Hidden states are the model's final ones (its final norm applied), as transformers'
`last_hidden_state` and vLLM's poolers take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ipc.pooling import PooledOutput, PoolingParams

_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")
"""Tensor names of a checkpoint saved from the bare decoder (transformers' Qwen3Model, as
Qwen3-Embedding's are): the same tensors as a *ForCausalLM's without `model.`."""


def embedding_config(hf_config: dict) -> dict:
    """config.json as the model registry reads it: an architecture named for the bare
    decoder (`Qwen3Model`, `LlamaModel`) is its `*ForCausalLM`, whose decoder tidal builds
    (without the LM head, `drop_lm_head`)."""
    names = hf_config.get("architectures") or []
    mapped = [n[:-len("Model")] + "ForCausalLM"
              if n.endswith("Model") and not n.endswith(("LMHeadModel", "ChatModel")) else n
              for n in names]
    return {**hf_config, "architectures": mapped}


def drop_lm_head(model: torch.nn.Module) -> None:
    """No LM head: an embedding model's checkpoint has none, and no logits are computed."""
    if hasattr(model, "lm_head"):
        del model.lm_head


def embedding_checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's name as the decoder takes it: `model.` added to a bare
    decoder's names; None for an LM head's, which an embedding model does not use."""
    if name.startswith(_BARE_PREFIXES):
        name = "model." + name
    return None if name.startswith("lm_head.") else name


@dataclass
class _Segment:
    """One pooling request's rows in a step."""

    req_id: str
    lo: int  # its first row among the step's hidden states
    hi: int  # one past its last
    starts_prompt: bool  # the rows begin at position 0
    ends_prompt: bool  # they reach its last prompt token: pool now
    prompt_len: int
    params: PoolingParams


class PoolingRequests:
    """The pooling requests a worker holds: their params and partial vectors (CLS's first
    row, MEAN's running sum) between the steps of a chunked prompt."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.params: dict[str, PoolingParams] = {}
        self.partial: dict[str, torch.Tensor] = {}

    def add(self, req_id: str, params: PoolingParams | None) -> None:
        """A request joins (ValueError naming `pooling` when it cannot be pooled here)."""
        if params is None or params.pooling_type is None or params.normalize is None:
            raise ValueError("pooling: this worker runs an embedding model; a request must "
                             "carry resolved pooling params")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"pooling.dimensions must be at most {self.hidden_size}, got "
                             f"{params.dimensions}")
        self.params[req_id] = params
        self.partial.pop(req_id, None)

    def remove(self, req_id: str) -> None:
        """A finished or preempted request: its partial vector goes too."""
        self.params.pop(req_id, None)
        self.partial.pop(req_id, None)

    def plan(self, req_ids: list[str], start: np.ndarray, seq_lens: np.ndarray,
             prompt_lens: np.ndarray, query_start_loc: np.ndarray) -> list[_Segment]:
        """Each request's rows of this step (every request of a pooling worker pools)."""
        return [_Segment(req_id, int(query_start_loc[i]), int(query_start_loc[i + 1]),
                         bool(start[i] == 0), bool(seq_lens[i] >= prompt_lens[i]),
                         int(prompt_lens[i]), self.params[req_id])
                for i, req_id in enumerate(req_ids)]

    def pool(self, hidden: torch.Tensor, segments: list[_Segment]) -> list[PooledOutput]:
        """The vectors of the requests whose prompt this step finished; partial vectors of
        the others kept."""
        out = []
        for seg in segments:
            vector = self._step(hidden, seg)
            if vector is None:
                continue
            params = seg.params
            if params.dimensions is not None:
                vector = vector[:params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
            data = vector.cpu().numpy().astype("<f4").tobytes()
            out.append(PooledOutput(seg.req_id, data))
        return out

    def _step(self, hidden: torch.Tensor, seg: _Segment) -> torch.Tensor | None:
        """The request's float32 vector when its prompt ends here, else None (its partial
        vector updated)."""
        kind = seg.params.pooling_type
        if kind == "LAST":
            return hidden[seg.hi - 1].float() if seg.ends_prompt else None
        if kind == "CLS":
            if seg.starts_prompt:  # a copy: CUDA graphs hand out a buffer they reuse
                self.partial[seg.req_id] = hidden[seg.lo].float().clone()
            return self.partial.pop(seg.req_id) if seg.ends_prompt else None
        total = hidden[seg.lo:seg.hi].float().sum(dim=0)
        if not seg.starts_prompt:
            total = total + self.partial.pop(seg.req_id)
        if not seg.ends_prompt:
            self.partial[seg.req_id] = total
            return None
        return total / seg.prompt_len
