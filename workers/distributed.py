"""Tensor-parallel process group: set-up and the two collectives the model needs.

A `TensorParallel` value (rank, size) is handed to every sharded layer at construction; layers
call its `all_reduce` / `all_gather`, which are no-ops at size 1. There is one tensor-parallel
group per worker process (the default `torch.distributed` group), so nothing else is global.
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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape on each rank) along `dim`, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def split(self, total: int, what: str) -> int:
        """`total // size`, or a ValueError naming `what` when it does not divide evenly."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


def init_distributed(rank: int, size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0) -> TensorParallel:
    """Join the tensor-parallel group (gloo on CPU, NCCL on CUDA); size 1 needs nothing."""
    if size == 1:
        return TensorParallel(0, 1)
    if not init_method:
        raise ValueError("dist_init_method is required when tensor_parallel_size > 1 "
                         "(e.g. tcp://127.0.0.1:29500)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    logger.info("rank %d/%d joined the tensor-parallel group (%s, %s)",
                rank, size, backend, init_method)
    return TensorParallel(rank, size)


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
