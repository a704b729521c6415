"""The CPU backends equal the reference: ragged batches mixing decodes and prefill chunks,
GQA, chunks crossing blocks, one-token contexts, float32 and float64, NaN in every cache slot
nobody may read, and output rows nobody owns left untouched. `NumbaBackend` (decodes in the
compiled kernel) and `TorchBackend` (decodes gathered in chunks) share the prefill path; both
are tested (the `backend` fixture). `select_attention_backend` picks them by name, dtype and
device."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from kernel_cases import assert_matches, make_case, poisoned_like
from tidal.engine_core.config import ATTENTION_BACKENDS
from tidal.kernels.attention import BACKENDS, cpu_attention, select_attention_backend
from tidal.kernels.cpu import native
from tidal.kernels.attention.cpu_attention import CpuBackend
from tidal.kernels.attention.metadata import AttentionMetadata
from tidal.kernels.attention.numba_attention import NumbaAttentionPlan, NumbaBackend, balanced_order
from tidal.kernels.attention.reference import ReferenceBackend, paged_attention_ref, write_kv_ref
from tidal.kernels.attention.torch_attention import TorchAttentionPlan, TorchBackend, write_kv_torch


@pytest.fixture(params=[CpuBackend, NumbaBackend, TorchBackend], ids=["cpu", "numba", "torch"])
def backend(request):
    """Run the test with decodes through the C kernel (float32; numba's for float64), the
    numba kernel, then the torch path."""
    if request.param is CpuBackend and not cpu_attention.available():
        pytest.skip("no C compiler or no AVX-512 on this machine")
    return request.param()


def metadata(case) -> AttentionMetadata:
    """The case's batch layout (no KV is written: the case's cache is already filled)."""
    num_tokens = case.query.shape[0]
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=case.block_tables, query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens)


def prepare(backend, case):
    """The backend's plan for the case, as the model runner prepares it once per step."""
    key_cache = case.key_cache
    return backend.prepare(metadata(case), key_cache.shape[1], key_cache.shape[2],
                           key_cache.shape[3], key_cache.dtype)


def stored_as(backend, cache: torch.Tensor) -> torch.Tensor:
    """A copy of a case's cache (NaN in every slot nobody may read) in the layout the backend
    allocates for the model runner (`AttentionBackend.kv_cache`)."""
    copy = backend.kv_cache(*cache.shape, cache.dtype, cache.device)
    return copy.copy_(cache)


def attend(backend, case, out=None):
    """One step of one layer, over caches stored as `backend` stores them: prepare, then
    attend."""
    key_cache, value_cache = stored_as(backend, case.key_cache), stored_as(backend,
                                                                          case.value_cache)
    return backend.attend(case.query, key_cache, value_cache, metadata(case),
                          prepare(backend, case), case.scale, out)


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
def test_cpu_backends_equal_reference(dtype, q_lens, seq_lens, num_heads, num_kv_heads,
                                      block_size, backend):
    case = make_case(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size, dtype,
                     num_pad_tokens=2)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = attend(backend, case, out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())
    assert not torch.isnan(out[case.owned_rows()]).any()


def test_attend_allocates_output(backend):
    case = make_case([1, 4], [9, 4], 4, 2, 16, 16, torch.float32)
    out = attend(backend, case)
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), atol=2e-5, rtol=2e-5)


def test_torch_backend_low_precision_cache():
    """bfloat16 queries and cache: softmax in float32, output back in bfloat16."""
    case = make_case([1, 6, 1], [17, 6, 3], 4, 2, 16, 16, torch.bfloat16, num_pad_tokens=1)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = attend(TorchBackend(), case, out=poisoned_like(case.query))
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


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX-512")
def test_cpu_backend_stores_its_float32_caches_head_major_and_writes_them_as_the_reference():
    """Where its C kernels take the cache (float32, a head size they take), each KV head's rows
    of a block lie together ([blocks, KV heads, block size, head_dim] in memory, seen through
    the usual shape); otherwise the plain layout. K/V writes (strided rows, int32 slots, a
    skipped one) land where the reference's do."""
    backend = CpuBackend()
    cache = backend.kv_cache(5, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert cache.shape == (5, 16, 3, 64) and cache.stride() == (3 * 16 * 64, 64, 16 * 64, 1)
    for dtype, head_dim in ((torch.float64, 64), (torch.float32, 24)):
        plain = backend.kv_cache(5, 16, 3, head_dim, dtype, torch.device("cpu"))
        assert plain.is_contiguous()
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 9, 64, generator=gen)  # K and V are views into a fused projection
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([5, 16, 17, -1, 79, 0, 33], dtype=torch.int32)
    expected = [torch.zeros(5, 16, 3, 64) for _ in range(2)]
    write_kv_ref(key, value, *expected, slots)
    caches = [backend.kv_cache(5, 16, 3, 64, torch.float32, torch.device("cpu")).zero_()
              for _ in range(2)]
    backend.write_kv(key, value, *caches, slots)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    with pytest.raises(IndexError, match="slot_mapping"):  # past the 5 x 16 slots
        backend.write_kv(key, value, *caches, torch.tensor([1, 2, 3, 4, 80, 6, 7]))


def test_write_kv_torch_no_tokens():
    cache = torch.zeros(2, 4, 1, 8)
    write_kv_torch(torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), cache, cache.clone(),
                   torch.zeros(0, dtype=torch.int64))
    assert not cache.any()


def test_backend_selection_by_name():
    assert isinstance(select_attention_backend("torch", "cpu", torch.float32), TorchBackend)
    assert type(select_attention_backend("torch", "cpu", torch.float32)) is TorchBackend
    assert isinstance(select_attention_backend("numba", "cpu", torch.float64), NumbaBackend)
    assert isinstance(select_attention_backend("reference", "cpu", torch.float32),
                      ReferenceBackend)
    for name in BACKENDS[1:]:
        if name == "cpu" and not cpu_attention.available():
            continue
        backend = select_attention_backend(name, "cpu", torch.float32)
        assert backend.name == name
        assert backend.can_capture_cuda_graphs == (name == "triton")


def test_auto_takes_the_c_kernel_for_float32_numba_for_float64_and_torch_otherwise():
    c_kernel = "cpu" if cpu_attention.available() else "numba"
    assert select_attention_backend("auto", "cpu", torch.float32).name == c_kernel
    assert select_attention_backend("auto", "cpu", torch.float64).name == "numba"
    assert select_attention_backend("auto", "cpu", torch.bfloat16).name == "torch"
    assert select_attention_backend("auto", "cpu", torch.float16).name == "torch"


@pytest.mark.parametrize("device_type, dtype, reason", [
    ("cpu", torch.bfloat16, "float32 or float64 only"),
    ("cpu", torch.float16, "float32 or float64 only"),
    ("cuda", torch.float32, "CPU only"),
])
def test_numba_where_it_cannot_run_is_an_error_naming_the_field(device_type, dtype, reason):
    with pytest.raises(ValueError, match=f"attention_backend 'numba' .*{reason}"):
        select_attention_backend("numba", device_type, dtype)


@pytest.mark.parametrize("device_type, dtype, reason", [
    ("cpu", torch.float64, "float32 on the CPU only"),
    ("cuda", torch.float32, "float32 on the CPU only"),
])
def test_cpu_where_it_cannot_run_is_an_error_naming_the_field(device_type, dtype, reason):
    with pytest.raises(ValueError, match=f"attention_backend 'cpu' .*{reason}"):
        select_attention_backend("cpu", device_type, dtype)


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX-512")
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [
    (64, 9, 3),  # SmolLM2's geometry
    (128, 4, 1),
    (16, 12, 1),  # a group of 12: int8 and AVX2 items take 8 and 4 heads per KV head
    (64, 12, 12),  # the 125M model's MHA: an item walks all 12 KV heads a block at a time
    (24, 4, 2),  # a head size the C kernel does not take: numba's kernel instead
])
def test_c_kernel_equals_reference_across_head_sizes_and_groups(head_dim, num_heads,
                                                                num_kv_heads):
    """Decodes and a short chunk row by row; two long chunks (one whole prompt, one after 70
    cached positions) through the blocked kernel, whose items cut across rows and heads."""
    case = make_case([1, 1, 1, 3, 1, 40, 29], [1, 45, 300, 9, 17, 40, 99], num_heads,
                     num_kv_heads, head_dim, 16, torch.float32, num_pad_tokens=1)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = attend(CpuBackend(), case, out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX-512")
@pytest.mark.parametrize("num_heads, num_kv_heads", [(12, 12), (9, 3), (16, 1)])
def test_c_decode_of_a_row_is_bit_for_bit_the_same_alone_or_among_others(num_heads,
                                                                        num_kv_heads):
    """A decode row's heads are one work item when the rows are many, and parts of a few KV
    heads each when they are too few for the threads (a row alone, on a machine of two
    threads or more); each head's arithmetic is the same either way, so the row's output is
    bit for bit the same."""
    lib, g = cpu_attention.load(), torch.Generator().manual_seed(3)
    rows, head_dim, block_size, per = 16, 64, 16, 40  # 40 blocks a request: 640 positions
    blocks = rows * per
    key_cache, value_cache = (torch.randn(blocks, num_kv_heads, block_size, head_dim,
                                          generator=g).transpose(1, 2) for _ in range(2))
    tables = torch.randperm(blocks, generator=g).to(torch.int32).reshape(rows, per)
    lens = torch.randint(460, per * block_size + 1, (rows,), generator=g).to(torch.int32)
    query = torch.randn(rows, num_heads, head_dim, generator=g)
    order = torch.arange(rows, dtype=torch.int64)

    def decode(n: int) -> torch.Tensor:
        out = torch.full_like(query, float("nan"))
        assert lib.tidal_decode_attention(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
            per, lens.data_ptr(), order.data_ptr(), order.data_ptr(), n, num_heads,
            num_kv_heads, head_dim, block_size, *key_cache.stride()[:3], head_dim ** -0.5,
            out.data_ptr()) == 0
        return out

    together, alone = decode(rows), decode(1)
    assert torch.equal(alone[0], together[0])
    assert not together.isnan().any()


@pytest.mark.skipif(not cpu_attention.available()
                    or not cpu_attention.load().tidal_prefill_attention_available(),
                    reason="no C compiler or no AVX-512")
def test_short_prefill_chunks_go_row_by_row_and_long_ones_to_the_blocked_kernel():
    """Chunks of up to ROW_CHUNK_TOKENS new tokens become rows of the C kernel, row i seeing
    the positions up to its own; a longer chunk goes whole to its blocked kernel, none to
    SDPA. Both equal the reference."""
    limit = cpu_attention.ROW_CHUNK_TOKENS
    case = make_case([1, limit, limit + 1, 3], [40, limit + 10, limit + 1, 3], 9, 3, 64, 16,
                     torch.float32, num_pad_tokens=1)
    backend = CpuBackend()
    plan = prepare(backend, case)
    assert [chunk.request for chunk in plan.chunks] == [2] and plan.prefills == []
    assert len(plan.rows.requests) == 1 + limit + 3
    first_row_of_chunk = (plan.rows.requests == 1) & (plan.rows.token_rows == 1)
    assert plan.rows.lens[first_row_of_chunk].tolist() == [11]  # 10 cached + its own token
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    out = attend(backend, case, out=poisoned_like(case.query))
    assert_matches(out, expected, case.owned_rows())


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX-512")
def test_the_c_kernels_avx2_build_equals_reference(tmp_path, monkeypatch):
    """decode_attention.c built for an AVX2 CPU (8-float vectors, run here: `native.march`, which
    the CPU op seam sets from `cpu_kernels=auto,march=haswell`)
    under CpuBackend: no blocked prefill kernel there, so a chunk of up to
    AVX2_ROW_CHUNK_TOKENS goes row by row and a longer one to SDPA."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "march", "haswell")
    monkeypatch.setattr(native, "_builds", {})
    assert cpu_attention.available()
    assert any(path.name.startswith("decode_attention-") for path in (tmp_path / "kernels").iterdir())
    assert "-march=haswell" in native.flags()
    assert not cpu_attention.load().tidal_prefill_attention_available()
    long = cpu_attention.AVX2_ROW_CHUNK_TOKENS + 1
    for head_dim, num_heads, num_kv_heads in ((64, 9, 3), (16, 12, 1), (128, 4, 2)):
        case = make_case([1, 1, 3, 1, 33, long], [1, 45, 9, 300, 50, long + 5], num_heads,
                         num_kv_heads, head_dim, 16, torch.float32, num_pad_tokens=1)
        plan = prepare(CpuBackend(), case)
        assert plan.chunks == [] and [chunk.request for chunk in plan.prefills] == [5]
        expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
        out = attend(CpuBackend(), case, out=poisoned_like(case.query))
        assert_matches(out, expected, case.owned_rows())


def test_unknown_backend_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_attention_backend("fast", "cpu", torch.float32)


def test_engine_config_accepts_exactly_the_kernel_backends():
    """engine_core never imports torch, so it keeps its own tuple of the names."""
    assert ATTENTION_BACKENDS == BACKENDS


def test_plan_prepared_once_serves_every_layer_of_the_step(backend):
    """`prepare` returns the backend's typed plan; two layers (two caches) attended with that
    one plan each equal the reference; the next step's seq_lens need a fresh plan, which
    gives the right answer again."""
    plan_type = NumbaAttentionPlan if isinstance(backend, NumbaBackend) else TorchAttentionPlan
    first = make_case([1, 1, 3], [9, 20, 5], 4, 2, 16, 16, torch.float64)
    # the next layer: same batch layout, other queries and K/V (NaN where nobody may read)
    second = replace(first, query=first.query.flip(0), key_cache=0.25 - first.key_cache / 2,
                     value_cache=first.value_cache * 2 - 1)
    meta = metadata(first)
    plan = backend.prepare(meta, 16, 2, 16, torch.float64)
    assert type(plan) is plan_type
    for case in (first, second):
        out = backend.attend(case.query, case.key_cache, case.value_cache, meta, plan,
                             case.scale)
        torch.testing.assert_close(out, paged_attention_ref(*case.args()), atol=1e-12,
                                   rtol=1e-12)
    next_step = replace(first, seq_lens=first.seq_lens.clone())
    next_step.seq_lens[1] = 17  # the second request now sees 17 of its cached tokens
    torch.testing.assert_close(attend(backend, next_step),
                               paged_attention_ref(*next_step.args()), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 2 * 2 * 70 * 16 * 8])
def test_decode_in_chunks_equals_reference(chunk_bytes):
    """Decodes attended a request at a time, or three at a time, with the decode rows
    contiguous and split by prefill chunks."""
    backend = TorchBackend(decode_chunk_bytes=chunk_bytes)
    for q_lens in ([1] * 7, [1, 1, 4, 1, 1, 3, 1]):
        case = make_case(q_lens, [70, 1, 33, 16, 17, 9, 2], 4, 2, 16, 16, torch.float64,
                         num_pad_tokens=1)
        expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
        out = attend(backend, case, out=poisoned_like(case.query))
        assert_matches(out, expected, case.owned_rows())


def test_decode_plan_sorts_by_length_and_pads_to_whole_blocks():
    """Decode requests are attended shortest first, in chunks whose padded length is the
    chunk's longest context rounded up to blocks of 16. With room for one request per chunk
    (a budget of 1 byte) every chunk is one request padded to its own whole blocks: 70 -> 80,
    33 -> 48, 16 -> 16, 1 -> 16; with the default budget (2 MiB, far more than 4 requests x
    80 positions x 2 kv heads x 16 dims x 2 (K and V) x 8 bytes) they share one chunk padded
    to 80."""
    case = make_case([1, 1, 1, 1], [70, 1, 33, 16], 4, 2, 16, 16, torch.float64)
    plan = prepare(TorchBackend(), case)
    assert [c.token_rows.tolist() for c in plan.decode_chunks] == [[1, 3, 2, 0]]
    assert [c.padded_len for c in plan.decode_chunks] == [80]
    one_per_chunk = TorchBackend(decode_chunk_bytes=1)
    plan = prepare(one_per_chunk, case)
    assert [c.token_rows.tolist() for c in plan.decode_chunks] == [[1], [3], [2], [0]]
    assert [c.padded_len for c in plan.decode_chunks] == [16, 16, 48, 80]
    out = one_per_chunk.attend(case.query, case.key_cache, case.value_cache, metadata(case),
                               plan, case.scale)
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), atol=1e-12,
                               rtol=1e-12)


def test_numba_plan_balances_decodes_over_threads_and_leaves_prefills_to_sdpa(monkeypatch):
    """The compiled kernel's static schedule gives thread k the k-th run of iterations, so the
    plan deals the decodes longest first, round-robin: with 2 threads the contexts 70, 1, 33
    become [70, 1] for the first thread and [33] for the second. The prefill chunk is the
    torch path's."""
    import tidal.kernels.attention.numba_attention as numba_attention

    monkeypatch.setattr(numba_attention.kernels().numba, "get_num_threads", lambda: 2)
    case = make_case([1, 4, 1, 1], [70, 4, 1, 33], 4, 2, 16, 16, torch.float32)
    plan = prepare(NumbaBackend(), case)
    assert plan.decode.requests.tolist() == [0, 2, 3]
    assert plan.decode.token_rows.tolist() == [0, 5, 6]
    assert [tuple(p) for p in plan.prefills] == [(1, 1, 5, 4)]
    prefill_only = make_case([3], [5], 4, 2, 16, 16, torch.float32)
    assert prepare(NumbaBackend(), prefill_only).decode is None


def test_balanced_order_gives_each_thread_a_similar_share():
    lengths = np.array([1, 2, 3, 4, 100, 90, 80, 70])
    order = balanced_order(lengths, 2)
    assert order.tolist() == [4, 6, 3, 1, 5, 7, 2, 0]  # 100+80+4+2 = 186 | 90+70+3+1 = 164
    assert lengths[order[:4]].sum() < 1.2 * lengths[order[4:]].sum()
    assert balanced_order(lengths, 1).tolist() == [4, 5, 6, 7, 3, 2, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_numba_warm_up_compiles_for_its_dtypes(dtype):
    assert NumbaBackend().warm_up(dtype) >= 0
    with pytest.raises(ValueError, match="numba"):
        NumbaBackend().warm_up(torch.bfloat16)


def test_the_kernels_float32_exp_is_exact_to_float32_rounding_and_never_underflows():
    """The numba kernel's softmax takes exp through a vectorisable polynomial for float32
    (`exp_shifted`, math.exp for float64): over every representable shift down to -87 it is
    within 1e-7 relative of float64 exp, and far below (scores minus a row maximum of
    1e30) it gives a tiny positive weight, never a NaN, Inf or garbage exponent."""
    from numba import njit

    from tidal.kernels.attention.numba_decode import exp_shifted

    @njit
    def exp_rows(row, top):
        exp_shifted(row, top, np.empty(row.shape[0], dtype=np.int32))
        return row

    x = np.linspace(-87.0, 0.0, 200_001).astype(np.float32)
    got = exp_rows(x.copy(), np.float32(0))
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 1e-7
    far = exp_rows(np.array([-1e30, -1e3, -88.0, 0.0], dtype=np.float32), np.float32(0))
    assert np.all(np.isfinite(far)) and np.all(far >= 0) and np.all(far[:3] < 1e-37)
    assert far[3] == 1.0
    doubles = np.linspace(-700.0, 0.0, 1001)
    np.testing.assert_allclose(exp_rows(doubles.copy(), 0.0), np.exp(doubles), rtol=1e-15)


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX-512")
def test_c_kernels_write_a_strided_output_through_a_copy():
    """An `out` the kernels cannot write in place (a strided view) gets the rows both C
    kernels own, and nothing else."""
    case = make_case([1, 3, 40], [30, 3, 60], 9, 3, 64, 16, torch.float32, num_pad_tokens=1)
    expected = paged_attention_ref(*case.args(), out=poisoned_like(case.query))
    wide = poisoned_like(torch.cat([case.query, case.query], dim=2))
    out = wide[:, :, ::2]
    attend(CpuBackend(), case, out=out)
    assert_matches(out, expected, case.owned_rows())
