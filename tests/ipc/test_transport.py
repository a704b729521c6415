"""ipc.transport: typed round trips, dropped frames, addresses, CURVE on loopback."""

import dataclasses
import logging
import os
import socket
import stat
import time

import msgspec
import pytest
import zmq

from tidal.engine_core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tidal.ipc.frontend_messages import (
    Abort,
    AddRequest,
    Detached,
    EngineCoreOutput,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Hello,
    SchedulerStats,
    StatsQuery,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids
from tidal.ipc.transport import (
    WORKER_KEYS_ENV,
    CoreToFrontendDecoder,
    CoreToWorkerDecoder,
    FrontendDecoder,
    WorkerToCoreDecoder,
    bind_curve_tcp,
    bind_engine_socket,
    bind_private,
    check_ipc_free,
    check_listen_address,
    connect_frontend_socket,
    connect_worker_sockets,
    curve_connect,
    curve_server,
    decode_worker_config,
    default_engine_address,
    encode,
    encode_worker_config,
    is_loopback_address,
    new_keys,
    new_private_address,
    plan_socket,
    read_key_file,
    results_socket,
    runtime_dir,
    worker_keys_env,
    worker_keys_from_env,
    write_key_file,
)
from tidal.ipc.worker_messages import (
    BatchPlan,
    CachedRequestData,
    InitKVCache,
    NewRequestData,
    RequestFailure,
    SampledTokens,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)

FRONTEND_MSGS = [
    Hello("client-a", kind="http", pid=42),
    Heartbeat("client-a"),
    AddRequest("r1", pack_token_ids([1, 2, 3]), SamplingParams(temperature=0.0, max_tokens=4,
                                                                 stop=["x"]), eos_token_id=0,
               priority=3, arrival_time=1.5),
    Abort(["r1", "r2"]),
    StatsQuery("client-a"),
]
CORE_TO_FRONTEND_MSGS = [
    EngineInfo("m", 128, 64, 16, 8, 256, served_model_name="served",
               heartbeat_interval=0.25),
    EngineOutputs([EngineCoreOutput("r1", pack_token_ids([5]), FinishReason.ERROR, error="boom"),
                   EngineCoreOutput("r2", b"", FinishReason.ERROR, error="n must be 1",
                                    refused=True)],
                  stats=SchedulerStats(num_running=1, kv_cache_usage=0.5), timestamp=3.0),
    EngineDead("bye"),
    Detached("silent for 12.0 s"),
    Heartbeat("client-a"),  # a frontend's heartbeat, echoed: the core is alive
]
CORE_TO_WORKER_MSGS = [
    BatchPlan(7, new_requests=[NewRequestData("r1", pack_token_ids([1, 2]), 2, [0, 1], 0, 2,
                                              SamplingParams())],
              cached_requests=[CachedRequestData("r0", [3], 5, 1)], finished_req_ids=["x"],
              total_num_scheduled_tokens=3),
    InitKVCache(100),
    Shutdown(),
]
WORKER_TO_CORE_MSGS = [
    WorkerReady(0, 100, 128, device="cpu", load_seconds=0.5, vocab_size=512),
    SampledTokens(7, ["r1"], pack_token_ids([9])),
    SampledTokens(8, [], b"", failed=[RequestFailure("r2", "token_ids contain 600")]),
    WorkerFailed(1, "Traceback ..."),
]
CASES = [
    (FrontendDecoder, FRONTEND_MSGS),
    (CoreToFrontendDecoder, CORE_TO_FRONTEND_MSGS),
    (CoreToWorkerDecoder, CORE_TO_WORKER_MSGS),
    (WorkerToCoreDecoder, WORKER_TO_CORE_MSGS),
]


@pytest.mark.parametrize("decoder_cls,msgs", CASES)
def test_round_trip_exact_type(decoder_cls, msgs):
    decoder = decoder_cls()
    for msg in msgs:
        out = decoder.decode(encode(msg))
        assert type(out) is type(msg)
        assert out == msg
    assert decoder.num_dropped == 0


def test_token_ids_survive_round_trip():
    ids = list(range(-3, 3000, 7))
    msg = FrontendDecoder().decode(encode(AddRequest("r", pack_token_ids(ids), SamplingParams())))
    assert unpack_token_ids(msg.prompt_token_ids).tolist() == ids


@pytest.mark.parametrize("decoder_cls,msgs", CASES)
def test_wrong_conversation_is_dropped(decoder_cls, msgs, caplog):
    """A message of another conversation does not decode on this side; the decoder goes on."""
    decoder = decoder_cls()
    mine = {type(m) for m in msgs}  # the heartbeat travels both ways
    foreign = [m for _, others in CASES if others is not msgs for m in others
               if type(m) not in mine]
    with caplog.at_level(logging.WARNING, logger="tidal.ipc.transport"):
        for msg in foreign:
            assert decoder.decode(encode(msg)) is None
    assert decoder.num_dropped == len(foreign)
    assert any("dropped a frame" in r.getMessage() for r in caplog.records)
    assert decoder.decode(encode(msgs[0])) == msgs[0]


GARBAGE = [
    b"",
    b"\x00",
    b"\xff\xfe\xfd",
    b"hello world",
    msgspec.msgpack.encode(["add", "r1"]),  # right tag, missing fields
    msgspec.msgpack.encode(["add", "r1", 5, [], None]),  # wrong field types
    msgspec.msgpack.encode({"add": 1}),
    msgspec.msgpack.encode(["nope", "x"]),
    # a validating Struct with an invalid value: temperature < 0
    encode(AddRequest("r", b"", SamplingParams())).replace(b"\xcb\x3f\xf0", b"\xcb\xbf\xf0"),
    os.urandom(64),
]


def test_garbage_frames_dropped_and_decoder_keeps_working(caplog):
    decoder = FrontendDecoder()
    with caplog.at_level(logging.WARNING, logger="tidal.ipc.transport"):
        for frame in GARBAGE:
            assert decoder.decode(frame, sender="evil") is None
    assert decoder.num_dropped == len(GARBAGE)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "evil" in warnings[0]
    # rate limited: far fewer warnings than frames
    assert len(warnings) < len(GARBAGE)
    assert decoder.decode(encode(Heartbeat("c"))) == Heartbeat("c")


def test_invalid_sampling_params_do_not_decode():
    bad = msgspec.msgpack.encode(["add", "r", b"", [1, 16, 0, -1.0]])
    assert FrontendDecoder().decode(bad) is None


def _add_request_frame(**changes) -> bytes:
    """An AddRequest frame with fields replaced as a hostile sender may (no validation):
    `sampling.NAME=value` keys change a sampling field."""
    wire = msgspec.msgpack.decode(encode(AddRequest("r9", pack_token_ids([1, 2]),
                                                    SamplingParams())))
    names = [f.name for f in msgspec.structs.fields(AddRequest)]
    sampling_names = [f.name for f in msgspec.structs.fields(SamplingParams)]
    for key, value in changes.items():
        if key.startswith("sampling."):
            wire[1 + names.index("sampling")][sampling_names.index(key[9:])] = value
        else:
            wire[1 + names.index(key)] = value
    return msgspec.msgpack.encode(wire)


@pytest.mark.parametrize("changes,why", [
    ({"sampling.temperature": "hot"}, "sampling.temperature: Expected `float`, got `str`"),
    ({"sampling.temperature": -1.0}, "temperature must be non-negative, got -1.0"),
    ({"sampling.stop_token_ids": [1, 2**63 + 5]}, "stop_token_ids must be token ids"),
    ({"sampling.stop_token_ids": [1, "x"]},
     "sampling.stop_token_ids[1]: Expected `int`, got `str`"),
    ({"sampling.top_k": 2**40}, "top_k must be"),
    ({"eos_token_id": "eos"}, "eos_token_id: Expected `int | null`, got `str`"),
    ({"prompt_token_ids": [1, 2]}, "prompt_token_ids: Expected `bytes`"),
])
def test_an_add_request_that_does_not_decode_is_answerable(changes, why):
    """The engine core must refuse such a request to its sender: the decoder gives its
    req_id and why it does not decode, naming the field."""
    decoder = FrontendDecoder()
    frame = _add_request_frame(**changes)
    assert decoder.decode(frame) is None
    req_id, message = decoder.undecodable_request(frame)
    assert req_id == "r9" and message.startswith(why), message


def test_only_an_addressable_add_request_is_answerable():
    decoder = FrontendDecoder()
    for frame in [*GARBAGE[:4], msgspec.msgpack.encode(["add", 5, b""]),
                  encode(Heartbeat("c")), encode(AddRequest("r", b"", SamplingParams()))[:-3]]:
        assert decoder.undecodable_request(frame) is None
    assert decoder.undecodable_request(_add_request_frame()) is None  # it decodes


def test_worker_config_argv_round_trip():
    engine = EngineConfig(ModelConfig("/m", dtype="float32"), CacheConfig(num_kv_blocks_override=9),
                          parallel=ParallelConfig(tensor_parallel_size=2, cpu_affinity="0|1"))
    cfg = engine.worker_config(1, 64, "tcp://127.0.0.1:1234")
    assert (cfg.rank, cfg.cpu_cores, cfg.num_kv_blocks_override) == (1, [1], 9)
    assert decode_worker_config(encode_worker_config(cfg)) == cfg
    with pytest.raises(ValueError, match="worker config"):
        decode_worker_config("!!!not base64")


def test_addresses_private_and_unique():
    d = runtime_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.stat(d).st_uid == os.getuid()
    assert default_engine_address() == f"ipc://{d}/engine.sock"
    a, b = new_private_address(), new_private_address()
    assert a != b and a.startswith(f"ipc://{d}/")


def test_loopback_rules():
    assert is_loopback_address("ipc:///tmp/x")
    assert is_loopback_address("tcp://127.0.0.1:5555")
    assert is_loopback_address("tcp://localhost:5555")
    assert is_loopback_address("tcp://[::1]:5555")
    assert not is_loopback_address("tcp://0.0.0.0:5555")
    assert not is_loopback_address("tcp://10.1.2.3:5555")
    check_listen_address("tcp://127.0.0.1:5555", None)
    with pytest.raises(ValueError, match="engine-key-file"):
        check_listen_address("tcp://0.0.0.0:5555", None)
    check_listen_address("tcp://0.0.0.0:5555", "/some/keys")
    with pytest.raises(ValueError, match="listen address"):
        check_listen_address("http://x", None)


def test_live_ipc_address_is_not_stolen():
    addr = new_private_address("test")
    ctx = zmq.Context()
    try:
        sock, _ = bind_engine_socket(ctx, addr)
        assert stat.S_IMODE(os.stat(addr[len("ipc://"):]).st_mode) == 0o600
        with pytest.raises(ValueError, match="already listening"):
            check_ipc_free(addr)
        sock.close(linger=0)
        for _ in range(100):  # the listener closes asynchronously in zmq's io thread
            try:
                check_ipc_free(addr)  # stale or gone: fine
                break
            except ValueError:
                time.sleep(0.01)
        else:
            pytest.fail("closed ipc listener still reported live")
    finally:
        ctx.term()


def test_key_file_format(tmp_path):
    path = str(tmp_path / "keys")
    keys = write_key_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_key_file(path) == keys
    text = open(path).read()
    for name in ("server-public-key", "server-secret-key", "client-public-key",
                 "client-secret-key"):
        assert f"{name} = " in text
    bad = tmp_path / "bad"
    bad.write_text("server-public-key = short\n")
    with pytest.raises(ValueError, match="line 1"):
        read_key_file(str(bad))


def _serve_one(router, timeout_ms=2000):
    """Answer one Hello on `router` with EngineInfo; returns the client identity or None."""
    if not router.poll(timeout_ms):
        return None
    identity, frame = router.recv_multipart()
    msg = FrontendDecoder().decode(frame)
    assert isinstance(msg, Hello)
    router.send_multipart([identity, encode(CORE_TO_FRONTEND_MSGS[0])])
    return identity


def test_curve_on_loopback_good_and_bad_key(tmp_path):
    """CURVE forced on 127.0.0.1: the key file's client is served, another key gets nothing."""
    good, other = str(tmp_path / "good"), str(tmp_path / "other")
    write_key_file(good)
    keys_other = write_key_file(other)
    # A file with the right server key but a client key the server does not know.
    mixed = str(tmp_path / "mixed")
    keys_good = read_key_file(good)
    with open(mixed, "w") as f:
        f.write(f"server-public-key = {keys_good.server_public.decode()}\n"
                f"server-secret-key = {keys_good.server_secret.decode()}\n"
                f"client-public-key = {keys_other.client_public.decode()}\n"
                f"client-secret-key = {keys_other.client_secret.decode()}\n")
    os.chmod(mixed, 0o600)

    ctx = zmq.Context()
    # NOTE: a free port from the OS, bound at once by the engine socket; a port found by a zmq
    # socket that was then closed could still be held by zmq's I/O thread ("Address already
    # in use", seen once in CI), and another process may take a free port first: retry
    for _ in range(5):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            addr = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        try:
            router, auth = bind_engine_socket(ctx, addr, key_file=good)
            break
        except ValueError:
            continue
    try:
        for key_file in (mixed, other, None):  # unknown client key, wrong server key, plain
            bad = connect_frontend_socket(ctx, addr, "intruder", key_file=key_file)
            bad.send(encode(Hello("intruder")))
            assert _serve_one(router, timeout_ms=700) is None
            assert not bad.poll(100)
            bad.close(linger=0)
        ok = connect_frontend_socket(ctx, addr, "friend", key_file=good)
        ok.send(encode(Hello("friend")))
        assert _serve_one(router) == b"friend"
        assert ok.poll(2000)
        assert isinstance(CoreToFrontendDecoder().decode(ok.recv()), EngineInfo)
        ok.close(linger=0)
    finally:
        router.close(linger=0)
        auth.stop()
        ctx.term()


def test_worker_keys_admit_only_the_ranks_client_key():
    """The Ray executor's result socket: a CURVE server with fresh keys admits a worker that
    has the keys from WORKER_KEYS_ENV (server secret never in it) and drops anyone else."""
    keys, stranger = new_keys(), new_keys()
    env = {WORKER_KEYS_ENV: worker_keys_env(keys)}
    worker_keys = worker_keys_from_env(env)
    assert worker_keys.server_secret == b"" and worker_keys.client_secret == keys.client_secret
    assert worker_keys_from_env({}) is None
    with pytest.raises(ValueError, match=WORKER_KEYS_ENV):
        worker_keys_from_env({WORKER_KEYS_ENV: "too short"})

    ctx = zmq.Context()
    auth = curve_server(ctx, keys)
    results, plans = results_socket(ctx), plan_socket(ctx)
    result_address = bind_curve_tcp(results, "127.0.0.1", keys)
    plan_address = bind_curve_tcp(plans, "127.0.0.1", keys)
    assert result_address.startswith("tcp://127.0.0.1:")
    try:
        foreign = {"plain": None,
                   "other key": worker_keys_from_env({WORKER_KEYS_ENV: worker_keys_env(
                       dataclasses.replace(stranger, server_public=keys.server_public))})}
        for name, client_keys in foreign.items():
            push = ctx.socket(zmq.PUSH)
            if client_keys is not None:
                curve_connect(push, client_keys)
            push.connect(result_address)
            push.send(name.encode())
            assert not results.poll(700), name
            push.close(linger=0)
        _plans_go_and_results_come_back(ctx, plans, plan_address, results, result_address,
                                        worker_keys)
    finally:
        plans.close(linger=0)
        results.close(linger=0)
        auth.stop()
        ctx.term()


def test_worker_sockets_over_private_ipc():
    """The multiprocess executor's sockets: private ipc addresses, plans reach the rank and
    its results come back."""
    ctx = zmq.Context()
    plans, results = plan_socket(ctx), results_socket(ctx)
    plan_address, result_address = bind_private(plans, "plan0"), bind_private(results, "results")
    try:
        assert plan_address.startswith(f"ipc://{runtime_dir()}/") and plan_address != result_address
        _plans_go_and_results_come_back(ctx, plans, plan_address, results, result_address)
    finally:
        plans.close(linger=0)
        results.close(linger=0)
        ctx.term()


def _plans_go_and_results_come_back(ctx, plans, plan_address, results, result_address,
                                    keys=None):
    plan_in, result_out = connect_worker_sockets(ctx, plan_address, result_address, keys)
    try:
        result_out.send(b"rank 0")
        assert results.poll(2000) and results.recv() == b"rank 0"
        plans.send(b"plan 1")
        assert plan_in.poll(2000) and plan_in.recv() == b"plan 1"
    finally:
        plan_in.close(linger=0)
        result_out.close(linger=0)
