"""Attention kernels behind one seam, `AttentionBackend`, picked by name with
`select_attention_backend`:

    reference  plain torch, one request at a time: the specification (`reference.py`)
    torch      vectorised torch ops, decodes gathered in chunks (`torch_attention.py`)
    numba      the torch backend's prefills, decodes in a compiled kernel that reads the
               paged cache in place (`numba_attention.py`; CPU, float32/float64; int8 caches)
    cpu        numba's, with float32 decodes in a C kernel that prefetches the paged rows
               (`cpu_attention.py`, `decode_attention.c`; AVX-512 or AVX2, and a C compiler)
    triton     Triton kernels, no host sync, CUDA-graph capturable (`triton_attention.py`)

All of them must equal the reference. A step drives a backend like this (the model runner):

    plan = backend.prepare(meta, block_size, num_kv_heads, head_dim, dtype)   # once a step
    for every layer:
        backend.write_kv(key, value, key_cache, value_cache, meta.slot_mapping, kv_scales)
        backend.attend(query, key_cache, value_cache, meta, plan, scale,
                       sliding_window=layer's window or None, soft_cap=layer's cap or None,
                       kv_scales=kv_scales)

`kv_scales` is None for a cache in the compute dtype; with `kv_cache_dtype` int8 or fp8 the
caches hold quantized rows and kv_scales their (key_scale, value_scale), one float per token
and KV head (`kv_quant.py`): `write_kv` quantizes, `attend` dequantizes as it reads.

Layouts of the tensors are in `kernels/attention/reference.py`; `meta` is an `AttentionMetadata`
(`kernels/attention/metadata.py`). Backend modules are imported only when selected, so CPU-only use
never imports triton, which only the `gpu` (and `test`) extra installs; asking for the triton
backend without it is a ValueError saying `pip install 'tidal[gpu]'`.
"""

from __future__ import annotations

import abc
from typing import Callable

import torch

from .kv_quant import SCALE_DTYPE, KVScales, storage_dtype
from .metadata import AttentionMetadata

BACKENDS = ("auto", "cpu", "numba", "torch", "triton", "reference")
"""Names `select_attention_backend` accepts (the engine config keeps the same tuple of
strings, `engine_core.config.ATTENTION_BACKENDS`, without importing torch)."""

NUMBA_DTYPES = (torch.float32, torch.float64)
"""Dtypes the numba decode kernel computes in (numba has no bfloat16 or float16 arrays)."""


class AttentionBackend(abc.ABC):
    """One way of writing K/V into the paged cache and attending over it.

    A backend object holds configuration only (no per-step state), so one instance serves
    every layer of every step. Whatever a backend derives from a step's metadata (index
    tensors, sorted request lists, work buffers) lives in the plan that `prepare` returns;
    the plan belongs to that one step and is handed, unchanged, to each layer's `attend`.
    """

    name: str = ""
    """The `attention_backend` name that selects this backend."""
    kv_dtype: torch.dtype | None = None
    """The quantized cache's storage dtype (int8, float8_e4m3fn; `kv_quant.py`), or None for
    caches in the compute dtype. Set by `select_attention_backend` from `kv_cache_dtype`."""
    can_capture_cuda_graphs: bool = False
    """Whether `write_kv` and `attend` launch without any host sync and with a plan of None,
    so that a forward through them can be captured in a CUDA graph and replayed on new
    metadata values (only Triton's can)."""

    def warm_up(self, dtype: torch.dtype) -> float:
        """Compile or load whatever the first step would otherwise wait for; the seconds it
        took (0 when there is nothing to do)."""
        return 0.0

    def kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's K (or V) cache, uninitialised: shape [num_blocks, block_size,
        num_kv_heads, head_dim], the shape every backend and the reference index, stored in
        whatever order this backend reads fastest (head_dim always the contiguous one). Here,
        as the shape says; `CpuBackend` keeps each KV head's rows of a block together. A
        quantized backend's (`kv_dtype`) holds that dtype instead of `dtype`."""
        return torch.empty(num_blocks, block_size, num_kv_heads, head_dim,
                           dtype=self.kv_dtype or dtype, device=device)

    def kv_scales(self, num_blocks: int, block_size: int, num_kv_heads: int,
                  device: torch.device) -> torch.Tensor | None:
        """One layer's K (or V) scales [num_blocks, block_size, num_kv_heads] float32 for a
        quantized cache (`kv_quant.py`), uninitialised; None for caches in the compute
        dtype."""
        if self.kv_dtype is None:
            return None
        return torch.empty(num_blocks, block_size, num_kv_heads, dtype=SCALE_DTYPE,
                           device=device)

    def kv_bytes_per_token_head(self, head_dim: int, dtype: torch.dtype) -> int:
        """Cache bytes one token's K (or V) row of one KV head takes: head_dim elements of the
        cache's dtype, plus its scale when quantized."""
        if self.kv_dtype is None:
            return head_dim * torch.empty(0, dtype=dtype).element_size()
        return head_dim * torch.empty(0, dtype=self.kv_dtype).element_size() + \
            torch.empty(0, dtype=SCALE_DTYPE).element_size()

    def prepare(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype) -> object | None:
        """The step's plan: what `attend` needs beyond the metadata, derived once per step
        (before the forward) and shared by every layer. `dtype` is the cache's and the
        queries' dtype. None when the backend needs nothing."""
        return None

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: KVScales | None = None) -> None:
        """Scatter each token's K and V into its cache slot in place (`write_kv_ref`),
        quantized with their scales when `kv_scales` is given."""

    @abc.abstractmethod
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, plan: object | None, scale: float,
               out: torch.Tensor | None = None, *, sliding_window: int | None = None,
               soft_cap: float | None = None,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        """Causal attention of each request's new tokens over its paged K/V, equal to
        `paged_attention_ref`; `plan` is what `prepare` returned for this `meta` (a plan
        serves layers of any window and cap: they are per layer, the plan per step). Rows of
        `out` that no request owns are left untouched.

        `sliding_window` W: the query at position p sees keys at p - W < j <= p only
        (transformers' convention), and cache blocks wholly before that are never read (the
        engine core may have given them to another request). `soft_cap` c: scores become
        c * tanh(score / c) before the mask and softmax (Gemma 2). `kv_scales`: the caches are
        quantized, each row read as q * its scale (`kv_quant.py`)."""


class FunctionBackend(AttentionBackend):
    """A backend that is a pair of plain functions with the reference's signatures
    (`write_kv_ref`, `paged_attention_ref`) and needs no per-step plan. Subclasses name them
    as `kv_writer` and `attention` (static methods)."""

    kv_writer: Callable
    attention: Callable

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping,
                 kv_scales=None) -> None:
        self.kv_writer(key, value, key_cache, value_cache, slot_mapping,
                       **_scales_given(kv_scales))

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, plan: None, scale: float,
               out: torch.Tensor | None = None, *, sliding_window: int | None = None,
               soft_cap: float | None = None,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        return self.attention(query, key_cache, value_cache, meta.block_tables,
                              meta.query_start_loc, meta.seq_lens, scale, out,
                              sliding_window=sliding_window, soft_cap=soft_cap,
                              **_scales_given(kv_scales))


def _scales_given(kv_scales: KVScales | None) -> dict:
    """`kv_scales` as a keyword argument when a quantized cache has them: a function that
    reads only caches in the compute dtype (Triton's) need not take it
    (`select_attention_backend` gives such a backend no quantized cache)."""
    return {} if kv_scales is None else {"kv_scales": kv_scales}


def check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    """ValueError naming the field when a layer's window or cap cannot be honoured."""
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {soft_cap!r}")


def select_attention_backend(name: str, device_type: str, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend called `name` for tensors of `dtype` on `device_type`, over a KV cache of
    `kv_cache_dtype` (auto: `dtype`; int8 or fp8: quantized, `kv_quant.py`).

    `auto` takes Triton on CUDA; on the CPU the cpu backend for float32 where its C kernel
    builds, else the numba backend when numba is installed and `dtype` is float32/float64,
    else the torch backend. A quantized cache: int8 on the CPU the numba kernel's decodes
    (the cpu backend hands them to it), fp8 and CUDA the torch backend (the C kernels, numba
    and Triton do not read fp8; Triton does not read int8 yet). A backend that cannot run
    these tensors, or an unknown name, is a ValueError naming `attention_backend` (or
    `kv_cache_dtype` when the cache's dtype is what it cannot read)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    kv_dtype = storage_dtype(kv_cache_dtype)
    if name == "auto":
        name = _auto_backend(device_type, dtype, kv_dtype)
    _check_kv_dtype(name, kv_cache_dtype, kv_dtype)
    backend = _backend(name, device_type, dtype)
    backend.kv_dtype = kv_dtype
    return backend


def _backend(name: str, device_type: str, dtype: torch.dtype) -> AttentionBackend:
    if name == "numba":
        _check_numba(device_type, dtype)
        from .numba_attention import NumbaBackend

        return NumbaBackend()
    if name == "cpu":
        _check_cpu(device_type, dtype)
        from .cpu_attention import CpuBackend

        return CpuBackend()
    if name == "torch":
        from .torch_attention import TorchBackend

        return TorchBackend()
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    return _triton_backend()


TRITON_MISSING = ("attention_backend 'triton' (the default on CUDA) needs the triton package, "
                  "which is not installed: pip install 'tidal[gpu]' (or pip install triton)")
"""The error for a GPU path without triton: a CPU install leaves it out (about 1 GB), so
nothing imports it before a Triton backend is asked for."""


def _triton_backend() -> AttentionBackend:
    try:
        from .triton_attention import TritonBackend
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "triton":
            raise
        raise ValueError(TRITON_MISSING) from None
    return TritonBackend()


QUANTIZED_READERS = {torch.int8: ("cpu", "numba", "torch", "reference"),
                     torch.float8_e4m3fn: ("torch", "reference")}
"""The backends that read each quantized cache dtype: numba's kernel reads int8 (numpy has
no fp8 type), the cpu backend gives its int8 decodes to it; torch and the reference
dequantize any (fp8 by torch's cast). Triton reads neither yet."""


def _check_kv_dtype(name: str, kv_cache_dtype: str, kv_dtype: torch.dtype | None) -> None:
    if kv_dtype is not None and name not in QUANTIZED_READERS[kv_dtype]:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is read by attention_backend "
                         f"{' / '.join(QUANTIZED_READERS[kv_dtype])} only, not {name!r}; use "
                         f"attention_backend auto, or kv_cache_dtype auto")


def _auto_backend(device_type: str, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> str:
    if kv_dtype is not None and (device_type != "cpu" or kv_dtype != torch.int8
                                 or dtype not in NUMBA_DTYPES or not _numba_installed()):
        return "torch"
    if device_type == "cuda":
        return "triton"
    if device_type == "cpu" and dtype in NUMBA_DTYPES and _numba_installed():
        return "cpu" if dtype == torch.float32 and _cpu_kernel_builds() else "numba"
    return "torch"


def _check_numba(device_type: str, dtype: torch.dtype) -> None:
    if device_type != "cpu":
        raise ValueError(f"attention_backend 'numba' runs on the CPU only, not on "
                         f"{device_type}; use auto or triton")
    if dtype not in NUMBA_DTYPES:
        raise ValueError(f"attention_backend 'numba' computes in float32 or float64 only, "
                         f"not {dtype}; use auto or torch for this dtype")
    if not _numba_installed():
        raise ValueError("attention_backend 'numba' needs the numba package, which is not "
                         "installed; use auto or torch")


def _check_cpu(device_type: str, dtype: torch.dtype) -> None:
    if device_type != "cpu" or dtype != torch.float32:
        raise ValueError(f"attention_backend 'cpu' takes float32 on the CPU only, not {dtype} "
                         f"on {device_type}; use auto")
    _check_numba(device_type, dtype)  # what the C kernel does not take goes to numba's
    if not _cpu_kernel_builds():
        raise ValueError("attention_backend 'cpu' needs a C compiler and an AVX2 or AVX-512 CPU, "
                         "which this machine lacks; use auto or numba")


def _cpu_kernel_builds() -> bool:
    from .cpu_attention import available

    return available()


def _numba_installed() -> bool:
    from .numba_attention import installed

    return installed()
