"""The data-parallel router's bookkeeping without processes: its sockets are recorders, its
cores fake daemons, and frames are fed to it as they would arrive. Placement itself is in
test_dp_placement.py; the real process tree in tests/e2e/test_data_parallel.py."""

from __future__ import annotations

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig
from tidal.engine_core.dp_router import MAX_CORE_RESTARTS, Router, _Core
from tidal.engine_core.supervisor import Supervisor
from tidal.ipc.frontend_messages import (
    Abort,
    AddRequest,
    EngineCoreOutput,
    EngineInfo,
    EngineOutputs,
    FinishReason,
    Goodbye,
    Hello,
    SchedulerStats,
    StatsQuery,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids
from tidal.ipc.transport import CoreToFrontendDecoder, FrontendDecoder, encode


class CoreSocket:
    """What the router sent one core, decoded."""

    def __init__(self) -> None:
        self.sent = []
        self._decoder = FrontendDecoder()

    def send(self, frame) -> None:
        self.sent.append(self._decoder.decode(frame))

    def close(self, linger=None) -> None:
        pass

    def take(self, kind):
        found = [m for m in self.sent if isinstance(m, kind)]
        self.sent = [m for m in self.sent if not isinstance(m, kind)]
        return found


class FrontendSocket:
    """What the router sent each frontend, decoded."""

    def __init__(self) -> None:
        self.sent: dict[str, list] = {}
        self._decoder = CoreToFrontendDecoder()

    def send_multipart(self, frames, copy=True) -> None:
        self.sent.setdefault(frames[0].decode(), []).append(self._decoder.decode(frames[1]))

    def outputs(self, client_id: str) -> list[EngineCoreOutput]:
        return [o for m in self.sent.get(client_id, []) if isinstance(m, EngineOutputs)
                for o in m.outputs]


class FakeDaemon:
    address = "ipc:///nowhere"

    def __init__(self) -> None:
        self.running = True

    def alive(self) -> bool:
        return self.running

    def failure_message(self, what: str) -> str:
        return what

    def kill(self) -> None:
        self.running = False

    def stop(self) -> None:
        self.running = False


INFO = EngineInfo(model="m", max_model_len=64, num_kv_blocks=10, block_size=4,
                  max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture
def router():
    config = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2))
    r = Router(config, "ipc:///nowhere")
    r.port.sock = FrontendSocket()
    r._connect = lambda index, supervisor: _Core(index, supervisor, CoreSocket(),
                                                 f"router-{index}")
    r.cores = [r._connect(i, started(Supervisor(f"engine core {i}", FakeDaemon,
                                                MAX_CORE_RESTARTS)))
               for i in range(2)]
    for core in r.cores:
        r._on_core_info(core, INFO)
    r.info = r._merged_info()
    r.port.ready(r.info)
    for client_id in ("a", "b"):
        frontend_says(r, client_id, Hello(client_id))
    yield r
    r.ctx.term()


def started(supervisor: Supervisor) -> Supervisor:
    supervisor.start()
    return supervisor


def frontend_says(router: Router, client_id: str, msg) -> None:
    router.port.on_frames([client_id.encode(), encode(msg)])


def core_says(router: Router, index: int, *outputs: EngineCoreOutput, stats=None) -> None:
    router._on_core_frames(router.cores[index],
                           [encode(EngineOutputs(list(outputs), stats=stats))])


def add(req_id: str, prompt=(5, 6, 7), max_tokens: int = 10) -> AddRequest:
    return AddRequest(req_id, pack_token_ids(list(prompt)),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens))


def token(req_id: str, *ids: int, finish=None) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, pack_token_ids(list(ids)), finish)


def test_merged_info_sums_the_cores_capacity(router):
    assert router.info.num_kv_blocks == 20 and router.info.max_num_seqs == 16
    assert router.port.sock.sent["a"] == [router.info]


def test_each_frontend_gets_only_its_own_outputs(router):
    frontend_says(router, "a", add("ra"))
    frontend_says(router, "b", add("rb", prompt=(9, 9, 9)))
    assert [m.req_id for m in router.cores[0].sock.take(AddRequest)] == ["ra"]
    assert [m.req_id for m in router.cores[1].sock.take(AddRequest)] == ["rb"]
    core_says(router, 0, token("ra", 11))
    core_says(router, 1, token("rb", 12, finish=FinishReason.LENGTH))
    assert [o.req_id for o in router.port.sock.outputs("a")] == ["ra"]
    assert [o.req_id for o in router.port.sock.outputs("b")] == ["rb"]
    assert set(router.routed) == {"ra"}  # rb finished


def test_a_dead_cores_requests_continue_elsewhere_with_their_tokens(router):
    frontend_says(router, "a", add("ra", max_tokens=10))
    core_says(router, 0, token("ra", 11), token("ra", 12))
    router.cores[0].supervisor.child.running = False
    router._watch_cores()
    (moved,) = router.cores[1].sock.take(AddRequest)
    assert moved.req_id == "ra"
    assert unpack_token_ids(moved.prompt_token_ids).tolist() == [5, 6, 7, 11, 12]
    assert moved.num_resumed_tokens == 2
    assert moved.sampling.max_tokens == 8
    assert router.cores[0].supervisor.budget.total == 1 and router.cores[0].info is None
    core_says(router, 1, token("ra", 13))
    assert [unpack_token_ids(o.new_token_ids).tolist() for o in router.port.sock.outputs("a")] \
        == [[11], [12], [13]]


def test_requests_wait_while_no_core_is_live_then_run(router):
    for core in router.cores:
        core.supervisor.child.running = False
    router._watch_cores()
    frontend_says(router, "a", add("ra"))
    assert router.routed["ra"].core is None
    router._on_core_info(router.cores[1], INFO)  # the restarted core answers Hello
    assert [m.req_id for m in router.cores[1].sock.take(AddRequest)] == ["ra"]


def test_aborts_reach_only_the_senders_own_requests(router):
    frontend_says(router, "a", add("ra"))
    frontend_says(router, "b", add("rb", prompt=(9, 9, 9)))
    router.cores[0].sock.take(AddRequest)
    frontend_says(router, "b", Abort(["ra", "rb"]))
    assert router.cores[0].sock.take(Abort) == []
    assert router.cores[1].sock.take(Abort) == [Abort(["rb"])]
    router.cores[1].supervisor.child.running = False  # dies before answering the abort
    router._watch_cores()
    assert router.cores[0].sock.take(AddRequest) == []  # not moved: answered as aborted
    assert router.port.sock.outputs("b")[-1].finish_reason == FinishReason.ABORT
    frontend_says(router, "a", Goodbye("a"))
    assert router.cores[0].sock.take(Abort) == [Abort(["ra"])] and router.routed == {}


def test_a_stats_query_is_answered_with_every_core_and_the_total(router):
    frontend_says(router, "a", StatsQuery("a"))
    assert all(len(c.sock.take(StatsQuery)) == 1 for c in router.cores)
    core_says(router, 0, stats=SchedulerStats(num_running=2, generation_tokens=5))
    assert not any(isinstance(m, EngineOutputs) for m in router.port.sock.sent["a"])
    core_says(router, 1, stats=SchedulerStats(num_running=1, generation_tokens=7))
    (answer,) = [m for m in router.port.sock.sent["a"] if isinstance(m, EngineOutputs)]
    assert (answer.stats.num_running, answer.stats.generation_tokens) == (3, 12)
    assert [c.num_running for c in answer.stats.cores] == [2, 1]
    assert router.placement.loads[0].num_running == 2
