"""Issue 16, item 3: bfloat16 and float16 checkpoints on the CPU.

`--dtype auto` on the CPU: a float16 checkpoint computes in float32 (its weights convert
exactly); a bfloat16 one computes in bfloat16 where torch finds AVX512_BF16 or AMX, else in
float32 (`workers.worker.resolve_dtype` says why).

Tolerances against transformers, on the same checkpoint, logits of a 100-token prompt:
- computing in float32 (a float16 checkpoint; a bfloat16 one with --dtype float32 or on a CPU
  without bfloat16): max |diff| / max |ref| below 1e-5 against transformers in float32, as
  for float32 folders (measured 0: both widen the same weights and sum alike);
- computing in bfloat16: within twice transformers' own bfloat16 error (its bfloat16 logits
  against its float32 ones), and below 0.1. Measured on the tiny Llama: tidal 2.9e-2 against
  transformers' 3.7e-2 (Qwen2 3.3e-2 / 3.7e-2, Qwen3 2.5e-2 / 1.7e-2).
"""

import pytest
import torch

from tidal.workers.worker import DTYPES, cpu_has_native_bf16, resolve_dtype

from worker_test_utils import chunked_logits, hf_logits, loaded_worker, prompt_ids, rel_err

CPU = torch.device("cpu")
FLOAT32_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def checkpoint(request, tiny_model_factory):
    """(dtype name, folder) of a tiny Llama saved in that dtype."""
    return request.param, tiny_model_factory("llama", dtype=request.param)


@pytest.fixture(scope="module")
def hf_float32(checkpoint):
    dtype, path = checkpoint
    return hf_logits(path, "float32", prompt_ids())


def test_the_fixture_is_saved_in_its_dtype(checkpoint):
    from safetensors import safe_open

    dtype, path = checkpoint
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {{"bfloat16": "BF16", "float16": "F16"}[dtype]}


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_the_cpu(monkeypatch, native):
    monkeypatch.setattr("tidal.workers.worker.cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", {"dtype": "float16"}, CPU) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, CPU) == \
        (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", {"dtype": "float32"}, CPU) == torch.float32
    assert resolve_dtype("auto", {}, CPU) == torch.float32
    # an explicit dtype is taken as given
    assert resolve_dtype("bfloat16", {"dtype": "float16"}, CPU) == torch.bfloat16
    assert resolve_dtype("float16", {"dtype": "bfloat16"}, CPU) == torch.float16


def test_auto_dtype_elsewhere_keeps_the_checkpoints():
    cuda = torch.device("cuda", 0)  # resolve_dtype only looks at the device type
    assert resolve_dtype("auto", {"dtype": "float16"}, cuda) == torch.float16
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, cuda) == torch.bfloat16


def test_auto_loads_and_matches_transformers(checkpoint, hf_float32):
    dtype, path = checkpoint
    worker = loaded_worker(path, "auto")
    expected = torch.bfloat16 if dtype == "bfloat16" and cpu_has_native_bf16() else torch.float32
    assert worker.dtype == expected
    assert {p.dtype for p in worker.runner.model.parameters()} == {expected}
    ours = chunked_logits(worker, prompt_ids(), 40, "a")  # chunked prefill: 40 + 40 + 20
    err = rel_err(ours, hf_float32)
    if expected == torch.float32:
        assert err < FLOAT32_TOLERANCE, err
    else:
        hf_own = rel_err(hf_logits(path, dtype, prompt_ids()), hf_float32)
        assert err < min(2 * hf_own, 0.1), (err, hf_own)


def test_float32_on_request_matches_transformers(checkpoint, hf_float32):
    dtype, path = checkpoint
    worker = loaded_worker(path, "float32")
    assert worker.dtype == torch.float32
    ours = chunked_logits(worker, prompt_ids(), 1000, "a")
    assert rel_err(ours, hf_float32) < FLOAT32_TOLERANCE


def test_dtype_names_are_the_configs():
    from tidal.engine_core.config import DTYPES as FLAG_DTYPES

    assert set(DTYPES) | {"auto"} == set(FLAG_DTYPES)
