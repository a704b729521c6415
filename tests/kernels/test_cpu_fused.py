"""The CPU op seam's RMSNorm and rotary (`kernels/cpu/ops.py`, computed by
`kernels/cpu/cpu_fused.py`) stand in for transformers' torch ops: the rotation bit for bit
(float32 and float64, strided input), the norm to float32 rounding, and the float64 norm keeps
transformers' exact ops. Each test runs with float32 in C (`layer_ops.c`, where a compiler is
here) and in numba (`engine`)."""

import dataclasses

import pytest
import torch

from tidal.kernels.cpu import cpu_fused
from tidal.kernels.cpu.ops import TORCH_OPS, rotate, select_cpu_ops
from tidal.workers.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="numba not installed")


@pytest.fixture(params=["c", "numba"])
def ops(request):
    """float32 through layer_ops.c, then with no C library (numba's kernels)."""
    chosen = select_cpu_ops("auto")
    if request.param == "c":
        if chosen.layer_ops is None:
            pytest.skip("no C compiler here")
        return chosen
    return dataclasses.replace(chosen, layer_ops=None)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_split_is_bit_identical_to_the_torch_rotation(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    tokens, num_heads, kv_heads = 37, 9, 3
    rope = rotary.tables(torch.randint(0, 512, (tokens,), generator=gen), dtype)
    # q and k heads as the fused qkv projection leaves them: a strided view, v after them
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * 64, generator=gen, dtype=dtype)
    qk = qkv[:, :(num_heads + kv_heads) * 64].view(tokens, -1, 64)
    q, k = ops.rotate_split(qk, rope.cos, rope.sin, num_heads)
    reference = rotate(qk, rope.cos, rope.sin)
    assert q.is_contiguous() and q.shape == (tokens, num_heads, 64)
    assert torch.equal(q, reference[:, :num_heads])
    assert torch.equal(k, reference[:, num_heads:])
    q_torch, k_torch = TORCH_OPS.rotate_split(qk, rope.cos, rope.sin, num_heads)
    assert torch.equal(q, q_torch) and torch.equal(k, k_torch)


def test_float32_norm_equals_transformers_to_rounding(ops):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(torch.randn(576, generator=gen))
    norm.use_cpu_ops(ops)
    for rows in (1, 33, 300):
        x = torch.randn(rows, 576, generator=gen) * 3
        ours, ref = norm(x), hf_rms_norm(x, norm.weight, 1e-5)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_float64_and_strided_norms_keep_the_torch_ops(ops):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(64, 1e-6).to(torch.float64)
    norm.weight.data.copy_(torch.randn(64, generator=gen, dtype=torch.float64))
    norm.use_cpu_ops(ops)
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))
    norm32 = RMSNorm(64, 1e-6)
    norm32.weight.data.copy_(torch.randn(64, generator=gen))
    norm32.use_cpu_ops(ops)
    strided = torch.randn(5, 128, generator=gen)[:, ::2]
    assert torch.equal(norm32(strided), hf_rms_norm(strided, norm32.weight, 1e-6))


def test_torch_ops_are_transformers_own():
    """`TORCH_OPS` (every model's before a CPU worker hands it its ops): the norm bit for bit."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(7, 96, generator=gen), torch.randn(96, generator=gen)
    assert torch.equal(TORCH_OPS.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))
