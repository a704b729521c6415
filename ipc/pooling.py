"""Embeddings on the wire: a request's pooling parameters, the engine's pooler, one vector.

A pooling request (`AddRequest.pooling`) is a prefill that ends when its last prompt token is
computed: the last-stage worker pools the final hidden states (the model's final norm
applied, no LM head) of that request's prompt into one vector and sends it back as float32
bytes (`PooledOutput`); there is no sampling and the request keeps no KV blocks after it.

    pooling_type  which hidden states make the vector
        LAST      the last prompt token's (decoder embedding models: Qwen3-Embedding)
        MEAN      the mean over every prompt token's
        CLS       the first prompt token's
    dimensions    keep the first N numbers (Matryoshka), before normalising
    normalize     divide by the L2 norm

The engine decides its pooler once (`PoolerInfo`, in `EngineInfo.pooler`): the defaults a
request's unset fields take and whether the model was trained for shorter vectors
(Matryoshka, as vLLM reads it from config.json: `matryoshka_dimensions` or `is_matryoshka`).
"""

from __future__ import annotations

import sys
from array import array

import msgspec

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


class PoolingParams(msgspec.Struct, **_STRUCT):
    """How one request's prompt becomes one vector (vLLM's `PoolingParams`, plus the pooling
    type of its `--pooler-config`). A field left None takes the engine's (`PoolerInfo`)."""

    pooling_type: str | None = None
    """LAST, MEAN or CLS (see the module docstring); None: the engine's."""
    normalize: bool | None = None
    """Divide the vector by its L2 norm; None: the engine's."""
    dimensions: int | None = None
    """Keep the first `dimensions` numbers, then normalise (Matryoshka models only)."""

    def __post_init__(self) -> None:
        _check(self.pooling_type is None or self.pooling_type in POOLING_TYPES,
               "pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got "
               f"{self.pooling_type!r}")
        _check(self.dimensions is None or self.dimensions >= 1, "dimensions",
               f"must be at least 1, got {self.dimensions}")


class PoolerInfo(msgspec.Struct, **_STRUCT):
    """The engine's pooler (`--runner pooling`), in `EngineInfo.pooler`: the defaults and
    limits every pooling request is resolved against."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    """Length of the model's vector (its hidden size): the largest `dimensions`."""
    is_matryoshka: bool = False
    """config.json declares Matryoshka dimensions (`matryoshka_dimensions`, or
    `is_matryoshka: true`): only then may a request ask for fewer `dimensions`."""
    matryoshka_dimensions: list[int] | None = None
    """The only `dimensions` allowed, when config.json lists them."""
    model_name: str = ""
    """For error messages (vLLM's wording names the model)."""

    def resolve(self, params: PoolingParams | None) -> PoolingParams:
        """`params` with every unset field taken from the engine's; ValueError naming
        `dimensions` when the model does not allow that length (vLLM's rules: a model
        without Matryoshka dimensions takes none, one that lists them takes only those)."""
        params = params or PoolingParams()
        dims = params.dimensions
        if dims is not None:
            name = self.model_name or "this model"
            if not self.is_matryoshka:
                raise ValueError(f"dimensions: model {name!r} does not support matryoshka "
                                 "representation, changing output dimensions will lead to "
                                 "poor results.")
            if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions: model {name!r} only supports "
                                 f"{self.matryoshka_dimensions} matryoshka dimensions, "
                                 f"got {dims}")
            if dims > self.hidden_size:
                raise ValueError(f"dimensions must be at most the model's hidden size "
                                 f"{self.hidden_size}, got {dims}")
        return PoolingParams(
            params.pooling_type or self.pooling_type,
            self.normalize if params.normalize is None else params.normalize,
            dims)


class PooledOutput(msgspec.Struct, **_STRUCT):
    """One request's vector (`SampledTokens.pooled`): little-endian float32 bytes."""

    req_id: str
    data: bytes


_LITTLE = sys.byteorder == "little"


def unpack_floats(data: bytes) -> list[float]:
    """Little-endian float32 bytes (a `PooledOutput`'s, an `EngineCoreOutput.pooled`) as
    Python floats."""
    values = array("f")
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values.tolist()
