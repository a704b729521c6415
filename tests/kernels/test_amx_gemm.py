"""The AMX GEMM (`kernels/cpu/amx_gemm.py`) for a de-quantized GGUF weight's larger products: the
same weights exactly (the pack refuses a block whose d q + m is not exact in float32), products
as close to the float64 product as F.linear's for every row count (tile tails, row chunks),
the fused add and mul equal to the separate ops bit for bit, and the routing: the blocks up to
AMX_BLOCK_ROWS rows, AMX above, prefill chunks included, and `amx=False` (the CPU op seam's
`cpu_kernels=auto,no-amx`) turning it off."""

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.cpu import amx_gemm, small_m_gemm
from tidal.kernels.cpu.cpu_gemm import SmallBatchGemm

needs_amx = pytest.mark.skipif(amx_gemm.load() is None,
                               reason="no AMX on this CPU (or no C compiler)")


def q4_weight(n, k, seed=0, scale=0.01, offset=0.05):
    """GGUF Q4_1 de-quantized: per run of 32 k of a column fl(fl(d q) + m), q in 0..15 (0 and
    15 present), d and m float16 values."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * scale + scale / 10).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * offset).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


def q8_weight(n, k, seed=1):
    """GGUF Q8_0 de-quantized: fl(d q), q in -127..127 (127 present), d a float16 value."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.001).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


def amx_for(weight, kind):
    blocks = small_m_gemm.q4_blocks(weight) if kind == 3 else small_m_gemm.q8_blocks(weight)
    assert blocks is not None
    return amx_gemm.AmxBlockGemm.from_blocks(blocks, kind, *weight.shape)


@needs_amx
@pytest.mark.parametrize("make, kind", [(q4_weight, 3), (q8_weight, 4)])
@pytest.mark.parametrize("n, k", [(32, 64), (96, 1088)])  # 1088: 34 runs, two groups of m
def test_products_are_as_close_to_the_exact_ones_as_f_linears(make, kind, n, k):
    """Exact tile products, float32 sums in another order: against the float64 product the
    error stays within F.linear's own (2x its worst, plus an ulp-sized floor) for every row
    count: 1, a tile's 16 and either side, and past the 128-row chunk."""
    weight = make(n, k)
    gemm = amx_for(weight, kind)
    for rows in (1, 15, 16, 17, 100, 129, 300):
        x = torch.randn(rows, k)
        exact = F.linear(x.double(), weight.double())
        ours = (gemm(x).double() - exact).abs().max().item()
        theirs = (F.linear(x, weight).double() - exact).abs().max().item()
        assert ours <= 2 * theirs + 1e-6, (rows, ours, theirs)


@needs_amx
def test_fused_add_and_mul_equal_the_separate_ops_bit_for_bit():
    weight = q4_weight(64, 128)
    gemm = amx_for(weight, 3)
    x, other = torch.randn(40, 128), torch.randn(40, 64)
    assert torch.equal(gemm(x, other, "add"), gemm(x) + other)
    assert torch.equal(gemm(x, other, "mul"), gemm(x) * other)
    assert gemm(torch.empty(0, 128)).shape == (0, 64)


@needs_amx
def test_a_block_whose_weights_round_is_refused():
    """d q with bits below m's last (d near 2^-12, m near -2): fl(d q + m) is a weight the
    4-bit form holds (the panel kernel rebuilds it with the same rounding) but not d q + m
    itself, which is what the tiles multiply, so the AMX kernel is not made for it."""
    weight = q4_weight(32, 64, scale=2.0 ** -12, offset=2.0)
    blocks = small_m_gemm.q4_blocks(weight)
    assert blocks is not None
    assert amx_gemm.AmxBlockGemm.from_blocks(blocks, 3, 32, 64) is None
    assert amx_for(q4_weight(32, 64), 3) is not None


@needs_amx
def test_the_blocks_take_a_few_rows_and_amx_every_larger_product():
    weight = q4_weight(96, 128)
    gemm = SmallBatchGemm(weight)
    panels = gemm.panels
    assert panels.amx is not None and panels.panels is None  # no float panels kept
    assert gemm.reordered is None  # nor oneDNN's copy
    wide = small_m_gemm.PanelGemm(weight, torch.float32)
    few = torch.randn(small_m_gemm.AMX_BLOCK_ROWS, 128)
    assert torch.equal(gemm(few), wide(few))  # the blocks, bit for bit the float32 panels'
    assert gemm.bytes_read(small_m_gemm.AMX_BLOCK_ROWS) == panels.blocks.nbytes
    for rows in (small_m_gemm.AMX_BLOCK_ROWS + 1, 512):  # 512: a prefill chunk, not F.linear
        assert gemm.bytes_read(rows) == panels.amx.bytes_read()
        x = torch.randn(rows, 128)
        torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert torch.equal(gemm(x), panels.amx(x))


@needs_amx
def test_no_amx_keeps_the_float_panels():
    panels = small_m_gemm.PanelGemm(q4_weight(96, 128), amx=False)
    assert panels.amx is None and panels.panels is not None
