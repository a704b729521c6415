"""/v1/embeddings' own parts (frontend/server/embeddings.py), without an engine: the 400 on a
server that generates, the inputs' shapes, base64 as float32 little-endian bytes."""

from __future__ import annotations

import asyncio
import base64
import struct
from types import SimpleNamespace

import pytest

from tidal.frontend.server.embeddings import (
    EmbeddingRequest, _encode_vector, _inputs, create_embedding,
)
from tidal.frontend.server.errors import APIError


def test_a_generating_server_refuses_embeddings():
    serving = SimpleNamespace(check_model=lambda model: "m",
                              engine=SimpleNamespace(engine_info=SimpleNamespace(pooler=None)))
    with pytest.raises(APIError) as err:
        asyncio.run(create_embedding(serving, EmbeddingRequest(input="hi"), None))
    assert err.value.status == 400 and "does not support Embeddings API" in str(err.value)


def test_inputs():
    assert _inputs("a") == ["a"]
    assert _inputs([1, 2]) == [[1, 2]]
    assert _inputs([[1], [2, 3]]) == [[1], [2, 3]]
    assert _inputs(["a", "b"]) == ["a", "b"]
    with pytest.raises(APIError, match="input must not be empty"):
        _inputs([])


def test_base64_is_float32_little_endian():
    vector = [0.5, -1.25, 3.0]
    data = base64.b64decode(_encode_vector(vector, "base64"))
    assert list(struct.unpack("<3f", data)) == vector
    assert _encode_vector(vector, "float") is vector
