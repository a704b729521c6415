"""Sliding-window attention and soft-capped scores in every attention backend, against
`paged_attention_ref`, and the reference against transformers' own sliding-window mask.

The cases are `kernel_cases.make_case` batches (every slot nobody may read is NaN) with one
more poison: every block table entry wholly before a request's first visible position names
the null block 0 (all NaN), as the engine core's tables do once it has freed those blocks. A
backend that reads an out-of-window block, instead of skipping it, fails the comparison.
Windows smaller and larger than the contexts, on and across block edges; decodes, prefill
chunks with a cached context, whole prompts, and chunks longer than the C kernel's row limit
(its blocked prefill kernel).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernel_cases import assert_matches, make_case, poisoned_like, windowed
from tidal.kernels.attention import check_window_and_cap, cpu_attention
from tidal.kernels.attention.cpu_attention import CpuBackend
from tidal.kernels.attention.metadata import AttentionMetadata
from tidal.kernels.attention.numba_attention import NumbaBackend
from tidal.kernels.attention.reference import ReferenceBackend, paged_attention_ref
from tidal.kernels.attention.torch_attention import TorchBackend

CASES = [
    # (q_lens, seq_lens, num_heads, num_kv_heads, block_size)
    ([1, 1, 1, 1], [1, 16, 17, 70], 4, 2, 16),  # decodes: block edges, GQA 2
    ([7, 1, 20, 3, 1], [20, 33, 45, 3, 1], 8, 2, 16),  # mixed: chunks with a context
    ([40, 1, 24], [90, 64, 24], 4, 1, 8),  # chunks past the C row limit (blocked kernel)
    ([1, 5, 1, 1], [30, 5, 2, 70], 6, 3, 4),  # small blocks
]
WINDOWS = [1, 5, 16, 33, 1000]  # 1000: larger than every context (all visible)
CAPS = [None, 0.8]


def metadata(case) -> AttentionMetadata:
    num_tokens = case.query.shape[0]
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=case.block_tables, query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens)


def attend(backend, case, window, cap):
    """One layer through `backend` over caches stored its way, as the model runner drives it."""
    caches = []
    for cache in (case.key_cache, case.value_cache):
        copy = backend.kv_cache(*cache.shape, cache.dtype, cache.device)
        caches.append(copy.copy_(cache))
    meta = metadata(case)
    plan = backend.prepare(meta, *case.key_cache.shape[1:], case.key_cache.dtype)
    return backend.attend(case.query, *caches, meta, plan, case.scale,
                           poisoned_like(case.query), sliding_window=window, soft_cap=cap)


BACKENDS = [TorchBackend, NumbaBackend, CpuBackend]


@pytest.fixture(params=BACKENDS, ids=["torch", "numba", "cpu"])
def backend(request):
    if request.param is CpuBackend and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX2/AVX-512 on this machine")
    return request.param()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap", CAPS, ids=["nocap", "cap"])
@pytest.mark.parametrize("shape", CASES, ids=["decode", "mixed", "long-chunks", "bs4"])
def test_cpu_backends_equal_reference(backend, shape, cap, dtype):
    q_lens, seq_lens, heads, kv_heads, block_size = shape
    for window in WINDOWS:
        case = windowed(make_case(q_lens, seq_lens, heads, kv_heads, 16, block_size, dtype,
                                  seed=window, num_pad_tokens=2), window)
        expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query),
                                       sliding_window=window, soft_cap=cap)
        out = attend(backend, case, window, cap)
        assert_matches(out, expected, case.owned_rows())
        assert not torch.isnan(out[case.owned_rows()]).any(), (window, cap)


def test_layers_of_two_windows_share_one_plan(backend):
    """Gemma interleaves windowed and global layers: one step's plan serves both."""
    case = make_case([1, 6, 1], [40, 30, 9], 4, 2, 16, 16, torch.float32)
    meta = metadata(case)
    plan = backend.prepare(meta, *case.key_cache.shape[1:], case.key_cache.dtype)
    caches = [backend.kv_cache(*c.shape, c.dtype, c.device).copy_(c)
              for c in (case.key_cache, case.value_cache)]
    for window, cap in [(8, None), (None, None), (8, 1.5), (None, 1.5), (20, None)]:
        out = backend.attend(case.query, *caches, meta, plan, case.scale,
                             sliding_window=window, soft_cap=cap)
        expected = paged_attention_ref(*case.args(), sliding_window=window, soft_cap=cap)
        assert_matches(out, expected, case.owned_rows())


def test_window_larger_than_context_is_full_attention():
    case = make_case([7, 1], [20, 33], 4, 2, 16, 16, torch.float64)
    full = paged_attention_ref(*case.args())
    torch.testing.assert_close(paged_attention_ref(*case.args(), sliding_window=33), full)
    assert not torch.allclose(paged_attention_ref(*case.args(), sliding_window=32), full)


def test_reference_equals_transformers_sliding_window_mask():
    """The reference's window is transformers' (masking_utils.sliding_window_overlay on top of
    the causal mask), off-by-one included, and its cap Gemma 2's tanh."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    torch.manual_seed(0)
    seq_len, q_len, heads, dim, window, cap = 29, 11, 2, 8, 6, 0.7
    case = make_case([q_len], [seq_len], heads, heads, dim, 4, torch.float64)
    got = paged_attention_ref(*case.args(), sliding_window=window, soft_cap=cap)
    blocks = case.block_tables[0, :(seq_len + 3) // 4].long()
    k = case.key_cache[blocks].reshape(-1, heads, dim)[:seq_len].transpose(0, 1)
    v = case.value_cache[blocks].reshape(-1, heads, dim)[:seq_len].transpose(0, 1)
    q = case.query[:q_len].transpose(0, 1)
    causal, overlay = causal_mask_function, sliding_window_overlay(window)
    allowed = torch.tensor([[causal(0, 0, qi, kj) and overlay(0, 0, qi, kj)
                             for kj in range(seq_len)]
                            for qi in range(seq_len - q_len, seq_len)])
    scores = cap * torch.tanh(q @ k.transpose(1, 2) * case.scale / cap)
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    torch.testing.assert_close(got[:q_len], want.transpose(0, 1))


def test_reference_backend_passes_window_and_cap():
    case = make_case([3, 1], [20, 9], 4, 2, 16, 16, torch.float32)
    out = ReferenceBackend().attend(case.query, case.key_cache, case.value_cache,
                                    metadata(case), None, case.scale, sliding_window=4,
                                    soft_cap=2.0)
    torch.testing.assert_close(out, paged_attention_ref(*case.args(), sliding_window=4,
                                                        soft_cap=2.0))


@pytest.mark.parametrize("window,cap,field", [(0, None, "sliding_window"),
                                              (-3, None, "sliding_window"),
                                              (2.5, None, "sliding_window"),
                                              (None, 0.0, "logits_soft_cap"),
                                              (None, -1.0, "logits_soft_cap")])
def test_bad_window_or_cap_is_a_value_error_naming_it(window, cap, field):
    with pytest.raises(ValueError, match=field):
        check_window_and_cap(window, cap)


TRITON_CASES = [
    # (window, cap, shape, launch: None for choose_launch's, else (block_m, tile_n, splits))
    (5, None, 1, None),  # mixed batch, 128-row tiles
    (1, 0.8, 1, (16, 16, 1)),  # window 1: a token sees itself only; small tiles
    (17, 0.8, 0, (16, 16, 3)),  # decodes, split-K: splits wholly before the window
    (1000, None, 0, None),  # larger than every context
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("window,cap,shape,launch", TRITON_CASES)
def test_triton_equals_reference(window, cap, shape, launch):
    from tidal.kernels.attention.triton_attention import (
        AttentionLaunch, paged_attention_triton, run_paged_attention)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q_lens, seq_lens, heads, kv_heads, block_size = CASES[shape]
    case = windowed(make_case(q_lens, seq_lens, heads, kv_heads, 16, block_size,
                              torch.float32, num_pad_tokens=1), window)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query),
                                   sliding_window=window, soft_cap=cap)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args()]
    out = poisoned_like(args[0])
    if launch is None:
        paged_attention_triton(*args, out=out, sliding_window=window, soft_cap=cap)
    else:
        block_m, tile_n, splits = launch
        run_paged_attention(*args, out, AttentionLaunch(block_m, tile_n, splits),
                            sliding_window=window, soft_cap=cap)
    assert_matches(out.cpu(), expected, case.owned_rows())
