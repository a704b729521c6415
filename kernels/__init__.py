"""Attention kernels: a plain-torch reference (the specification), the CPU backend (`torch`:
vectorised torch ops, with decode rows in a numba-compiled kernel, `numba_attention.py`) and
Triton kernels (CUDA), all of which must equal the reference.
`select_attention_ops` picks a backend by name.

Every backend exposes the same two functions (see `kernels/reference.py` for the layouts):

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


BACKENDS = ("auto", "torch", "triton", "reference")


def select_attention_ops(backend: str, device_type: str) -> AttentionOps:
    """`auto` takes Triton on CUDA and the vectorised torch backend elsewhere; `reference`
    is the plain per-request specification (slow; for tests)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "torch"
    if backend == "torch":
        from tidal.kernels.torch_attention import paged_attention_torch, write_kv_torch

        return AttentionOps("torch", write_kv_torch, paged_attention_torch)
    if backend == "reference":
        from tidal.kernels.reference import paged_attention_ref, write_kv_ref

        return AttentionOps("reference", write_kv_ref, paged_attention_ref)
    from tidal.kernels.triton_attention import paged_attention_triton, write_kv_triton

    return AttentionOps("triton", write_kv_triton, paged_attention_triton)
