"""The decode-graph bookkeeping (static buffers, padding to a ladder size, slicing the
output) checked on CPU: the capture itself needs CUDA, so this unit test of DecodeGraphs
swaps `_capture_one` for an eager stand-in that recomputes the same static forward on
replay. The CPU backend needs a per-step plan (a capturable one needs none), so the stand-in
prepares it from the static buffers at each replay. Tokens must equal the plain eager
runner's."""

import pytest

from tidal.ipc.messages import SamplingParams
from tidal.workers.cuda_graphs import DecodeGraphs, batch_size_ladder
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config


class _EagerReplay:
    """Stands in for a CUDAGraph: replay() reruns the forward into the static output."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())

    def pool(self):
        return None


class _CpuDecodeGraphs(DecodeGraphs):
    num_replays = 0

    def _capture_one(self, size, pool):
        args = (self.input_ids[:size], self.positions[:size], self.runner.kv_caches)
        meta = self._meta(size)

        def forward():
            return self.runner.model(*args, self.runner.attention_inputs(meta))

        out = forward().clone()
        return _EagerReplay(forward, out), out

    def run(self, inputs):
        self.num_replays += 1
        return super().run(inputs)


def test_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_ladder(256)[-3:] == [192, 224, 256]
    assert batch_size_ladder(4096)[-1] == 512


def _generate(worker: Worker, first_block: int) -> dict:
    script = PlanScript(first_block=first_block)
    for i, n in enumerate((3, 18, 7)):  # 3 decodes pad to the size-4 graph
        script.add(f"g{i}", list(range(10 + i, 10 + i + n)),
                   SamplingParams(temperature=0.0, max_tokens=6))
    return script.run(worker)


@pytest.fixture
def graph_worker(tiny_llama):
    worker = Worker(worker_config(tiny_llama, max_num_seqs=5))
    worker.load()
    worker.init_kv_cache(64)
    graphs = _CpuDecodeGraphs(worker.runner, batch_size_ladder(5))
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 5]
    return worker, graphs


def test_graph_replay_equals_eager(graph_worker):
    worker, graphs = graph_worker
    eager = _generate(worker, first_block=1)
    worker.runner.graphs = graphs
    with_graphs = _generate(worker, first_block=30)
    assert graphs.num_replays == 5  # every decode step of the 3 requests, none of the prefill
    assert with_graphs == eager
