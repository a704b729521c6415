"""Process groups: tensor parallelism inside a pipeline stage, point-to-point between stages.

Workers are numbered stage-major: global rank g = stage * tp + tp_rank, so one stage's TP
ranks are consecutive and TP rank r of stage s talks to TP rank r of stages s - 1 and s + 1.

    stage 0: ranks 0 .. tp-1  ──send hidden──►  stage 1: ranks tp .. 2tp-1  ──► ...

A `TensorParallel` value (rank, size, group) is handed to every sharded layer at
construction; layers call its `all_reduce` / `all_gather`, which are no-ops at size 1. With
one stage the group is the default (world) group; with several, each stage's ranks form a
group of their own. A `PipelineParallel` value says which stage this is and moves hidden
states to the next stage (`send`) and from the previous one (`recv`). One `torch.distributed`
world holds every worker: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    """Rank of this process, 0..size-1."""
    size: int = 1
    """Number of ranks the weights are split over."""
    group: object = None
    """This stage's process group; None: the default group (a single stage)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape on each rank) along `dim`, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def split(self, total: int, what: str) -> int:
        """`total // size`, or a ValueError naming `what` when it does not divide evenly."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


@dataclass(frozen=True)
class PipelineParallel:
    """This process's pipeline stage and its neighbours' global ranks."""

    stage: int = 0
    """0 .. size-1; stage 0 embeds the tokens, the last stage normalizes and samples."""
    size: int = 1
    """Number of stages."""
    prev_rank: int = -1
    """Global rank this stage receives hidden states from (-1 on the first stage)."""
    next_rank: int = -1
    """Global rank this stage sends hidden states to (-1 on the last stage)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's contiguous run of decoder layers: stage s of P takes layers
        [s·L/P, (s+1)·L/P), so the sizes differ by at most one."""
        if num_layers < self.size:
            raise ValueError(f"pipeline_parallel_size={self.size} is larger than the model's "
                             f"num_hidden_layers={num_layers}: every stage needs a layer")
        return range(self.stage * num_layers // self.size,
                     (self.stage + 1) * num_layers // self.size)

    def send(self, hidden: torch.Tensor) -> None:
        """Hand this stage's output [num_tokens, hidden] to the next stage (blocking)."""
        dist.send(hidden.contiguous(), self.next_rank)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """The previous stage's output for this step."""
        hidden = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(hidden, self.prev_rank)
        return hidden


def init_distributed(rank: int, size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0, stage: int = 0,
                     num_stages: int = 1) -> tuple[TensorParallel, PipelineParallel]:
    """Join the world of every worker (gloo on CPU, NCCL on CUDA) and this stage's
    tensor-parallel group; a single process needs nothing. `rank`/`size`: tensor-parallel
    rank and size within the stage."""
    world = size * num_stages
    if world == 1:
        return TensorParallel(0, 1), PipelineParallel()
    if not init_method:
        raise ValueError("dist_init_method is required with more than one worker "
                         "(e.g. tcp://127.0.0.1:29500)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    global_rank = stage * size + rank
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=init_method, rank=global_rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s),
                                **kwargs)
    group = None
    if num_stages > 1:
        # every process creates every stage's group, in the same order (torch's rule)
        groups = [dist.new_group(list(range(s * size, (s + 1) * size)))
                  for s in range(num_stages)]
        group = groups[stage]
    pp = PipelineParallel(stage, num_stages,
                          global_rank - size if stage > 0 else -1,
                          global_rank + size if stage < num_stages - 1 else -1)
    logger.info("worker %d/%d (stage %d of %d, tensor-parallel rank %d of %d) joined (%s, %s)",
                global_rank, world, stage, num_stages, rank, size, backend, init_method)
    return TensorParallel(rank, size, group), pp


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
