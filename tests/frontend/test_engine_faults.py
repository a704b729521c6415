"""`AsyncLLM` against a scripted engine core (a bare ROUTER, no model): when the core drops the
frontend or goes away, pending requests wait, suspended, and are resubmitted (prompt plus
the tokens delivered) to a core that comes back at the same address, or end with an error
after --engine-restart-timeout; requests the core ended itself are not resubmitted; new
requests are refused with `EngineUnavailable` while no core is attached; a core serving
another model is not attached."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tidal.frontend.async_llm import AsyncLLM, EngineUnavailable, run
from tidal.ipc.frontend_messages import (
    Abort,
    AddRequest,
    Detached,
    EngineCoreOutput,
    EngineInfo,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Hello,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids
from tidal.ipc.transport import FrontendDecoder, encode, new_private_address

LONG = SamplingParams(temperature=0.0, max_tokens=100)
WAIT_S = 10.0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from tiny_models import make_tokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


class FakeCore:
    """A ROUTER at `address`: answers Hello with EngineInfo (heartbeats every 0.1 s, silence
    tolerated for 1 s), echoes heartbeats, and keeps every other frame, decoded, in
    `received` as (client identity, message). While `stopped` it reads nothing (frames
    queue, as for a SIGSTOPped process)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, model: str):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.info = EngineInfo(model, 256, 64, 16, 8, 256, tokenizer=model,
                               heartbeat_interval=0.1, frontend_timeout=1.0)
        self.stopped = False
        self.received: list[tuple[bytes, object]] = []
        self.num_hellos = 0
        self._decoder = FrontendDecoder()
        self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            while self.stopped:
                await asyncio.sleep(0.02)
            identity, frame = await self.sock.recv_multipart()
            msg = self._decoder.decode(frame)
            if isinstance(msg, Hello):
                self.num_hellos += 1
                await self.sock.send_multipart([identity, encode(self.info)])
            elif isinstance(msg, Heartbeat):
                await self.sock.send_multipart([identity, frame])
            else:
                self.received.append((identity, msg))

    def send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, encode(msg)])

    async def next_request(self) -> tuple[bytes, AddRequest]:
        """The identity and the AddRequest of the next request a frontend sends."""
        while True:
            for i, (identity, msg) in enumerate(self.received):
                if isinstance(msg, AddRequest):
                    del self.received[i]
                    return identity, msg
            await asyncio.sleep(0.01)

    def aborted(self) -> set[str]:
        return {rid for _, m in self.received if isinstance(m, Abort) for rid in m.req_ids}

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)


def token(req_id: str, finish: FinishReason | None = None, error: str | None = None):
    return EngineOutputs([EngineCoreOutput(req_id, pack_token_ids([] if error else [65]), finish,
                                           error=error)])


async def until(predicate, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def started_stream(llm: AsyncLLM, core: FakeCore):
    """A generate() stream whose first token has arrived; (stream, identity, engine id)."""
    stream = llm.generate([5, 6, 7], LONG).__aiter__()
    first = asyncio.ensure_future(stream.__anext__())
    identity, add = await core.next_request()
    core.send(identity, token(add.req_id))
    assert (await first).outputs[0].token_ids == [65]
    return stream, identity, add.req_id


async def last_output(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def finishes_normally(llm: AsyncLLM, core: FakeCore) -> None:
    gen = asyncio.ensure_future(llm.generate_final([9, 9], LONG))
    identity, add = await core.next_request()
    core.send(identity, token(add.req_id, FinishReason.LENGTH))
    assert (await asyncio.wait_for(gen, WAIT_S)).outputs[0].finish_reason == "length"


def with_core(tokenizer_dir: str, body, address: str | None = None, **llm_args):
    """Run `body(llm, core, ctx, address)` on uvloop: a FakeCore and an AsyncLLM attached."""
    address = address or new_private_address("fake-core")

    async def main():
        ctx = zmq.asyncio.Context()
        core = FakeCore(ctx, address, tokenizer_dir)
        llm = await AsyncLLM.create(engine=address, startup_timeout=WAIT_S, **llm_args)
        try:
            return await asyncio.wait_for(body(llm, core, ctx, address), 3 * WAIT_S)
        finally:
            await llm.close()
            await core.close()
            ctx.term()

    return run(main())


@pytest.mark.timeout(60)
def test_dropped_frontend_fails_what_it_had_and_serves_again(tokenizer_dir):
    """What the daemon does after --frontend-timeout: ERROR outputs, then Detached. The
    stream ends with the core's message, the frontend says Hello again and serves."""

    async def body(llm, core, ctx, address):
        stream, identity, req_id = await started_stream(llm, core)
        reason = "silent for 3.0 s (--frontend-timeout 2 s)"
        core.send(identity, token(req_id, FinishReason.ERROR, error=reason))
        core.send(identity, Detached(reason))
        last = await asyncio.wait_for(last_output(stream), WAIT_S)
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert last.outputs[0].error == reason
        await until(lambda: core.num_hellos == 2 and llm.attached, "the new Hello")
        await finishes_normally(llm, core)

    with_core(tokenizer_dir, body)


async def resumes(stream, core: FakeCore, req_id: str) -> None:
    """The suspended stream's request comes back to `core` as prompt + the delivered token,
    with one token less to go, and its stream goes on to the end."""
    identity, add = await asyncio.wait_for(core.next_request(), WAIT_S)
    assert add.req_id != req_id and add.req_id.startswith(req_id)
    assert unpack_token_ids(add.prompt_token_ids).tolist() == [5, 6, 7, 65]
    assert add.sampling.max_tokens == LONG.max_tokens - 1
    core.send(identity, token(add.req_id, FinishReason.LENGTH))
    last = await asyncio.wait_for(last_output(stream), WAIT_S)
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].token_ids == [65, 65]


@pytest.mark.timeout(60)
def test_detached_alone_suspends_aborts_resubmits_and_ignores_repeats(tokenizer_dir):
    """A core that forgot us says only Detached (one per frame we sent before our Hello):
    the pending request's old id is aborted, the repeats change nothing, and on re-attach it
    is resubmitted and finishes."""

    async def body(llm, core, ctx, address):
        stream, identity, req_id = await started_stream(llm, core)
        core.send(identity, Detached("unknown frontend"))
        core.send(identity, Detached("unknown frontend"))  # answered before our Hello
        await resumes(stream, core, req_id)
        assert llm.attached and req_id in core.aborted()
        await finishes_normally(llm, core)
        assert core.num_hellos == 2

    with_core(tokenizer_dir, body)


@pytest.mark.timeout(60)
def test_core_gone_then_back_at_the_same_address(tokenizer_dir):
    async def body(llm, core, ctx, address):
        stream, identity, req_id = await started_stream(llm, core)
        await core.close()  # the core dies without a word
        await until(lambda: not llm.attached, "the lost connection")
        assert not llm.dead and llm.num_unfinished_requests() == 1
        with pytest.raises(EngineUnavailable, match="re-attaches"):
            await llm.generate_final([1, 2], LONG)
        with pytest.raises(EngineUnavailable):
            await llm.get_stats()
        new_core = FakeCore(ctx, address, core.info.model)
        try:
            await resumes(stream, new_core, req_id)
            await finishes_normally(llm, new_core)
        finally:
            await new_core.close()

    with_core(tokenizer_dir, body)


@pytest.mark.timeout(60)
def test_a_silent_core_is_lost_and_a_core_that_answers_again_gets_the_requests(tokenizer_dir):
    """A core that echoes no heartbeat for its frontend_timeout (1 s here: stopped, or
    hung) is taken as lost, though its connection stands: the request is suspended and, once
    the core answers a Hello again, resubmitted. An echoing core is never taken as lost."""

    async def body(llm, core, ctx, address):
        stream, identity, req_id = await started_stream(llm, core)
        await asyncio.sleep(1.5)  # longer than frontend_timeout, heartbeats echoed
        assert llm.attached and core.num_hellos == 1
        core.stopped = True
        await until(lambda: not llm.attached, "the silent core to be taken as lost")
        assert "stopped or hung" in llm.away_reason
        core.stopped = False  # SIGCONT: it reads the Abort and the Hello that queued
        await resumes(stream, core, req_id)
        assert req_id in core.aborted()

    with_core(tokenizer_dir, body)


@pytest.mark.timeout(60)
def test_no_core_within_the_restart_timeout_fails_pending(tokenizer_dir):
    async def body(llm, core, ctx, address):
        stream, identity, req_id = await started_stream(llm, core)
        await core.close()
        last = await asyncio.wait_for(last_output(stream), WAIT_S)
        assert last.outputs[0].finish_reason == "error"
        assert "within 0.5 s" in last.outputs[0].error
        assert not llm.attached and not llm.dead

    with_core(tokenizer_dir, body, engine_restart_timeout=0.5)


@pytest.mark.timeout(60)
def test_a_core_serving_another_model_is_not_attached(tokenizer_dir):
    async def body(llm, core, ctx, address):
        await core.close()
        await until(lambda: not llm.attached, "the lost connection")
        other = FakeCore(ctx, address, "/models/another")
        try:
            await until(lambda: other.num_hellos >= 1, "the Hello to the new core")
            await asyncio.sleep(0.3)
            assert not llm.attached
            with pytest.raises(EngineUnavailable, match="another"):
                await llm.generate_final([1, 2], LONG)
        finally:
            await other.close()

    with_core(tokenizer_dir, body)


@pytest.mark.timeout(30)
def test_the_supervisors_liveness_watch_sees_a_silent_core_and_not_an_echoing_one():
    """`tidal serve`'s supervisor beats like a frontend (CoreLiveness): while the core echoes,
    `silent()` stays None; once it stops (SIGSTOP), `silent()` reports it after the core's
    frontend_timeout. A stall of the watcher's own is not taken for the core's."""
    import time

    from tidal.frontend.engine_client import CoreLiveness
    from tidal.ipc.heartbeat import stalled_since_last_beat

    address = new_private_address("liveness")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    info = EngineInfo("m", 256, 64, 16, 8, 256, heartbeat_interval=0.05, frontend_timeout=0.5)
    watch = CoreLiveness(address)
    decoder = FrontendDecoder()

    def serve_for(seconds: float, answering: bool) -> list:
        reports, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            while answering and router.poll(0):
                identity, frame = router.recv_multipart()
                msg = decoder.decode(frame)
                router.send_multipart([identity, encode(info) if isinstance(msg, Hello)
                                       else frame])  # a Heartbeat goes back as it came
            reports.append(watch.silent())
            time.sleep(0.02)
        return reports

    try:
        assert set(serve_for(1.0, answering=True)) == {None}
        reports = serve_for(1.0, answering=False)
        assert any(r is not None and r > 0.5 for r in reports)
    finally:
        watch.close()
        router.close(linger=0)
        ctx.term()
    assert stalled_since_last_beat(10.0, 8.0, 0.25) and not stalled_since_last_beat(10.0, 9.5, 0.25)


@pytest.mark.parametrize("kwargs, field", [
    (dict(engine_restart_timeout=-1), "engine_restart_timeout"),
    (dict(max_engine_restarts=-1), "max_engine_restarts"),
    (dict(frontend_timeout=2.0), "frontend_timeout"),  # the attached core has its own
])
def test_create_names_a_bad_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        asyncio.run(AsyncLLM.create(engine=new_private_address(), **kwargs))
