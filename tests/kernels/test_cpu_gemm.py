"""The CPU's small-batch GEMM (`kernels/cpu/cpu_gemm.py`) equals `F.linear` up to float32
rounding on both sides of its row threshold, and is refused where it does not apply."""

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.cpu import cpu_gemm
from tidal.kernels.cpu.cpu_gemm import SMALL_BATCH_ROWS, SmallBatchGemm, small_batch_gemm_available


@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300])
def test_small_batch_gemm_equals_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(SmallBatchGemm(weight)(x), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)


def test_small_batch_gemm_keeps_leading_dimensions_and_takes_strided_input():
    weight = torch.randn(24, 16)
    x = torch.randn(3, 5, 32)[..., ::2]  # non-contiguous last dimension
    out = SmallBatchGemm(weight)(x)
    assert out.shape == (3, 5, 24)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert SmallBatchGemm(weight)(torch.zeros(0, 16)).shape == (0, 24)


def test_only_float32_cpu_weights_qualify():
    assert small_batch_gemm_available(torch.randn(4, 4))
    assert not small_batch_gemm_available(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="oneDNN"):
        SmallBatchGemm(torch.randn(4, 4, dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 13, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1])
def test_fused_add_and_mul_equal_the_separate_op_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    x, other = torch.randn(rows, 40, generator=gen), torch.randn(rows, 96, generator=gen)
    gemm = SmallBatchGemm(weight)
    assert torch.equal(gemm.add(x, other), gemm(x) + other)
    assert torch.equal(gemm.mul(x, other), gemm(x) * other)


@pytest.mark.parametrize("mkl_avx512", [True, False], ids=["intel", "elsewhere"])
def test_prefill_sized_products_take_onednn_where_mkl_has_no_avx512_code(monkeypatch,
                                                                       mkl_avx512):
    """Products above SMALL_BATCH_ROWS (prefill chunks) keep `F.linear` where MKL runs its
    AVX-512 code (Intel CPUs) and take oneDNN's reordered copy elsewhere (an AMD EPYC with
    AVX-512: 15-20% faster prefill steps); the same results up to rounding either way, the
    add and mul fused bit for bit."""
    monkeypatch.setattr(cpu_gemm, "mkl_runs_avx512", lambda: mkl_avx512)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 40, generator=gen)
    rows = SMALL_BATCH_ROWS + 44
    x, other = torch.randn(rows, 40, generator=gen), torch.randn(rows, 96, generator=gen)
    gemm = SmallBatchGemm(weight)
    assert gemm.large_rows_on_onednn is not mkl_avx512
    out = gemm(x)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    if not mkl_avx512:
        assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(
            x, gemm.reordered, None, "none", [], ""))
    assert torch.equal(gemm.add(x, other), out + other)
    assert torch.equal(gemm.mul(x, other), out * other)


def test_onednn_copy_is_made_at_first_use_or_by_prepare():
    """The reorder is not part of building the GEMM (a worker's start-up): the first product
    that takes oneDNN makes it, or `prepare` beforehand; results as before."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 40, generator=gen)
    x = torch.randn(3, 40, generator=gen)
    lazy, early = SmallBatchGemm(weight, panels=False), SmallBatchGemm(weight, panels=False)
    assert lazy.uses_onednn and not lazy.prepared and lazy._reordered is None
    early.prepare()
    assert early.prepared and early._reordered is not None
    out = lazy(x)
    assert lazy.prepared
    assert torch.equal(out, early(x))
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
