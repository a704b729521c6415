"""CUDA graphs for decode steps (CUDA only; the CPU path never constructs this).

At start-up, after the KV cache exists, the model's forward is captured once per batch size
of a ladder (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... up to max_num_seqs), largest first,
sharing one memory pool. A decode-only step with n requests replays the smallest captured
size b >= n: its inputs are copied into static buffers, rows n..b-1 are padding

    input_ids 0 · position 0 · slot -1 (no KV write) · seq_len 1 over block 0 (the null block)

and the first n rows of the static output are the hidden states. Capture needs kernels that
never sync with the host and need no per-step plan (a plan would describe the capture's
metadata values, not the ones each replay copies in), so graphs are only used with a
backend whose `can_capture_cuda_graphs` is set (Triton's), and the captured forwards get
`AttentionInputs.plan` None. Any failure during capture is logged and the runner stays eager.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from .attention import AttentionInputs, AttentionMetadata

if TYPE_CHECKING:
    from .model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: the ladder up to max_num_seqs (which is always included)."""
    sizes = [b for b in _LADDER if b < max_num_seqs] + [min(max_num_seqs, _LADDER[-1])]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode forwards and the static buffers they read and write."""

    def __init__(self, runner: "ModelRunner", sizes: list[int]):
        self.runner, self.sizes = runner, sizes
        self.max_size = sizes[-1]
        dev, n = runner.device, self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, runner.max_blocks_per_req, dtype=torch.int32,
                                        device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def try_capture(cls, runner: "ModelRunner", max_num_seqs: int) -> "DecodeGraphs | None":
        """Capture the ladder; None (eager decode) when the backend cannot be captured or
        capture fails. Logs the time spent."""
        backend = runner.attention_backend
        if not backend.can_capture_cuda_graphs:
            logger.info("CUDA graphs off: attention backend %r cannot be captured (it syncs "
                        "with the host or needs a per-step plan)", backend.name)
            return None
        graphs = cls(runner, batch_size_ladder(max_num_seqs))
        start = time.perf_counter()
        try:
            graphs.capture()
        except Exception:  # NOTE: a capture failure must not take the worker down
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s",
                    len(graphs.sizes), graphs.sizes, time.perf_counter() - start)
        return graphs

    def _meta(self, size: int) -> AttentionMetadata:
        """The first `size` rows of the static buffers, as the captured forward reads them."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size of the ladder, largest first, into one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            graph, out = self._capture_one(size, pool)
            pool = graph.pool()
            self.graphs[size] = (graph, out)

    def _capture_one(self, size: int, pool):
        """(graph, static output) of the forward over the first `size` static rows."""
        model, kv_caches = self.runner.model, self.runner.kv_caches
        # NOTE: the static buffers are rewritten in place before every replay, so nothing
        # derived from their values may be kept across uses: no plan (the backend needs none)
        attn_inputs = AttentionInputs(self._meta(size), plan=None)
        args = (self.input_ids[:size], self.positions[:size], kv_caches, attn_inputs)
        model(*args)  # warm-up: compiles kernels, allocates outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = model(*args)
        torch.cuda.synchronize()
        return graph, out

    def can_run(self, inputs: "StepInputs") -> bool:
        num_reqs = inputs.attention.meta.seq_lens.shape[0]
        return inputs.decode_only and num_reqs <= self.max_size

    def run(self, inputs: "StepInputs") -> torch.Tensor:
        """Replay the graph for this decode batch; returns hidden states [n, hidden]."""
        n = inputs.num_tokens
        size = next(b for b in self.sizes if b >= n)
        meta = inputs.attention.meta
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if size > n:  # padding rows: attend to one position of the null block, write nothing
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.block_tables[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
