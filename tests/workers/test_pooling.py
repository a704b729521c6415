"""The worker's pooling (`workers/pooling.py`): a prompt split over steps pools to what the
whole prompt's hidden states give; Matryoshka truncation comes before normalisation; an
embedding checkpoint's tensor names map onto the decoder's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.ipc.pooling import PoolingParams, unpack_floats
from tidal.workers.pooling import PoolingRequests, embedding_checkpoint_name, embedding_config


def pool_in_chunks(kind: str, hidden: torch.Tensor, chunks: list[int],
                   dimensions: int | None = None, normalize: bool = False) -> np.ndarray:
    """Feed one request's hidden states [prompt_len, H] chunk by chunk, each step with
    another request's rows in front, as a batch holds them."""
    prompt_len = hidden.shape[0]
    pooling = PoolingRequests(hidden.shape[1])
    pooling.add("other", PoolingParams("LAST", False))
    pooling.add("r", PoolingParams(kind, normalize, dimensions))
    start, out = 0, []
    for size in chunks:
        step = torch.cat([torch.randn(3, hidden.shape[1]), hidden[start:start + size]])
        segments = pooling.plan(["other", "r"], np.array([5, start]),
                                np.array([8, start + size]), np.array([100, prompt_len]),
                                np.array([0, 3, 3 + size]))
        out += [o for o in pooling.pool(step, segments) if o.req_id == "r"]
        start += size
    assert len(out) == 1 and "r" not in pooling.partial
    return np.array(unpack_floats(out[0].data))


@pytest.mark.parametrize("kind, expected", [
    ("LAST", lambda h: h[-1]), ("MEAN", lambda h: h.mean(0)), ("CLS", lambda h: h[0])])
def test_chunks_pool_as_the_whole_prompt(kind, expected):
    torch.manual_seed(0)
    hidden = torch.randn(23, 8)
    for chunks in ([23], [7, 7, 9], [1] * 23):
        got = pool_in_chunks(kind, hidden, chunks)
        np.testing.assert_allclose(got, expected(hidden).numpy(), rtol=1e-5, atol=1e-6)


def test_dimensions_truncate_then_normalise():
    torch.manual_seed(1)
    hidden = torch.randn(5, 8)
    got = pool_in_chunks("LAST", hidden, [2, 3], dimensions=4, normalize=True)
    want = torch.nn.functional.normalize(hidden[-1, :4], dim=0).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert abs(np.linalg.norm(got) - 1) < 1e-6


def test_embedding_checkpoint_names():
    assert embedding_checkpoint_name("layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert embedding_checkpoint_name("model.norm.weight") == "model.norm.weight"
    assert embedding_checkpoint_name("norm.weight") == "model.norm.weight"
    assert embedding_checkpoint_name("lm_head.weight") is None
    assert embedding_config({"architectures": ["Qwen3Model"]})["architectures"] == \
        ["Qwen3ForCausalLM"]
