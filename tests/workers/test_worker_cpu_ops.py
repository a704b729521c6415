"""A CPU worker takes its ops from the CPU op seam once at load (`kernels/cpu/ops.py`,
`cpu_kernels`) and logs them in one line; every choice, and a machine without a C compiler,
gives transformers' logits and the same greedy tokens as `auto`."""

import logging

import pytest

from tidal.ipc.messages import SamplingParams
from tidal.kernels.cpu import native
from tidal.workers.layers import GemmLayer, RMSNorm
from worker_test_utils import (
    PlanScript,
    chunked_logits,
    hf_logits,
    loaded_worker,
    prompt_ids,
    rel_err,
)

START_UP = "tidal.workers.worker"


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def cpu_ops_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == START_UP and "CPU ops (" in r.getMessage()]


def greedy(worker) -> dict:
    script = PlanScript()
    for i, n in enumerate((3, 40, 17)):
        script.add(f"r{i}", prompt_ids(seed=i, n=n),
                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    return script.run(worker, chunk=16)


def test_the_worker_logs_its_cpu_ops_in_one_line(llama, caplog):
    with caplog.at_level(logging.INFO, logger=START_UP):
        worker = loaded_worker(llama, "float32")
    (line,) = cpu_ops_lines(caplog)
    text = line.getMessage()
    assert text.startswith("rank 0: CPU ops (cpu_kernels=auto): C built: ")
    gemms = sum(isinstance(m, GemmLayer) for m in worker.runner.model.modules())
    assert f"{gemms} linear layers on the small-batch GEMMs" in text  # float32: all of them
    assert worker.runner.model.model.norm.ops.choice.spec == "auto"


def test_torch_ops_are_transformers_and_sample_what_auto_samples(llama, caplog):
    """`cpu_kernels=torch`: F.linear and torch's norm and rotation everywhere."""
    with caplog.at_level(logging.INFO, logger=START_UP):
        worker = loaded_worker(llama, "float32", cpu_kernels="torch")
    assert "cpu_kernels=torch" in cpu_ops_lines(caplog)[0].getMessage()
    model = worker.runner.model
    assert all(m.cpu_gemm is None for m in model.modules() if isinstance(m, GemmLayer))
    assert all(not m.ops.choice.kernels for m in model.modules() if isinstance(m, RMSNorm))
    assert model.model.fused is None
    tokens = prompt_ids()
    ours = chunked_logits(worker, tokens, 7, req_id="t")
    assert rel_err(ours, hf_logits(llama, "float32", tokens)) < 1e-5
    worker.runner.batch.remove("t")
    assert greedy(worker) == greedy(loaded_worker(llama, "float32"))


def test_without_a_compiler_a_warning_and_the_same_tokens(llama, caplog, monkeypatch, tmp_path):
    """CC pointing at no compiler: the worker still loads, on oneDNN and numba (attention
    too), says so in a WARNING naming the slower paths, and samples what `auto` samples."""
    with_compiler = greedy(loaded_worker(llama, "float32"))
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger=START_UP):
        worker = loaded_worker(llama, "float32")
    (line,) = cpu_ops_lines(caplog)
    assert line.levelno == logging.WARNING
    assert "no C compiler" in line.getMessage() and "small batches take oneDNN" in line.getMessage()
    assert worker.runner.attention_backend.name == "numba"
    assert greedy(worker) == with_compiler
