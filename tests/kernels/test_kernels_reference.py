"""The torch references themselves: paged attention against PyTorch's
scaled_dot_product_attention on contiguous copies, the split-K reference against the plain
one, and the KV write against direct indexing."""

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import PagedCase, make_case, poisoned_like
from tidal.kernels.attention.reference import (
    merge_splits_ref,
    paged_attention_ref,
    paged_attention_splitk_ref,
    split_len_for,
    splitk_partials_ref,
    write_kv_ref,
)


def sdpa_on_contiguous_copies(case: PagedCase) -> torch.Tensor:
    """Attention of each request computed by SDPA on an unpaged copy of its K/V.

    The new tokens sit at the end of the sequence, so the causal mask is bottom-right aligned:
    query j (position seq_len - q_len + j) sees keys 0..that position."""
    out = poisoned_like(case.query)
    num_kv_heads = case.key_cache.shape[2]
    group = case.query.shape[1] // num_kv_heads
    qsl = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        slots = [int(case.block_tables[i, p // case.key_cache.shape[1]]) *
                 case.key_cache.shape[1] + p % case.key_cache.shape[1] for p in range(seq_len)]
        flat_k = case.key_cache.reshape(-1, num_kv_heads, case.key_cache.shape[3])
        flat_v = case.value_cache.reshape(-1, num_kv_heads, case.value_cache.shape[3])
        k = flat_k[slots].transpose(0, 1).contiguous()  # [kv_heads, seq, d]
        v = flat_v[slots].transpose(0, 1).contiguous()
        q = case.query[qsl[i]:qsl[i + 1]].transpose(0, 1).contiguous()  # [heads, q_len, d]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos  # True = may attend
        o = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
            attn_mask=mask, scale=case.scale)
        out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
    return out


SDPA_CASES = [
    # (q_lens, seq_lens, num_heads, num_kv_heads, block_size): decodes, ragged prefills with
    # context, runs crossing block boundaries, an empty request, GQA 1 / 4 / 8
    ([1, 1, 1], [1, 16, 37], 4, 4, 16),
    ([7, 1, 20, 0, 3], [20, 33, 20, 5, 3], 8, 2, 16),
    ([3, 1, 12], [40, 64, 12], 8, 1, 32),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q_lens,seq_lens,num_heads,num_kv_heads,block_size", SDPA_CASES)
def test_reference_equals_sdpa(dtype, q_lens, seq_lens, num_heads, num_kv_heads, block_size):
    case = make_case(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size, dtype,
                     num_pad_tokens=2)
    out = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    expected = sdpa_on_contiguous_copies(case)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol, equal_nan=True)
    assert torch.isnan(out[-2:]).all()  # padding rows untouched


@pytest.mark.parametrize("num_splits,tile_size", [(1, 16), (2, 16), (3, 8), (8, 4)])
def test_splitk_reference_equals_plain(num_splits, tile_size):
    """Merging per-split partials gives the one-pass result, including empty splits."""
    case = make_case([1, 5, 1], [1, 30, 45], 8, 2, 16, 16, torch.float64, num_pad_tokens=1)
    plain = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    split = paged_attention_splitk_ref(*case.args(), num_splits=num_splits,
                                       tile_size=tile_size, out=poisoned_like(case.query))
    torch.testing.assert_close(split, plain, atol=1e-12, rtol=1e-12, equal_nan=True)


def test_split_partials_layout():
    case = make_case([1, 1], [1, 40], 2, 1, 16, 16, torch.float64)
    acc, max_log2, sums = splitk_partials_ref(*case.args(), num_splits=4, tile_size=8)
    assert acc.shape == (2, 2, 4, 16) and max_log2.shape == sums.shape == (2, 2, 4)
    # request 0 has one cached token: only split 0 sees anything
    assert torch.isinf(max_log2[0, :, 1:]).all() and (sums[0, :, 1:] == 0).all()
    assert torch.allclose(sums[0, :, 0], torch.ones(2, dtype=torch.float64))
    # request 1: 40 tokens = 5 tiles of 8 -> 2 tiles (16 positions) per split; 3 splits used
    assert split_len_for(40, 4, 8) == 16
    assert torch.isfinite(max_log2[1, :, :3]).all() and torch.isinf(max_log2[1, :, 3]).all()


def test_merge_splits_leaves_unowned_rows():
    acc = torch.ones(3, 1, 2, 4)
    max_log2 = torch.tensor([[[0.0, float("-inf")]]] * 3)
    sums = torch.tensor([[[2.0, 0.0]]] * 3)
    out = torch.full((3, 1, 4), float("nan"))
    merge_splits_ref(acc, max_log2, sums, torch.tensor([0, 2], dtype=torch.int32), out)
    assert torch.equal(out[:2], torch.full((2, 1, 4), 0.5))
    assert torch.isnan(out[2]).all()


def test_write_kv_reference_scatters_and_skips():
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    key_cache = torch.zeros(3, 4, 2, 8)
    value_cache = torch.zeros(3, 4, 2, 8)
    write_kv_ref(key, value, key_cache, value_cache, torch.tensor([5, -1, 11, 4]))
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[2, 3], value[2])
    assert torch.equal(key_cache[1, 0], key[3])
    assert int((key_cache != 0).any(dim=(2, 3)).sum()) == 3  # token 1 was skipped
