"""Triton KV-cache write against `write_kv_ref` (interpreted on the CPU).

Both start from the same NaN-filled caches; the same slots must be written and, when the
input and cache dtypes agree, bit-identical (a pure copy)."""

import pytest
import torch

from tidal.kernels.attention.reference import write_kv_ref
from tidal.kernels.attention.triton_attention import write_kv_triton


def run_both(key, value, cache_shape, cache_dtype, slot_mapping, rtol=0.0):
    caches = [torch.full(cache_shape, float("nan"), dtype=cache_dtype) for _ in range(4)]
    write_kv_ref(key, value, caches[0], caches[1], slot_mapping)
    write_kv_triton(key, value, caches[2], caches[3], slot_mapping)
    for expected, actual in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(expected.isnan(), actual.isnan())  # same slots written
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=rtol, equal_nan=True)
    return caches[2]


def random_slots(num_tokens: int, num_slots: int, num_skipped: int, seed: int = 0):
    """Distinct slots for each token, the first `num_skipped` tokens set to -1 (padding)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[:num_skipped] = -1
    return slots[torch.randperm(num_tokens, generator=gen)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(dtype, block_size):
    num_tokens, num_kv_heads, head_dim = 9, 2, 16
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    slots = random_slots(num_tokens, 4 * block_size, num_skipped=2)
    cache = run_both(key, value, (4, block_size, num_kv_heads, head_dim), dtype, slots)
    assert int(cache.isnan().all(dim=-1).all(dim=-1).logical_not().sum()) == num_tokens - 2


def test_write_kv_strided_inputs_int32_slots_and_many_heads():
    """K and V as column slices of a fused qkv tensor; int32 slots; 16 heads of 256 exceed
    one program's 2048-element tile, so heads are split over programs."""
    num_tokens, num_kv_heads, head_dim = 3, 16, 256
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    assert not key.is_contiguous()
    slots = torch.tensor([17, -1, 3], dtype=torch.int32)
    run_both(key, value, (2, 16, num_kv_heads, head_dim), torch.float32, slots)


def test_write_kv_casts_to_cache_dtype():
    """float32 K/V into a bfloat16 cache. NOTE: the interpreter's float32->bfloat16 cast
    truncates where GPUs (and torch) round to nearest even, so allow one bf16 ulp (2^-7)."""
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16)
    run_both(key, value, (2, 16, 2, 16), torch.bfloat16, torch.tensor([0, 31, 7, -5]),
             rtol=2.0 ** -7)


def test_write_kv_all_skipped_and_empty():
    cache = torch.full((2, 16, 1, 16), float("nan"))
    write_kv_triton(torch.randn(2, 1, 16), torch.randn(2, 1, 16), cache, cache.clone(),
                    torch.tensor([-1, -1]))
    assert cache.isnan().all()
    write_kv_triton(torch.randn(0, 1, 16), torch.randn(0, 1, 16), cache, cache.clone(),
                    torch.zeros(0, dtype=torch.int64))
    assert cache.isnan().all()


def test_write_kv_rejects_bad_shapes():
    cache = torch.zeros(2, 16, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), cache, cache.clone(),
                        torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key_cache"):
        write_kv_triton(torch.zeros(3, 4, 16), torch.zeros(3, 4, 16), cache, cache.clone(),
                        torch.zeros(3, dtype=torch.int64))
