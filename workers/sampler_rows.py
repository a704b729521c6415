"""The sampler's side of the persistent batch: the rows that sample this step as a
`SamplingBatch` (sampling parameters, penalties' token histories, min_tokens masks, grammar
bitmasks), and the sampler's logprobs packed per row for the wire (`TokenLogprobs`).

Row i of a `SamplingBatch` is `rows[i]` of the persistent batch; its tensors are gathered on
the host with numpy and moved with `to_device` (the grammar bitmasks come from
`structured_output.py`), and the host-side flags say which sampler paths the step needs, so
the sampler never waits on the device to decide.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ipc.messages import TokenLogprobs, pack_token_ids
from .persistent_batch import PersistentBatch
from .sampler import SamplerOutput, SamplingBatch
from .structured_output import StructuredOutputs


def to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array as a `dtype` tensor on `device` (through pinned memory, without waiting,
    on CUDA; the CPU's is a view where the dtype already matches)."""
    tensor = torch.from_numpy(np.asarray(array)).to(dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class SamplerRows:
    """Builds the sampler's inputs from persistent-batch rows and packs its logprobs back."""

    def __init__(self, batch: PersistentBatch, structured: StructuredOutputs, vocab_size: int,
                 device: torch.device):
        self.batch = batch
        self.structured = structured  # grammar matchers: their bitmasks join the batch
        self.vocab_size = vocab_size  # stop ids at or past it are never masked
        self.device = device

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(array, dtype, self.device)

    def sampling_batch(self, rows: np.ndarray,
                       req_ids: list[str] | None = None) -> SamplingBatch:
        """Per-row sampling tensors for the rows that sample this step (`req_ids`, theirs,
        for the grammar masks of constrained requests)."""
        b, dev = self.batch, self._to_device
        out_lens = b.num_tokens[rows] - b.prompt_len[rows]
        batch = SamplingBatch(
            temperature=dev(b.temperature[rows], torch.float32),
            top_k=dev(b.top_k[rows], torch.int64),
            top_p=dev(b.top_p[rows], torch.float32),
            min_p=dev(b.min_p[rows], torch.float32),
            seeds=dev(b.seed[rows], torch.int64),
            seeded=dev(b.seeded[rows], torch.bool),
            positions=dev(b.num_tokens[rows], torch.int64),
            host_flags=dict(
                all_greedy=bool((b.temperature[rows] == 0).all()),
                min_p=bool((b.min_p[rows] > 0).any()),
                top_k_top_p=bool((b.top_k[rows] > 0).any() or (b.top_p[rows] < 1).any()),
                seeded=bool(b.seeded[rows].any())),
        )
        if _any_penalty(b, rows):
            batch.presence_penalty = dev(b.presence_penalty[rows], torch.float32)
            batch.frequency_penalty = dev(b.frequency_penalty[rows], torch.float32)
            batch.repetition_penalty = dev(b.repetition_penalty[rows], torch.float32)
            # a resubmitted request's resumed prompt tail counts as output, as it did on
            # the core that generated it
            starts = b.output_start[rows]
            batch.output_token_ids = dev(
                _gather_tokens(b, rows, starts, b.num_tokens[rows] - starts), torch.int64)
            batch.prompt_token_ids = dev(_gather_tokens(b, rows, np.zeros_like(rows), starts),
                                         torch.int64)
        self._add_min_tokens(batch, rows, out_lens)
        if req_ids is not None and len(self.structured):
            masks = self.structured.bitmask(req_ids)
            if masks is not None:
                batch.grammar_bitmask, batch.grammar_rows = masks
        wanted = b.num_logprobs[rows]
        if (wanted >= 0).any():
            batch.num_logprobs = int(wanted.max())
        return batch

    def _add_min_tokens(self, batch: SamplingBatch, rows: np.ndarray,
                        out_lens: np.ndarray) -> None:
        """Mask the stop tokens (EOS and stop_token_ids) of the rows still under their
        min_tokens (`out_lens`: tokens each has generated)."""
        active = np.nonzero(out_lens < self.batch.min_tokens[rows])[0]
        pairs = [(i, self.batch.stop_ids[rows[i]]) for i in active]  # only rows under min
        pairs = [(i, ids) for i, ids in pairs if len(ids)]
        if not pairs:
            return
        row_idx = np.concatenate([np.full(len(ids), i) for i, ids in pairs])
        tok_idx = np.concatenate([ids for _, ids in pairs])
        keep = tok_idx < self.vocab_size
        batch.min_tokens_rows = self._to_device(row_idx[keep], torch.int64)
        batch.min_tokens_ids = self._to_device(tok_idx[keep], torch.int64)

    def pack_logprobs(self, out: SamplerOutput,
                      rows: np.ndarray) -> list[TokenLogprobs | None] | None:
        """The sampler's logprobs for `rows` (its output rows, in order) as the wire's
        `TokenLogprobs`, each cut to the top k its request asked for: None for a row that
        asked for none, None for all when no row did."""
        if out.logprobs is None:
            return None
        ids = out.logprob_token_ids.cpu().numpy()
        lps = out.logprobs.to(torch.float32).cpu().numpy()
        ranks = out.sampled_ranks.cpu().numpy()
        result: list[TokenLogprobs | None] = []
        for i, k in enumerate(self.batch.num_logprobs[rows]):
            if k < 0:
                result.append(None)
                continue
            result.append(TokenLogprobs(token_ids=pack_token_ids(ids[i, :k + 1]),
                                        logprobs=lps[i, :k + 1].astype("<f4").tobytes(),
                                        sampled_rank=int(ranks[i])))
        return result


def _any_penalty(b: PersistentBatch, rows: np.ndarray) -> bool:
    return bool((b.presence_penalty[rows] != 0).any() or (b.frequency_penalty[rows] != 0).any()
                or (b.repetition_penalty[rows] != 1).any())


def _gather_tokens(b: PersistentBatch, rows: np.ndarray, starts: np.ndarray,
                   lens: np.ndarray) -> np.ndarray:
    """[N, max(lens)] token ids token_ids[row, start:start+len], padded with -1."""
    width = max(1, int(lens.max()) if len(lens) else 1)
    offsets = np.arange(width)
    index = np.minimum(starts[:, None] + offsets[None, :], b.max_model_len - 1)
    tokens = b.token_ids[rows[:, None], index]
    return np.where(offsets[None, :] < lens[:, None], tokens, -1)


def dummy_sampling(num_rows: int, device: torch.device) -> SamplingBatch:
    """Random sampling with top-k and top-p: the sampler's most memory-hungry path."""
    full = lambda value, dtype: torch.full((num_rows,), value, dtype=dtype, device=device)
    return SamplingBatch(
        temperature=full(1.0, torch.float32), top_k=full(50, torch.int64),
        top_p=full(0.9, torch.float32), min_p=full(0.0, torch.float32),
        seeds=full(0, torch.int64), seeded=full(False, torch.bool),
        positions=full(0, torch.int64), num_logprobs=5)
