"""A quantized KV cache (`kv_cache_dtype` int8 / fp8, `kernels/attention/kv_quant.py`): every
CPU attention backend that reads one equals the reference over the same quantized cache (the
dequantization is the only new arithmetic: float32 tolerances), and that reference stays within
the stated quantization tolerance of attention over the float cache it was quantized from.
Cache slots nobody may read hold NaN scales, so a kernel that reads them fails. The cpu
backend decodes int8 in its C row kernel (`tidal_decode_attention_int8`). The write
quantizes per token and KV head; `select_attention_backend` refuses a backend that cannot read
the cache's dtype, naming `kv_cache_dtype`."""

import pytest
import torch

from kernel_cases import TOLERANCE, make_case, poisoned_like, windowed
from tidal.kernels.attention import cpu_attention, numba_attention, select_attention_backend
from tidal.kernels.attention.kv_quant import QMAX, dequantize, quantize, storage_dtype
from tidal.kernels.attention.metadata import AttentionMetadata
from tidal.kernels.attention.reference import paged_attention_ref

QUANTIZATION_ATOL = {torch.int8: 0.03, torch.float8_e4m3fn: 0.12}
"""Attention output over a quantized cache against the float32 cache it came from (unit
normal K, V and queries, so outputs are O(1)): measured max |error| 0.011 (int8: half a step
of max|x| / 127 per element) and 0.06 (fp8 e4m3: 3 mantissa bits) over these cases."""

CASES = [
    # (q_lens, seq_lens, num_heads, num_kv_heads, block_size)
    ([1, 1, 1, 1], [1, 16, 17, 50], 4, 2, 16),  # decode only: ragged, block edges, GQA 2
    ([7, 1, 20, 0, 3, 1], [20, 33, 20, 5, 3, 1], 8, 2, 16),  # mixed, an empty request
    ([3, 1, 12, 1], [40, 64, 12, 9], 8, 1, 8),  # MQA, chunks crossing blocks
]

READERS = [("reference", "int8"), ("torch", "int8"), ("numba", "int8"), ("cpu", "int8"),
           ("torch", "fp8"), ("reference", "fp8")]


def quantized_case(case, dtype):
    """The case's caches quantized row by row (the NaN rows nobody may read get NaN
    scales), and the float caches those read back as."""
    (kq, ks), (vq, vs) = quantize(case.key_cache, dtype), quantize(case.value_cache, dtype)
    return (kq, vq, ks, vs), (dequantize(kq, ks, torch.float32),
                              dequantize(vq, vs, torch.float32))


def attend(backend, case, caches, window=None, soft_cap=None):
    key, value, k_scale, v_scale = caches
    stored = []
    for cache in (key, value):
        copy = backend.kv_cache(*cache.shape, torch.float32, cache.device)
        stored.append(copy.copy_(cache))
    meta = AttentionMetadata(
        slot_mapping=torch.full((case.query.shape[0],), -1, dtype=torch.int64),
        block_tables=case.block_tables, query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens)
    plan = backend.prepare(meta, key.shape[1], key.shape[2], key.shape[3], torch.float32)
    return backend.attend(case.query, *stored, meta, plan, case.scale,
                          poisoned_like(case.query), sliding_window=window,
                          soft_cap=soft_cap, kv_scales=(k_scale, v_scale))


@pytest.mark.parametrize("name,kv_cache_dtype", READERS)
@pytest.mark.parametrize("q_lens,seq_lens,num_heads,num_kv_heads,block_size", CASES)
def test_quantized_cache_reads_equal_reference(name, kv_cache_dtype, q_lens, seq_lens,
                                               num_heads, num_kv_heads, block_size):
    if name == "cpu" and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")
    backend = select_attention_backend(name, "cpu", torch.float32, kv_cache_dtype)
    dtype = storage_dtype(kv_cache_dtype)
    case = make_case(q_lens, seq_lens, num_heads, num_kv_heads, 64, block_size)
    caches, (k_read, v_read) = quantized_case(case, dtype)
    out = attend(backend, case, caches)
    owned = case.owned_rows()
    dequantized_ref = paged_attention_ref(case.query, k_read, v_read, case.block_tables,
                                          case.query_start_loc, case.seq_lens, case.scale)
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out[owned], dequantized_ref[owned], atol=atol, rtol=rtol)
    float_ref = paged_attention_ref(*case.args())
    assert (out[owned] - float_ref[owned]).abs().max() < QUANTIZATION_ATOL[dtype]
    assert torch.isnan(out[owned.stop:]).all(), "wrote rows no request owns"


@pytest.mark.parametrize("name", ["numba", "torch", "cpu"])
def test_quantized_cache_window_and_cap(name):
    """Sliding window (blocks before it name the null block: NaN) and soft cap, int8."""
    if name == "cpu" and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")
    backend = select_attention_backend(name, "cpu", torch.float32, "int8")
    case = windowed(make_case([1, 6, 1], [40, 30, 17], 4, 2, 64, 8), 9)
    caches, (k_read, v_read) = quantized_case(case, torch.int8)
    out = attend(backend, case, caches, window=9, soft_cap=5.0)
    expected = paged_attention_ref(case.query, k_read, v_read, case.block_tables,
                                   case.query_start_loc, case.seq_lens, case.scale,
                                   sliding_window=9, soft_cap=5.0)
    owned = case.owned_rows()
    torch.testing.assert_close(out[owned], expected[owned], atol=2e-5, rtol=2e-5)


def test_cpu_backend_decodes_int8_in_its_c_kernel(monkeypatch):
    """The cpu backend's int8 decodes go to `tidal_decode_attention_int8`, not numba's kernel
    (which is made to fail here), and equal the reference over the dequantized cache."""
    if not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")

    def numba_kernel(*args, **kwargs):
        raise AssertionError("an int8 decode went to numba's kernel")

    monkeypatch.setattr(numba_attention, "paged_decode_numba", numba_kernel)
    backend = select_attention_backend("cpu", "cpu", torch.float32, "int8")
    case = make_case([1, 1, 1], [1, 31, 70], 9, 3, 64, 16)  # SmolLM2's heads, group 3
    caches, (k_read, v_read) = quantized_case(case, torch.int8)
    out = attend(backend, case, caches)
    expected = paged_attention_ref(case.query, k_read, v_read, case.block_tables,
                                   case.query_start_loc, case.seq_lens, case.scale)
    owned = case.owned_rows()
    torch.testing.assert_close(out[owned], expected[owned], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name,kv_cache_dtype", [("reference", "int8"), ("torch", "int8"),
                                                 ("cpu", "int8"), ("torch", "fp8")])
def test_write_quantizes_each_token_and_head(name, kv_cache_dtype):
    """write_kv stores q = round(x / s), s = max|x| / 127 per (token, KV head), at the slot;
    slot -1 writes nothing; an all-zero row stores scale 0."""
    if name == "cpu" and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")
    backend = select_attention_backend(name, "cpu", torch.float32, kv_cache_dtype)
    dtype = storage_dtype(kv_cache_dtype)
    key_cache = backend.kv_cache(4, 4, 2, 16, torch.float32, torch.device("cpu"))
    value_cache = backend.kv_cache(4, 4, 2, 16, torch.float32, torch.device("cpu"))
    for cache in (key_cache, value_cache):
        cache.view(torch.uint8).zero_()
    scales = [backend.kv_scales(4, 4, 2, torch.device("cpu")).fill_(-1) for _ in range(2)]
    key, value = torch.randn(3, 2, 16) * 3, torch.randn(3, 2, 16)
    key[2] = 0
    backend.write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 14]), scales)
    expected_scale = key[0].abs().amax(-1) / QMAX[dtype]
    torch.testing.assert_close(scales[0][1, 1], expected_scale)
    assert key_cache.dtype == dtype
    scaled = key[0] / expected_scale[:, None]
    expected = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    assert torch.equal(key_cache[1, 1].view(torch.uint8), expected.view(torch.uint8))
    assert key_cache[1, 1].float().abs().amax() == QMAX[dtype]
    assert (scales[0][3, 2] == 0).all() and (key_cache[3, 2].float() == 0).all()  # zero row
    assert (scales[1].view(-1, 2)[[i for i in range(16) if i not in (5, 14)]] == -1).all()


def test_cpu_backend_int8_worker_never_imports_numba():
    """Warm-up, write, plan and a decode of an int8 cache on the cpu backend, in a fresh
    process: numba is never imported (its import and kernel loads took an int8 worker's
    start 4-8 s on the shared 2-vCPU VM, for a kernel the C one replaces)."""
    if not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")
    import subprocess
    import sys
    script = """
import sys, torch
from tidal.kernels.attention import select_attention_backend
from tidal.kernels.attention.metadata import AttentionMetadata
backend = select_attention_backend("cpu", "cpu", torch.float32, "int8")
backend.warm_up(torch.float32)
caches = [backend.kv_cache(4, 16, 3, 64, torch.float32, torch.device("cpu")) for _ in range(2)]
scales = [backend.kv_scales(4, 16, 3, torch.device("cpu")) for _ in range(2)]
backend.write_kv(torch.randn(20, 3, 64), torch.randn(20, 3, 64), *caches,
                 torch.arange(16, 36), scales)
meta = AttentionMetadata(torch.tensor([35]), torch.tensor([[1, 2, 0, 0]], dtype=torch.int32),
                         torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([20], dtype=torch.int32))
plan = backend.prepare(meta, 16, 3, 64, torch.float32)
out = backend.attend(torch.randn(1, 9, 64), *caches, meta, plan, 0.125, kv_scales=scales)
assert torch.isfinite(out).all()
assert "numba" not in sys.modules, "numba was imported"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


def test_cpu_backend_writes_int8_in_c_as_kv_quant_does(monkeypatch):
    """The cpu backend's int8 write (`tidal_write_kv_int8`, not torch's ops, which are made to
    fail here) stores what kv_quant.write_kv_quantized does, bit for bit: rows of any
    magnitude, exact ties (x / s at k + 0.5 rounds to even), an all-zero row, slot -1."""
    if not cpu_attention.available():
        pytest.skip("no C compiler or no AVX on this machine")
    from tidal.kernels.attention import kv_quant, torch_attention
    backend = select_attention_backend("cpu", "cpu", torch.float32, "int8")
    g = torch.Generator().manual_seed(0)
    key = torch.randn(37, 3, 64, generator=g) * 10 ** torch.randn(37, 3, 1, generator=g)
    value = torch.randn(37, 3, 64, generator=g)
    key[3, 1] = 0
    key[5, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127, -127, 3.5])  # s = 1
    slots = torch.randperm(20 * 16, generator=g)[:37]
    slots[2] = -1
    stored = []
    for write in ("c", "torch"):
        caches = [backend.kv_cache(20, 16, 3, 64, torch.float32, torch.device("cpu"))
                  for _ in range(2)]
        for cache in caches:
            cache.view(torch.uint8).zero_()
        scales = [backend.kv_scales(20, 16, 3, torch.device("cpu")).fill_(-1) for _ in range(2)]
        if write == "c":
            with monkeypatch.context() as patch:
                patch.setattr(torch_attention, "write_kv_quantized", None)  # a call fails
                backend.write_kv(key, value, *caches, slots, scales)
        else:
            kv_quant.write_kv_quantized(key, value, *caches, scales, slots)
        stored.append(caches + scales)
    for c_written, torch_written in zip(*stored):
        assert torch.equal(c_written, torch_written)


def test_kv_cache_dtype_refusals_name_the_flag():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        select_attention_backend("auto", "cpu", torch.float32, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'.*numba"):
        select_attention_backend("numba", "cpu", torch.float32, "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'.*'triton'"):
        select_attention_backend("triton", "cuda", torch.float32, "int8")


def test_auto_picks_a_reader_and_sizes_the_smaller_rows():
    """auto: int8 on the CPU in float32 keeps the cpu backend (its decodes in numba's kernel);
    fp8 takes the torch backend. A token's row of one KV head, head_dim 64: 256 bytes in
    float32, 68 in int8 (64 + a float32 scale): 3.76x the tokens per byte."""
    int8 = select_attention_backend("auto", "cpu", torch.float32, "int8")
    assert int8.kv_dtype == torch.int8 and int8.name in ("cpu", "numba")
    assert select_attention_backend("auto", "cpu", torch.float32, "fp8").name == "torch"
    assert select_attention_backend("auto", "cuda", torch.bfloat16, "int8").name == "torch"
    plain = select_attention_backend("auto", "cpu", torch.float32)
    assert plain.kv_bytes_per_token_head(64, torch.float32) == 256
    assert int8.kv_bytes_per_token_head(64, torch.float32) == 68
