"""The CPU backend equals the reference: ragged batches mixing decodes and prefill chunks,
GQA, chunks crossing blocks, one-token contexts, float32 and float64, NaN in every cache slot
nobody may read, and output rows nobody owns left untouched. Decode rows take the compiled
numba kernel where it applies and the gathered torch path otherwise; both are tested (the
`decode_path` fixture)."""

import pytest
import torch

from kernel_cases import assert_matches, make_case, poisoned_like
from tidal.kernels import select_attention_ops
from tidal.kernels.reference import paged_attention_ref, write_kv_ref
from tidal.kernels.torch_attention import paged_attention_torch, write_kv_torch

@pytest.fixture(params=["numba", "torch"])
def decode_path(request, monkeypatch):
    """Run the test with decodes through the numba kernel, then through the torch path."""
    import tidal.kernels.torch_attention as torch_attention

    monkeypatch.setattr(torch_attention, "USE_NUMBA", request.param == "numba")
    return request.param


CASES = [
    # (q_lens, seq_lens, num_heads, num_kv_heads, block_size)
    ([1], [1], 4, 4, 16),  # a one-token context
    ([1, 1, 1, 1], [1, 16, 17, 50], 4, 2, 16),  # decode only: ragged, block edges, GQA 2
    ([7, 1, 20, 0, 3, 1], [20, 33, 20, 5, 3, 1], 8, 2, 16),  # mixed, an empty request
    ([3, 1, 12, 1], [40, 64, 12, 9], 8, 1, 8),  # GQA 8 (MQA), chunks crossing blocks
    ([1, 5, 1, 1], [30, 5, 2, 70], 6, 3, 4),  # decodes split by a prefill (gathered rows)
    ([2, 2], [2, 19], 2, 2, 16),  # two-token chunks, one a whole prompt
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q_lens,seq_lens,num_heads,num_kv_heads,block_size", CASES)
def test_torch_attention_equals_reference(dtype, q_lens, seq_lens, num_heads, num_kv_heads,
                                          block_size, decode_path):
    case = make_case(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size, dtype,
                     num_pad_tokens=2)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = paged_attention_torch(*case.args(), out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())
    assert not torch.isnan(out[case.owned_rows()]).any()


def test_torch_attention_allocates_output(decode_path):
    case = make_case([1, 4], [9, 4], 4, 2, 16, 16, torch.float32)
    out = paged_attention_torch(*case.args())
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), atol=2e-5, rtol=2e-5)


def test_torch_attention_low_precision_cache():
    """bfloat16 queries and cache: softmax in float32, output back in bfloat16."""
    case = make_case([1, 6, 1], [17, 6, 3], 4, 2, 16, 16, torch.bfloat16, num_pad_tokens=1)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = paged_attention_torch(*case.args(), out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_write_kv_torch_equals_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    shape = (5, 4, 2, 8)
    key, value = torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64).to(dtype)
    slots = torch.tensor([4, -1, 5, 19, -1, 8])
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    write_kv_ref(key, value, caches[0], caches[1], slots)
    write_kv_torch(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[2], caches[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(caches[3], caches[1], equal_nan=True, rtol=0, atol=0)


def test_write_kv_torch_no_tokens():
    cache = torch.zeros(2, 4, 1, 8)
    write_kv_torch(torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), cache, cache.clone(),
                   torch.zeros(0, dtype=torch.int64))
    assert not cache.any()


def test_backend_selection():
    assert select_attention_ops("torch", "cpu").paged_attention is paged_attention_torch
    assert select_attention_ops("auto", "cpu").paged_attention is paged_attention_torch
    assert select_attention_ops("reference", "cpu").paged_attention is paged_attention_ref
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_ops("fast", "cpu")


def test_batch_plan_built_once_per_step_through_the_scratch_dict(decode_path):
    """Layers share one step's metadata and its scratch dict: the index plan is built by the
    first call and reused by the next; a new step (a fresh scratch dict) with different
    seq_lens gets a fresh plan and the right answer; without a scratch dict nothing is kept."""
    case = make_case([1, 1, 3], [9, 20, 5], 4, 2, 16, 16, torch.float64)
    args = list(case.args())
    scratch: dict = {}
    expected = paged_attention_ref(*args)
    torch.testing.assert_close(paged_attention_torch(*args, scratch=scratch), expected,
                               atol=1e-12, rtol=1e-12)
    (plan,) = scratch.values()
    torch.testing.assert_close(paged_attention_torch(*args, scratch=scratch), expected,
                               atol=1e-12, rtol=1e-12)
    assert list(scratch.values()) == [plan]
    args[5] = case.seq_lens.clone()
    args[5][1] = 17  # next step: the second request now sees 17 cached tokens
    next_scratch: dict = {}
    expected = paged_attention_ref(*args)
    torch.testing.assert_close(paged_attention_torch(*args, scratch=next_scratch), expected,
                               atol=1e-12, rtol=1e-12)
    assert next_scratch[next(iter(scratch))] is not plan
    torch.testing.assert_close(paged_attention_torch(*args), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 2 * 2 * 70 * 16 * 8])
def test_decode_in_chunks_equals_reference(monkeypatch, chunk_bytes):
    """Decodes attended a request at a time, or three at a time, with the decode rows
    contiguous and split by prefill chunks."""
    import tidal.kernels.torch_attention as torch_attention

    monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(torch_attention, "USE_NUMBA", False)
    for q_lens in ([1] * 7, [1, 1, 4, 1, 1, 3, 1]):
        case = make_case(q_lens, [70, 1, 33, 16, 17, 9, 2], 4, 2, 16, 16, torch.float64,
                         num_pad_tokens=1)
        expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
        out = paged_attention_torch(*case.args(), out=poisoned_like(case.query))
        assert_matches(out, expected, case.owned_rows())


def test_decode_plan_sorts_by_length_and_pads_to_whole_blocks(monkeypatch):
    """Decode requests are attended shortest first, in chunks whose padded length is the
    chunk's longest context rounded up to blocks of 16. With room for one request per chunk
    (a budget of 1 byte) every chunk is one request padded to its own whole blocks: 70 -> 80,
    33 -> 48, 16 -> 16, 1 -> 16; with the default budget (2 MiB, far more than 4 requests x
    80 positions x 2 kv heads x 16 dims x 2 (K and V) x 8 bytes) they share one chunk padded
    to 80."""
    import tidal.kernels.torch_attention as torch_attention

    monkeypatch.setattr(torch_attention, "USE_NUMBA", False)
    case = make_case([1, 1, 1, 1], [70, 1, 33, 16], 4, 2, 16, 16, torch.float64)
    scratch: dict = {}
    paged_attention_torch(*case.args(), scratch=scratch)
    (plan,) = scratch.values()
    assert [c.token_rows.tolist() for c in plan.decode] == [[1, 3, 2, 0]]
    assert [c.padded_len for c in plan.decode] == [80]
    monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", 1)
    scratch = {}
    expected = paged_attention_ref(*case.args())
    out = paged_attention_torch(*case.args(), scratch=scratch)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    (plan,) = scratch.values()
    assert [c.token_rows.tolist() for c in plan.decode] == [[1], [3], [2], [0]]
    assert [c.padded_len for c in plan.decode] == [16, 16, 48, 80]


@pytest.mark.parametrize("dtype,compiled", [(torch.float32, True), (torch.float64, True),
                                            (torch.bfloat16, False)])
def test_decode_takes_the_compiled_kernel_for_float32_and_float64(dtype, compiled):
    """float32/float64 decodes go through the numba kernel; bfloat16 (which numba cannot
    hold) through the gathered torch path. Both equal the reference."""
    import tidal.kernels.torch_attention as torch_attention

    case = make_case([1, 1, 4], [9, 40, 4], 4, 2, 16, 16, dtype, num_pad_tokens=1)
    scratch: dict = {}
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = paged_attention_torch(*case.args(), out=poisoned_like(case.query), scratch=scratch)
    assert_matches(out, expected, case.owned_rows())
    (plan,) = scratch.values()
    assert isinstance(plan.decode, torch_attention._NumbaDecode) == compiled
