"""The panel GEMM (`kernels/cpu/small_m_gemm.py`): the product equals F.linear's to float32
rounding for every row count up to 128 (its row blocks and their tails), a row's product does
not depend on the rows beside it (bit for bit), the fused add and mul equal the separate ops
bit for bit, weights stored narrower (bfloat16, float16, GGUF 4/8-bit
blocks) give the float32 products bit for bit, the AVX2 build equals the AVX-512 one bit for
bit, and a machine where it cannot be built keeps oneDNN."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.cpu import amx_gemm, cpu_gemm, native, small_m_gemm
from tidal.kernels.cpu.cpu_gemm import SmallBatchGemm, small_batch_gemm_available

@pytest.fixture(autouse=True)
def _panels_without_amx(monkeypatch):
    """These tests specify the panel kernel's own paths; on a CPU with AMX a GGUF weight's
    larger products go to `amx_gemm.py` instead (its tests: test_amx_gemm.py): as on a CPU
    without it."""
    monkeypatch.setattr(amx_gemm, "load", lambda: None)


needs_kernel = pytest.mark.skipif(small_m_gemm.load() is None,
                                  reason="no C compiler or no AVX2 on this machine")
needs_avx512 = pytest.mark.skipif(
    small_m_gemm.load() is None or small_m_gemm.load().tidal_panel_gemm_vector_floats() < 16,
    reason="the float panels take every small batch with AVX-512 only")


@needs_kernel
@pytest.mark.parametrize("shape", [(96, 64), (960, 576), (64, 1536)])
def test_product_equals_f_linear_for_every_row_count(shape):
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.05
    gemm = small_m_gemm.PanelGemm(weight, torch.float32)
    for rows in [1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 20, 24, 25, 32, 33, 64, 127, 128]:
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_fused_add_and_mul_equal_the_separate_ops_bit_for_bit():
    torch.manual_seed(1)
    weight = torch.randn(128, 96)
    gemm = small_m_gemm.PanelGemm(weight, torch.float32)
    for rows in (1, 9, 30):
        x, other = torch.randn(rows, 96), torch.randn(rows, 128)
        y = gemm(x)
        assert torch.equal(gemm(x, other, "add"), y + other)
        assert torch.equal(gemm(x, other, "mul"), y * other)



@needs_kernel
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(storage):
    """Rows go in blocks (every size up to 12 with AVX-512) and a long input in chunks of
    ROW_CHUNK rows: each row's sums run over k in the same order whatever its block, so a row
    of a batch equals that row alone, bit for bit, at every block size and tail and across a
    chunk edge. So a speculative verification step's rows get a decode step's results (greedy
    tokens equal with speculation on and off)."""
    torch.manual_seed(2)
    weight = torch.randn(64, 96).to(storage).float()
    gemm = small_m_gemm.PanelGemm(weight, storage)
    x, other = torch.randn(300, 96), torch.randn(300, 64)
    alone = torch.cat([gemm(x[i:i + 1]) for i in range(300)])
    for rows in (*range(2, 15), 20, 25, 29, 256, 257, 300):
        if rows > gemm.max_rows:
            break  # AVX2 builds: the float panels take a few rows only
        assert torch.equal(gemm(x[:rows]), alone[:rows]), rows
        assert torch.equal(gemm(x[:rows], other[:rows], "add"), alone[:rows] + other[:rows])


@needs_avx512
@pytest.mark.parametrize("mkl_avx512", [True, False], ids=["intel", "elsewhere"])
def test_small_batch_gemm_takes_the_panels_and_a_onednn_copy_only_for_prefills(monkeypatch,
                                                                               mkl_avx512):
    """The panels take every small batch; oneDNN's copy is kept only where it takes the
    large products instead of MKL (`cpu_gemm.mkl_runs_avx512`)."""
    monkeypatch.setattr(cpu_gemm, "mkl_runs_avx512", lambda: mkl_avx512)
    weight = torch.randn(64, 32)
    gemm = SmallBatchGemm(weight)
    assert gemm.panels is not None and (gemm.reordered is None) is mkl_avx512
    x = torch.randn(2, 5, 32)  # any leading shape
    torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_weights_a_narrower_type_holds_exactly_are_stored_in_it_with_the_same_products(narrow):
    """A checkpoint saved in bfloat16 (or float16) and widened to float32 at load is stored
    back in its own type, and the products equal those of float32 panels bit for bit."""
    torch.manual_seed(2)
    weight = (torch.randn(96, 200) * 0.05).to(narrow).to(torch.float32)
    assert small_m_gemm.exact_storage_dtype(weight) == narrow
    narrow_gemm = small_m_gemm.PanelGemm(weight, narrow)
    wide_gemm = small_m_gemm.PanelGemm(weight, torch.float32)
    assert narrow_gemm.panels.dtype == narrow and wide_gemm.panels.dtype == torch.float32
    for rows in (1, 5, 12, 29):
        x, other = torch.randn(rows, 200), torch.randn(rows, 96)
        assert torch.equal(narrow_gemm(x), wide_gemm(x))
        assert torch.equal(narrow_gemm(x, other, "mul"), wide_gemm(x, other, "mul"))


def test_storage_is_the_narrowest_type_that_loses_nothing():
    halves = torch.tensor([[0.5, -1.25, 3.0]])
    assert small_m_gemm.exact_storage_dtype(halves) == torch.bfloat16
    fp16_only = torch.tensor([[1.0 + 2.0 ** -10]])  # 10 mantissa bits: float16, not bfloat16
    assert small_m_gemm.exact_storage_dtype(fp16_only) == torch.float16
    assert small_m_gemm.exact_storage_dtype(torch.tensor([[0.1]])) == torch.float32
    assert small_m_gemm.exact_storage_dtype(torch.tensor([[70000.0 + 2.0 ** -4]])) == torch.float32


def q4_weight(n=96, k=128, seed=3):
    """A weight made the way transformers de-quantizes a GGUF Q4_1 tensor: per run of 32 k of
    a column, fl(fl(d q) + m), q in 0..15 (0 and 15 both present), d and m float16 values."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


def q8_weight(n=96, k=128, seed=4):
    """GGUF Q8_0 de-quantized: fl(d q), q in -127..127 (127 present), d a float16 value."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.001).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


@needs_kernel
@pytest.mark.parametrize("make, kind", [(q4_weight, 3), (q8_weight, 4)])
def test_weights_made_of_quantized_blocks_are_stored_as_them_with_the_same_products(make, kind):
    """A de-quantized GGUF weight keeps its 4- or 8-bit blocks; up to `block_rows()` rows read
    them (AVX2_BLOCK_ROWS with AVX2), more rows the float panels (AVX-512 only), and every
    product equals the float32 panels' bit for bit (each weight is rebuilt exactly before it
    is multiplied)."""
    weight = make()
    blocks = small_m_gemm.PanelGemm(weight)
    wide = small_m_gemm.PanelGemm(weight, torch.float32)
    assert blocks._blocks_type == kind and wide.blocks is None
    assert blocks.blocks.numel() < weight.numel() * 4 // 3  # 6 or 9 bits a weight, not 32
    reach = small_m_gemm._reach()[0]
    for rows in [r for r in (*range(1, 9), 12, 13, 29, reach, reach + 1)
                 if r <= blocks.max_rows]:
        x, other = torch.randn(rows, weight.shape[1]), torch.randn(rows, weight.shape[0])
        assert torch.equal(blocks(x), wide(x))
        assert torch.equal(blocks(x, other, "add"), wide(x, other, "add"))


@needs_kernel
def test_bytes_read_follow_the_path_each_row_count_takes():
    weight = q4_weight()  # 96 x 128: 12 KiB of blocks against 48 KiB of float32
    gemm = SmallBatchGemm(weight)
    reach = small_m_gemm._reach()[0]
    assert gemm.bytes_read(1) == gemm.bytes_read(reach) == 3 * 4 * 768
    # then the float32 panels (AVX-512) or oneDNN's copy of the float32 weight (AVX2)
    assert gemm.bytes_read(reach + 1) == 96 * 128 * 4
    assert gemm.bytes_read(10_000) == weight.nbytes  # F.linear on the float32 weight


def _build_for(monkeypatch, tmp_path, march: str) -> ctypes.CDLL:
    """small_m_gemm.c built for another CPU (gcc's -march), loaded beside this machine's
    build (which `small_m_gemm.load()` keeps)."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    library = native.build_and_load(small_m_gemm.SOURCE, "tidal_panel_gemm_available",
                                    target=march).library
    small_m_gemm._declare(library)
    return library


@needs_avx512
def test_the_avx2_build_gives_the_avx512_builds_results_bit_for_bit(monkeypatch, tmp_path):
    """Every storage type, fused op and row-block tail: the 8-float build (an AVX2 CPU's, run
    here) equals this machine's 16-float build bit for bit, blocks found included."""
    kernel = small_m_gemm.load()
    avx2 = _build_for(monkeypatch, tmp_path, "haswell")
    assert avx2.tidal_panel_gemm_available() and avx2.tidal_panel_gemm_vector_floats() == 8
    plain = (torch.randn(96, 128) * 0.05).to(torch.bfloat16).to(torch.float32)
    cases = [(small_m_gemm.pack_panels(plain, dtype), kind) for dtype, kind in
             ((torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2))]
    for make, kind, size in ((q4_weight, 3, 768), (q8_weight, 4, 1152)):
        found = torch.empty(3, 4, size, dtype=torch.uint8)
        weight = make()
        assert avx2.tidal_find_blocks(weight.data_ptr(), 96, 128, kind, found.data_ptr())
        assert torch.equal(found, small_m_gemm.q4_blocks(weight) if kind == 3
                           else small_m_gemm.q8_blocks(weight))
        cases.append((found, kind))
    for packed, kind in cases:
        for rows in (1, 2, 3, 5, 8, 12, 13):
            x, other = torch.randn(rows, 128), torch.randn(rows, 96)
            for op in (0, 1, 2):
                ys = [torch.empty(rows, 96) for _ in range(2)]
                for library, y in zip((kernel, avx2), ys):
                    library.tidal_panel_gemm(x.data_ptr(), rows, 128, packed.data_ptr(), kind,
                                             96, y.data_ptr(), other.data_ptr(), op)
                assert torch.equal(ys[0], ys[1]), (kind, rows, op)


@needs_kernel
def test_with_avx2_only_the_blocks_and_float_panels_take_a_few_rows_and_onednn_the_rest(
        monkeypatch):
    monkeypatch.setattr(small_m_gemm, "_reach", lambda: (small_m_gemm.AVX2_BLOCK_ROWS,
                                                         small_m_gemm.AVX2_PANEL_ROWS))
    if not small_batch_gemm_available(torch.randn(64, 32)):
        pytest.skip("torch built without oneDNN")
    plain_weight = torch.randn(96, 128)
    plain = SmallBatchGemm(plain_weight)
    assert plain.panel_rows == small_m_gemm.AVX2_PANEL_ROWS and plain.reordered is not None
    assert plain.kernel_weights(small_m_gemm.AVX2_PANEL_ROWS + 1) is None  # oneDNN's
    for rows in (1, 5, small_m_gemm.AVX2_PANEL_ROWS, small_m_gemm.AVX2_PANEL_ROWS + 1):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(plain(x), F.linear(x, plain_weight), rtol=1e-5, atol=1e-5)
    weight = q4_weight()
    gemm = SmallBatchGemm(weight)
    assert gemm.panel_rows == small_m_gemm.AVX2_BLOCK_ROWS and gemm.panels.panels is None
    assert gemm.reordered is not None
    for rows in (1, small_m_gemm.AVX2_BLOCK_ROWS, small_m_gemm.AVX2_BLOCK_ROWS + 1, 40):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_weight_that_blocks_would_change_is_not_stored_as_blocks():
    """One value a float32 ulp off its block's grid: the 4-bit form cannot hold it."""
    weight = q4_weight()
    assert small_m_gemm.q4_blocks(weight) is not None
    weight[5, 70] = torch.nextafter(weight[5, 70], torch.tensor(1.0))
    assert small_m_gemm.q4_blocks(weight) is None
    assert small_m_gemm.q8_blocks(q4_weight()) is None  # an offset grid is not Q8_0's
    assert small_m_gemm.q4_blocks(torch.randn(64, 64)) is None
    assert small_m_gemm.q8_blocks(torch.randn(64, 64)) is None
    assert small_m_gemm.q4_blocks(q4_weight()[:, :48].contiguous()) is None  # K: 1.5 blocks


def test_widths_that_are_not_whole_panel_pairs_are_refused():
    assert not small_m_gemm.panel_gemm_applies(torch.randn(48, 32))
    with pytest.raises(ValueError, match="no panel GEMM"):
        small_m_gemm.PanelGemm(torch.randn(48, 32))


def test_without_a_compiler_the_layers_keep_onednn(monkeypatch, tmp_path):
    """No `cc` on the machine: load() is None and SmallBatchGemm reorders for oneDNN."""
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert small_m_gemm.load() is None
    weight = torch.randn(64, 32)
    if not small_batch_gemm_available(weight):
        pytest.skip("torch built without oneDNN")
    gemm = SmallBatchGemm(weight)
    assert gemm.panels is None and gemm.reordered is not None
    x = torch.randn(3, 32)
    torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
