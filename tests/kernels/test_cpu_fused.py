"""The compiled RMSNorm and rotary of `kernels/cpu/cpu_fused.py` stand in for the torch ops of
`workers/layers.py`: the rotation bit for bit (float32 and float64, strided input), the
norm to float32 rounding, and the float64 norm keeps transformers' exact ops. Each test runs
with float32 in C (`layer_ops.c`, where a compiler is here) and in numba (`engine`)."""

import pytest
import torch

from tidal.kernels.cpu import cpu_fused
from tidal.workers.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="numba not installed")


@pytest.fixture(autouse=True, params=["c", "numba"])
def engine(request, monkeypatch):
    """float32 through layer_ops.c, then with no C library (numba's kernels)."""
    if request.param == "c":
        if cpu_fused.c_library() is None:
            pytest.skip("no C compiler here")
    else:
        monkeypatch.setattr(cpu_fused, "c_library", lambda: None)
    return request.param


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_split_is_bit_identical_to_the_torch_rotation(dtype):
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    tokens, num_heads, kv_heads = 37, 9, 3
    rope = rotary.tables(torch.randint(0, 512, (tokens,), generator=gen), dtype)
    # q and k heads as the fused qkv projection leaves them: a strided view, v after them
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * 64, generator=gen, dtype=dtype)
    qk = qkv[:, :(num_heads + kv_heads) * 64].view(tokens, -1, 64)
    assert cpu_fused.rotate_applies(qk)
    q, k = RotaryEmbedding.apply_split(qk, rope, num_heads)
    reference = RotaryEmbedding.apply(qk, rope)
    assert q.is_contiguous() and q.shape == (tokens, num_heads, 64)
    assert torch.equal(q, reference[:, :num_heads])
    assert torch.equal(k, reference[:, num_heads:])


def test_float32_norm_equals_transformers_to_rounding():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(torch.randn(576, generator=gen))
    for rows in (1, 33, 300):
        x = torch.randn(rows, 576, generator=gen) * 3
        assert cpu_fused.rms_norm_applies(x)
        ours, ref = norm(x), hf_rms_norm(x, norm.weight, 1e-5)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_float64_and_strided_norms_keep_the_torch_ops():
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(64, 1e-6).to(torch.float64)
    norm.weight.data.copy_(torch.randn(64, generator=gen, dtype=torch.float64))
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    assert not cpu_fused.rms_norm_applies(x)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))
    strided = torch.randn(5, 128, generator=gen)[:, ::2]
    assert not cpu_fused.rms_norm_applies(strided)
