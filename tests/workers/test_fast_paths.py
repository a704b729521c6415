"""Hot-path shortcuts of the worker behave exactly like the plain torch ops they replace."""

import pytest
import torch

from tidal.workers.sampler import argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_equals_torch_argmax(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen).to(dtype)
    x[1, 7] = x[1, 200] = x[1].max() + 1  # a tie: the first index wins
    x[2, 5] = x[2, 9] = float("nan")  # NaN counts as the maximum
    x[3] = float("-inf")  # all masked: index 0
    x[4, :] = 2.0  # all equal
    x[5, 299] = float("inf")
    for t in (x, x[:, ::2], x.t().contiguous().t()):  # contiguous and strided
        got = argmax_rows(t)
        assert got.dtype == torch.int64
        assert torch.equal(got, t.argmax(dim=-1))


def test_argmax_rows_other_dtypes_and_empty():
    x = torch.randn(4, 10).to(torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 10)).shape == (0,)


def test_argmax_rows_under_inference_mode():
    with torch.inference_mode():
        x = torch.randn(3, 50)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
