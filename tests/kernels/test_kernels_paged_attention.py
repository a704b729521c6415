"""Triton paged attention against `paged_attention_ref` (interpreted on the CPU).

Every output buffer starts NaN-filled: owned rows must match the reference within the dtype's
tolerance (`kernel_cases.TOLERANCE`), rows no request owns must stay NaN. Cache slots no
request may read are NaN too, so reading past a request's range fails the comparison."""

import pytest
import torch

from kernel_cases import assert_matches, make_case, poisoned_like
from tidal.kernels.attention import select_attention_backend
from tidal.kernels.attention.metadata import AttentionMetadata
from tidal.kernels.attention.reference import (
    merge_splits_ref,
    paged_attention_ref,
    paged_attention_splitk_ref,
    splitk_partials_ref,
)
from tidal.kernels.attention.triton_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    AttentionLaunch,
    TritonBackend,
    choose_launch,
    choose_num_splits,
    merge_splits_triton,
    paged_attention_triton,
    run_paged_attention,
)

# (q_lens, seq_lens, num_heads, num_kv_heads, block_size)
DECODE_GQA4 = ([1, 1, 1, 1], [1, 16, 17, 70], 8, 2, 16)  # 1 token, exact block, several blocks
MIXED_MHA = ([7, 1, 20, 0, 3], [20, 33, 20, 5, 3], 4, 4, 16)  # runs cross 16, empty request
MIXED_GQA8 = ([3, 1, 12], [40, 64, 12], 8, 1, 32)  # block size 32, whole-prompt prefill
MIXED_GQA3 = ([2, 1, 9], [18, 1, 9], 6, 2, 16)  # group 3 padded to 4 rows per token
SHAPES = [DECODE_GQA4, MIXED_MHA, MIXED_GQA8, MIXED_GQA3]
SHAPE_IDS = ["decode-gqa4", "mixed-mha", "mixed-gqa8", "mixed-gqa3"]


def check(case, launch=None):
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = poisoned_like(case.query)
    if launch is None:
        returned = paged_attention_triton(*case.args(), out=out)
    else:
        returned = run_paged_attention(*case.args(), out, launch)
    assert returned is out
    assert_matches(out, expected, case.owned_rows())


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_default_launch_fp32(shape):
    q_lens, seq_lens, num_heads, num_kv_heads, block_size = shape
    check(make_case(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size,
                    num_pad_tokens=2))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_small_tiles_fp32(shape):
    """16-row query tiles and 16-position KV tiles: many query blocks per request (so the
    binary search over query_start_loc and the per-block causal reach are exercised), KV tiles
    that start mid-block (block size 32) and a GQA-8 tile of 2 tokens × 8 heads."""
    q_lens, seq_lens, num_heads, num_kv_heads, block_size = shape
    check(make_case(q_lens, seq_lens, num_heads, num_kv_heads, 32, block_size, seed=1,
                    num_pad_tokens=1), AttentionLaunch(block_m=16, tile_n=16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    case = make_case([3, 1, 0, 2], [20, 17, 5, 2], 4, 2, 16, 16, dtype, seed=2,
                     num_pad_tokens=1)
    check(case)
    check(case, AttentionLaunch(block_m=16, tile_n=16, num_splits=2))


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (128, torch.bfloat16),
                                            (256, torch.float16)])
def test_model_head_sizes(head_dim, dtype):
    check(make_case([1, 4], [33, 20], 4, 1, head_dim, 16, dtype, seed=3))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode(num_splits):
    """Split-K over a ragged GQA-4 decode batch: short requests leave later splits empty."""
    case = make_case([1, 1, 1, 1], [1, 16, 17, 70], 4, 1, 16, 16, seed=4, num_pad_tokens=1)
    check(case, AttentionLaunch(block_m=16, tile_n=16, num_splits=num_splits))


def test_split_k_with_prefill_rows_equals_splitk_reference():
    """The split path also serves query runs (rows whose causal reach ends before a split
    starts see nothing there); it equals the split-K reference, which equals the plain one."""
    case = make_case([5, 1], [37, 9], 4, 2, 16, 16, torch.float64, seed=5, num_pad_tokens=1)
    launch = AttentionLaunch(block_m=16, tile_n=16, num_splits=3)
    out = run_paged_attention(*case.args(), poisoned_like(case.query), launch)
    expected = paged_attention_splitk_ref(*case.args(), num_splits=3, tile_size=16,
                                          out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())


def test_merge_kernel_equals_merge_reference():
    """The reduce kernel alone, fed the reference partials (with empty splits)."""
    case = make_case([1, 2, 1], [3, 40, 70], 4, 2, 16, 16, seed=6, num_pad_tokens=1)
    partials = splitk_partials_ref(*case.args(), num_splits=4, tile_size=16)
    expected = merge_splits_ref(*partials, case.query_start_loc, poisoned_like(case.query))
    out = merge_splits_triton(*partials, case.query_start_loc, poisoned_like(case.query))
    assert torch.isinf(partials[1][0, :, 1:]).all()  # request 0: splits 1..3 are empty
    assert_matches(out, expected, case.owned_rows())


def test_auto_launch_takes_split_k_for_a_lone_long_decode():
    """One decode against a 64-block table: the heuristic splits it (the interpreter is
    treated as a 16-SM GPU), and the result still equals the reference."""
    case = make_case([1], [150], 4, 1, 16, 16, seed=7, extra_table_cols=60)
    launch = choose_launch(1, 1, 4, 1, 16, max_kv_len=case.block_tables.shape[1] * 16,
                           num_sms=16)
    assert launch.num_splits == 2  # 70 blocks x 16 = 1120 tokens, 512 per split at least
    check(case)


def test_choose_num_splits():
    # enough programs already: no split
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_kv_len=4096, num_sms=132) == 1
    # 2 x 8 programs on 132 SMs: aim at ~2 programs per SM, bounded by MAX_SPLITS
    assert choose_num_splits(2, 8, 32768, 132) == min(MAX_SPLITS, -(-264 // 16))
    # short contexts are not worth splitting below MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(1, 8, 1024, 132) == 1024 // MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(1, 8, 256, 132) == 1


def test_choose_launch_tiles():
    decode = choose_launch(32, 32, 32, 8, 128, 4096, 132)
    assert (decode.block_m, decode.tile_n, decode.num_splits) == (16, 64, 1)
    prefill = choose_launch(2048, 1, 32, 8, 128, 4096, 132)
    assert (prefill.block_m, prefill.tile_n, prefill.num_splits) == (128, 64, 1)
    wide = choose_launch(2048, 1, 64, 1, 256, 4096, 132)  # group 64 > 64-row default
    assert (wide.block_m, wide.tile_n) == (64, 32)
    assert choose_launch(4, 4, 4, 4, 16, 64, 132, torch.float64).tile_n == 16


def test_strided_query_and_out():
    """query as a column slice of a fused qkv tensor, out as a slice of a wider buffer."""
    case = make_case([3, 1], [19, 17], 4, 2, 16, 16, seed=8)
    qkv = torch.randn(case.query.shape[0], 8, 16)
    qkv[:, :4] = case.query
    case.query = qkv[:, :4]
    buffer = torch.full((case.query.shape[0], 6, 16), float("nan"))
    out = buffer[:, 1:5]
    run_paged_attention(*case.args(), out, AttentionLaunch(block_m=16, tile_n=16))
    expected = paged_attention_ref(*case.args())
    assert_matches(out, expected, case.owned_rows())
    assert torch.isnan(buffer[:, 0]).all() and torch.isnan(buffer[:, 5]).all()


def test_out_none_allocates():
    case = make_case([2], [5], 2, 1, 16, 16, seed=9)
    out = paged_attention_triton(*case.args())
    assert_matches(out, paged_attention_ref(*case.args()), case.owned_rows())


def test_empty_batches():
    case = make_case([2], [5], 2, 1, 16, 16)
    no_tokens = paged_attention_triton(case.query[:0], *case.args()[1:])
    assert no_tokens.shape == (0, 2, 16)
    out = poisoned_like(case.query)
    paged_attention_triton(case.query, case.key_cache, case.value_cache,
                           case.block_tables[:0], case.query_start_loc[:1], case.seq_lens[:0],
                           case.scale, out=out)
    assert out.isnan().all()  # no request: nothing written
    assert choose_num_splits(0, 8, 4096, 132) == 1


def test_rejects_bad_inputs():
    case = make_case([2], [5], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(case.query.half(), *case.args()[1:])
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_triton(case.query[:, :3], *case.args()[1:])
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(*case.args()[:4], case.query_start_loc[:1], *case.args()[5:])
    with pytest.raises(ValueError, match="out"):
        paged_attention_triton(*case.args(), out=case.query[:1])
    with pytest.raises(ValueError, match="block_m"):
        run_paged_attention(*case.args(), None, AttentionLaunch(block_m=1, tile_n=16))


def test_select_attention_backend_triton():
    """The triton backend attends through `paged_attention_triton`, needs no per-step plan
    and is the one backend a CUDA graph can capture."""
    backend = select_attention_backend("triton", "cpu", torch.float32)
    assert isinstance(backend, TritonBackend)
    assert backend.name == "triton" and backend.can_capture_cuda_graphs
    assert select_attention_backend("auto", "cuda", torch.bfloat16).name == "triton"
    case = make_case([2, 1], [18, 33], 4, 2, 16, 16, num_pad_tokens=1)
    meta = AttentionMetadata(torch.full((4,), -1), case.block_tables, case.query_start_loc,
                             case.seq_lens)
    assert backend.prepare(meta, 16, 2, 16, torch.float32) is None
    out = backend.attend(case.query, case.key_cache, case.value_cache, meta, None, case.scale,
                         poisoned_like(case.query))
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())


def test_head_dim_not_a_power_of_two():
    """head_dim 24 runs in a 32-wide tile with the extra lanes masked (plain and split-K)."""
    case = make_case([2, 1], [18, 33], 4, 2, 24, 16, seed=10, num_pad_tokens=1)
    check(case)
    check(case, AttentionLaunch(block_m=16, tile_n=16, num_splits=2))
