"""The frontend port, as a specification: what the engine core and the data-parallel router
both answer a frontend (engine_core/frontend_port.py). Real ZeroMQ sockets over ipc://; the
process behind the port is a recorder, and the port's clock is a fake one."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from tidal.engine_core.frontend_port import FrontendPort
from tidal.ipc.frontend_messages import (
    Abort,
    AddRequest,
    Detached,
    EngineCoreOutput,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    FinishReason,
    Goodbye,
    Heartbeat,
    Hello,
    SchedulerStats,
    StatsQuery,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.transport import (
    CoreToFrontendDecoder,
    connect_frontend_socket,
    encode,
    ipc_path,
    new_private_address,
)

INFO = EngineInfo(model="m", max_model_len=64, num_kv_blocks=10, block_size=4,
                  max_num_seqs=8, max_num_batched_tokens=64)
TIMEOUT = 10.0


class Owner:
    """The process behind the port: records what the port hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.requests: dict[str, list[str]] = {}  # client_id -> its req_ids

    def add_request(self, client_id, msg, frame) -> None:
        self.calls.append(("add", client_id, msg.req_id))
        self.requests.setdefault(client_id, []).append(msg.req_id)

    def abort(self, client_id, req_ids) -> None:
        self.calls.append(("abort", client_id, req_ids))

    def stats_query(self, client_id, view_since=-1) -> None:
        self.calls.append(("stats", client_id) if view_since < 0
                          else ("stats", client_id, view_since))

    def detach(self, client_id) -> int:
        self.calls.append(("detach", client_id))
        return len(self.requests.pop(client_id, []))

    def drop(self, client_id, reason) -> list[EngineCoreOutput]:
        self.calls.append(("drop", client_id))
        return [EngineCoreOutput(r, b"", FinishReason.ERROR, error=reason)
                for r in self.requests.pop(client_id, [])]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Frontend:
    """A frontend's DEALER, and what it has heard."""

    def __init__(self, ctx: zmq.Context, address: str, client_id: str) -> None:
        self.client_id = client_id
        self.sock = connect_frontend_socket(ctx, address, client_id)
        self.decoder = CoreToFrontendDecoder()

    def say(self, msg) -> None:
        self.sock.send(encode(msg))

    def hear(self, timeout: float = 2.0):
        """The next message, or None within `timeout` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return self.decoder.decode(self.sock.recv())

    def hears_nothing(self) -> bool:
        return self.hear(timeout=0.2) is None


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def owner():
    return Owner()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def port(ctx, owner, clock):
    port = FrontendPort(owner, new_private_address("port-test"), None, TIMEOUT, ctx, clock)
    port.bind()
    yield port
    port.close()


def pump(port: FrontendPort, frames: int = 1, timeout: float = 2.0) -> None:
    """Let the port handle what `frames` messages from frontends brought."""
    deadline = time.monotonic() + timeout
    handled = 0
    while handled < frames and time.monotonic() < deadline:
        if port.sock.poll(50):
            port.on_frames(port.sock.recv_multipart())
            handled += 1


def attached(ctx, port, client_id: str) -> Frontend:
    """A frontend that said Hello to a ready port and heard its EngineInfo."""
    if port.info is None:
        port.ready(INFO)
    frontend = Frontend(ctx, port.listen, client_id)
    frontend.say(Hello(client_id, "python", 42))
    pump(port)
    assert frontend.hear() == INFO
    return frontend


def add(req_id: str) -> AddRequest:
    return AddRequest(req_id, pack_token_ids([1, 2, 3]), SamplingParams(max_tokens=4))


# -- attaching -------------------------------------------------------------------------------------


def test_hello_attaches_a_frontend_and_is_answered_with_the_engine_info(ctx, port):
    a = attached(ctx, port, "a")
    assert port.frontends["a"].kind == "python" and port.frontends["a"].pid == 42
    a.say(Hello("a"))  # again (a reconnect): answered again, still one frontend
    pump(port)
    assert a.hear() == INFO and list(port.frontends) == ["a"]


def test_while_starting_hellos_wait_for_ready_and_other_frames_are_ignored(ctx, port, owner):
    a = Frontend(ctx, port.listen, "a")
    a.say(Hello("a"))
    a.say(add("early"))
    pump(port, frames=2)
    assert a.hears_nothing() and owner.calls == [] and port.frontends == {}
    port.ready(INFO)
    assert a.hear() == INFO and "a" in port.frontends


def test_a_failed_start_tells_every_frontend_that_knocked(ctx, port):
    a, b = Frontend(ctx, port.listen, "a"), Frontend(ctx, port.listen, "b")
    a.say(Hello("a"))
    pump(port)
    b.say(Hello("b"))  # still queued in the socket: fail_start reads it too
    time.sleep(0.1)
    port.fail_start("engine core failed to start: no weights")
    assert a.hear() == EngineDead("engine core failed to start: no weights")
    assert b.hear() == EngineDead("engine core failed to start: no weights")


# -- serving ---------------------------------------------------------------------------------------


def test_every_heartbeat_is_echoed(ctx, port):
    a = attached(ctx, port, "a")
    a.say(Heartbeat("a"))
    pump(port)
    assert a.hear() == Heartbeat("a")


def test_requests_aborts_and_stats_queries_go_to_the_owner_with_their_sender(ctx, port, owner):
    a = attached(ctx, port, "a")
    for msg in (add("r1"), Abort(["r1", "other"]), StatsQuery("a"), StatsQuery("a", 7)):
        a.say(msg)
    pump(port, frames=4)
    assert owner.calls == [("add", "a", "r1"), ("abort", "a", ["r1", "other"]), ("stats", "a"),
                           ("stats", "a", 7)]  # the live view's steps after step 7


def test_an_add_request_that_does_not_decode_is_refused_to_its_sender_alone(ctx, port, owner):
    a, b = attached(ctx, port, "a"), attached(ctx, port, "b")
    wire = msgspec.msgpack.decode(encode(add("bad")))
    wire[3][0] = "many"  # sampling.n
    a.sock.send(msgspec.msgpack.encode(wire))
    pump(port)
    (out,) = a.hear().outputs
    assert (out.req_id, out.finish_reason, out.refused) == ("bad", FinishReason.ERROR, True)
    assert out.error.startswith("sampling.n: Expected `int`, got `str`")
    assert owner.calls == [] and b.hears_nothing()


def test_outputs_reach_only_the_frontend_that_sent_the_request(ctx, port):
    a, b = attached(ctx, port, "a"), attached(ctx, port, "b")
    port.send_outputs({"a": [EngineCoreOutput("ra", pack_token_ids([7]))],
                       "b": [EngineCoreOutput("rb", pack_token_ids([8]))], "c": []})
    assert [o.req_id for o in a.hear().outputs] == ["ra"]
    assert [o.req_id for o in b.hear().outputs] == ["rb"]
    assert a.hears_nothing() and b.hears_nothing()


def test_stats_go_to_the_askers_still_attached(ctx, port):
    a = attached(ctx, port, "a")
    port.send_stats(["a", "gone"], SchedulerStats(num_running=3))
    answer = a.hear()
    assert isinstance(answer, EngineOutputs) and answer.stats.num_running == 3


# -- frontends that go away ------------------------------------------------------------------------


def test_goodbye_detaches_the_frontend_and_its_requests_are_aborted(ctx, port, owner):
    a = attached(ctx, port, "a")
    a.say(add("r1"))
    a.say(Goodbye("a"))
    pump(port, frames=2)
    assert owner.calls[-1] == ("detach", "a") and port.frontends == {}
    assert a.hears_nothing()


def test_a_silent_frontend_is_dropped_its_requests_failed_then_detached(ctx, port, owner,
                                                                         clock):
    a, b = attached(ctx, port, "a"), attached(ctx, port, "b")
    a.say(add("r1"))
    pump(port)
    clock.now += TIMEOUT / 2
    b.say(Heartbeat("b"))  # b speaks; a stays silent
    pump(port)
    assert b.hear() == Heartbeat("b")
    assert port.seconds_to_next_expiry(most=60.0) == pytest.approx(TIMEOUT / 2)
    clock.now += TIMEOUT / 2 + 0.1
    port.expire_silent()
    (failed,) = a.hear().outputs
    assert failed.req_id == "r1" and failed.finish_reason == FinishReason.ERROR
    assert "was silent for 10.1 s (--frontend-timeout 10 s)" in failed.error
    detached = a.hear()
    assert isinstance(detached, Detached) and detached.reason == failed.error
    assert list(port.frontends) == ["b"] and b.hears_nothing()


def test_a_frontend_the_port_does_not_know_is_told_detached_never_served(ctx, port, owner):
    port.ready(INFO)
    stranger = Frontend(ctx, port.listen, "stranger")  # dropped, or attached to an older core
    stranger.say(add("r1"))
    pump(port)
    (error,) = stranger.hear().outputs
    assert error.req_id == "r1" and error.finish_reason == FinishReason.ERROR
    assert "say Hello" in error.error and isinstance(stranger.hear(), Detached)
    stranger.say(Abort(["r1"]))
    pump(port)
    assert isinstance(stranger.hear(), Detached)
    stranger.say(Goodbye("stranger"))  # leaving: nothing to answer
    pump(port)
    assert stranger.hears_nothing() and owner.calls == [] and port.frontends == {}


def test_engine_dead_is_broadcast_to_every_attached_frontend(ctx, port):
    a, b = attached(ctx, port, "a"), attached(ctx, port, "b")
    port.broadcast(EngineDead("engine core shut down (SIGTERM)"))
    assert a.hear() == b.hear() == EngineDead("engine core shut down (SIGTERM)")


# -- the socket ------------------------------------------------------------------------------------


def test_an_address_in_use_is_refused_and_close_removes_the_socket_file(ctx, port, owner):
    other = FrontendPort(owner, port.listen, None, TIMEOUT, ctx)
    with pytest.raises(ValueError, match="already listening"):
        other.bind()
    path = ipc_path(port.listen)
    assert os.path.exists(path)
    port.close()
    assert not os.path.exists(path)


def test_the_timeout_must_be_positive(owner):
    with pytest.raises(ValueError, match="frontend_timeout"):
        FrontendPort(owner, "ipc:///nowhere", frontend_timeout=0)
