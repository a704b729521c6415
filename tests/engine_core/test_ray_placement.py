"""The Ray executor's decisions that need no cluster: how many rank bundles the nodes hold,
and a clear error when ray is not installed (the cluster tests: tests/e2e/test_ray_executor.py)."""

import sys

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig
from tidal.engine_core.core import make_executor
from tidal.engine_core.executor import WorkerError
from tidal.engine_core.ray_executor import _bundles_that_fit


def _node(alive=True, **resources):
    return {"Alive": alive, "Resources": resources}


def test_bundles_that_fit_count_whole_bundles_on_alive_nodes_only():
    nodes = [_node(CPU=4.0, GPU=1.0), _node(CPU=3.0), _node(alive=False, CPU=64.0)]
    assert _bundles_that_fit(nodes, {"CPU": 2.0}) == 2 + 1
    assert _bundles_that_fit(nodes, {"GPU": 1.0}) == 1
    assert _bundles_that_fit(nodes, {"CPU": 8.0}) == 0


def test_ray_backend_without_ray_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    config = EngineConfig(ModelConfig("m"),
                          parallel=ParallelConfig(distributed_executor_backend="ray"))
    with pytest.raises(WorkerError, match=r"pip install 'tidal\[ray\]'"):
        make_executor(config, max_model_len=64)
