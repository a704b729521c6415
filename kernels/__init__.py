"""Attention kernels: a plain-torch reference (the CPU path and the specification) and Triton
kernels that must equal it. `select_attention_ops` picks a backend by name.

Both backends expose the same two functions (see `kernels/reference.py` for the layouts):

    write_kv(key, value, key_cache, value_cache, slot_mapping) -> None
    paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale, out=None) -> Tensor
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class AttentionOps(NamedTuple):
    name: str
    write_kv: Callable
    paged_attention: Callable


BACKENDS = ("auto", "torch", "triton")


def select_attention_ops(backend: str, device_type: str) -> AttentionOps:
    """`auto` takes Triton on CUDA and the torch reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "torch"
    if backend == "torch":
        from tidal.kernels.reference import paged_attention_ref, write_kv_ref

        return AttentionOps("torch", write_kv_ref, paged_attention_ref)
    from tidal.kernels.triton_attention import paged_attention_triton, write_kv_triton

    return AttentionOps("triton", write_kv_triton, paged_attention_triton)
