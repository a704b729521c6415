"""The engine-core daemon as a real process tree, driven through raw DEALER sockets.

Each daemon here is `python -m tidal.engine_core.daemon` with the tiny random Llama; the
tests speak the wire messages directly (no frontend library), so they check the daemon alone:
greedy tokens equal transformers' generate(); each client gets only its own outputs; a silent
client's requests end with an error, it is told `Detached` and must say Hello again, and the
block pool returns to all free; garbage is dropped;
a killed worker fails every in-flight request and the daemon exits non-zero with no process
left behind; SIGTERM exits cleanly; async and sync scheduling give the same tokens. (A
SIGKILLed daemon's workers exit too: test_server_faults.py checks it after every core it
kills under `tidal serve`, `test_llm.py` after killing an `LLM`'s private daemon.)
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from tidal.ipc.frontend_messages import (
    Abort,
    AddRequest,
    Detached,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Hello,
    StatsQuery,
)
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids
from tidal.ipc.transport import (
    CoreToFrontendDecoder,
    connect_frontend_socket,
    encode,
    free_tcp_port,
    ipc_path,
    new_private_address,
    write_key_file,
)
from tidal.ipc.worker_messages import BatchPlan

MAX_TOKENS = 12
PROMPT_LENS = [3, 7, 12, 17, 25, 33, 40, 5]
STARTUP_TIMEOUT_S = 90.0
FRONTEND_TIMEOUT_S = 3.0


# ---------------------------------------------------------------------------------------------
# helpers: a daemon process and a raw client


def _child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Daemon:
    """A `tidal core` subprocess; its log goes to a file shown when a test fails."""

    def __init__(self, model: str, log_path: str, *flags: str, listen: str | None = None):
        self.address = listen or new_private_address("test-daemon")
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tidal.engine_core.daemon", model,
               "--listen", self.address, "--num-gpu-blocks-override", "512",
               "--max-num-seqs", "8", "--frontend-timeout", str(FRONTEND_TIMEOUT_S),
               "--log-level", "INFO", *flags]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def workers(self) -> list[int]:
        return _child_pids(self.proc.pid)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                for pid in self.workers():
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Client:
    """A frontend made of one DEALER socket. While any client waits, every open client
    heartbeats (unless its `heartbeat` is turned off), as a real frontend's timer would."""

    _open: list["Client"] = []

    def __init__(self, ctx, address: str, client_id: str, key_file: str | None = None):
        self.client_id = client_id
        Client._open.append(self)
        self.sock = connect_frontend_socket(ctx, address, client_id, key_file)
        self.decoder = CoreToFrontendDecoder()
        self.heartbeat = True
        self._last_heartbeat = 0.0
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.errors: dict[str, str | None] = {}
        self.refused: dict[str, bool] = {}
        self.foreign: list[str] = []  # outputs for requests this client never sent
        self.sent: set[str] = set()
        self.dead: EngineDead | None = None
        self.detached: Detached | None = None
        self.last_stats = None

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def hello(self, timeout: float = STARTUP_TIMEOUT_S) -> EngineInfo:
        self.send(Hello(self.client_id, pid=os.getpid()))
        info = self.recv_until(lambda m: isinstance(m, EngineInfo), timeout)
        assert isinstance(info, EngineInfo), "no EngineInfo from the daemon"
        return info

    def add(self, req_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
            eos_token_id: int | None = None, **sampling) -> None:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **sampling})
        self.sent.add(req_id)
        self.tokens[req_id] = []
        self.send(AddRequest(req_id, pack_token_ids(prompt), params, eos_token_id=eos_token_id,
                             arrival_time=time.time()))

    def send_raw(self, req_id: str, frame: bytes) -> None:
        """Send a frame carrying request `req_id`, built by hand (nothing validated)."""
        self.sent.add(req_id)
        self.tokens[req_id] = []
        self.sock.send(frame)

    def _beat(self) -> None:
        now = time.monotonic()
        for client in Client._open:
            if client.heartbeat and not client.sock.closed and now - client._last_heartbeat > 0.4:
                client.send(Heartbeat(client.client_id))
                client._last_heartbeat = now

    def _take(self, msg) -> None:
        if isinstance(msg, EngineDead):
            self.dead = msg
        elif isinstance(msg, Detached):
            self.detached = msg
        elif isinstance(msg, EngineOutputs):
            if msg.stats is not None:
                self.last_stats = msg.stats
            for out in msg.outputs:
                if out.req_id not in self.sent:
                    self.foreign.append(out.req_id)
                    continue
                self.tokens[out.req_id] += unpack_token_ids(out.new_token_ids).tolist()
                if out.finish_reason is not None:
                    self.finish[out.req_id] = out.finish_reason
                    self.errors[out.req_id] = out.error
                    self.refused[out.req_id] = out.refused

    def recv_until(self, done, timeout: float):
        """Receive (and record) messages until `done(msg)`; returns that message or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._beat()
            if not self.sock.poll(100):
                continue
            msg = self.decoder.decode(self.sock.recv())
            self._take(msg)
            if msg is not None and done(msg):
                return msg
        return None

    def wait_finished(self, req_ids, timeout: float = 30.0) -> None:
        req_ids = set(req_ids)
        self.recv_until(lambda m: req_ids <= set(self.finish), timeout)
        missing = req_ids - set(self.finish)
        assert not missing, f"{self.client_id}: no finish for {sorted(missing)}"

    def stats(self, timeout: float = 10.0):
        self.send(StatsQuery(self.client_id))
        msg = self.recv_until(lambda m: isinstance(m, EngineOutputs) and m.stats is not None,
                              timeout)
        assert msg is not None, "no answer to StatsQuery"
        return msg.stats

    def close(self) -> None:
        if self in Client._open:
            Client._open.remove(self)
        self.sock.close(linger=0)


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def eos_id(tiny_llama):
    import json

    with open(os.path.join(tiny_llama, "config.json")) as f:
        return json.load(f)["eos_token_id"]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """transformers' greedy generate(), one prompt at a time (stops at EOS like the engine)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # a failed test may leave its client's socket open


@pytest.fixture(scope="module")
def daemon(tiny_llama, tmp_path_factory, reference):
    """One async-scheduling daemon shared by the tests that do not kill it."""
    d = Daemon(tiny_llama, str(tmp_path_factory.mktemp("daemon") / "core.log"),
               "--async-scheduling")
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.log_text()


def _run_prompts(client: Client, prefix: str, prompts, eos_id) -> list[list[int]]:
    for i, p in enumerate(prompts):
        client.add(f"{prefix}-{i}", p, eos_token_id=eos_id)
    client.wait_finished([f"{prefix}-{i}" for i in range(len(prompts))])
    return [client.tokens[f"{prefix}-{i}"] for i in range(len(prompts))]


def _expected_finish(tokens: list[int], eos_id: int) -> FinishReason:
    return FinishReason.STOP if tokens and tokens[-1] == eos_id else FinishReason.LENGTH


# ---------------------------------------------------------------------------------------------
# tests on the shared daemon


@pytest.mark.timeout(120)
def test_greedy_equals_transformers(daemon, zctx, prompts, reference, eos_id):
    client = Client(zctx, daemon.address, "greedy")
    try:
        info = client.hello()
        assert info.block_size == 16 and info.num_kv_blocks == 512
        assert info.max_model_len == 512 and info.max_num_seqs == 8
        got = _run_prompts(client, "g", prompts, eos_id)
        assert got == reference, daemon.log_text()
        for i, tokens in enumerate(got):
            assert client.finish[f"g-{i}"] == _expected_finish(tokens, eos_id)
        assert not client.foreign
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_clients_get_only_their_own_outputs(daemon, zctx, prompts, reference, eos_id):
    a, b = Client(zctx, daemon.address, "alpha"), Client(zctx, daemon.address, "beta")
    try:
        a.hello()
        b.hello()
        # Interleave the two clients' requests so they share steps.
        for i, p in enumerate(prompts):
            (a if i % 2 == 0 else b).add(f"{'a' if i % 2 == 0 else 'b'}-{i}", p,
                                         eos_token_id=eos_id)
        a.wait_finished([f"a-{i}" for i in range(0, len(prompts), 2)])
        b.wait_finished([f"b-{i}" for i in range(1, len(prompts), 2)])
        for i in range(len(prompts)):
            owner = a if i % 2 == 0 else b
            assert owner.tokens[f"{'a' if i % 2 == 0 else 'b'}-{i}"] == reference[i]
        assert not a.foreign and not b.foreign
        late = Client(zctx, daemon.address, "gamma")  # attaches while the others stay
        try:
            late.hello()
            assert _run_prompts(late, "c", prompts[:2], eos_id) == reference[:2]
            assert not late.foreign
        finally:
            late.close()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
def test_silent_frontend_is_failed_detached_and_blocks_freed(daemon, zctx, prompts, reference,
                                                             eos_id):
    """A client that stops heartbeating has its requests failed within the timeout (each with
    an ERROR output naming the timeout, then `Detached`), blocks return; the core refuses its
    frames until it says Hello again, then serves it."""
    watcher = Client(zctx, daemon.address, "watcher")
    silent = Client(zctx, daemon.address, "silent")
    try:
        watcher.hello()
        silent.hello()
        watcher.add("w-0", prompts[0], eos_token_id=eos_id)
        # 256 requests x 480 tokens with 8 running at a time: 15360 steps, far more than the
        # engine can do within the timeout even on a fast machine (64 requests, 3840 steps,
        # all finished inside the 3 s once this tiny model's steps took ~0.5 ms in one C
        # call, and nothing was left to cut).
        silent.heartbeat = False
        for i in range(256):
            silent.add(f"s-{i}", prompts[i % len(prompts)], max_tokens=480, ignore_eos=True)
        t0 = time.monotonic()
        watcher.wait_finished(["w-0"])
        assert watcher.tokens["w-0"] == reference[0]
        assert watcher.stats().kv_cache_usage > 0  # the silent client's requests run
        deadline = t0 + FRONTEND_TIMEOUT_S + 10
        while time.monotonic() < deadline:
            stats = watcher.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            time.sleep(0.2)
        assert stats.num_running == 0 and stats.num_waiting == 0, daemon.log_text()
        assert stats.kv_cache_usage == 0.0
        elapsed = time.monotonic() - t0
        assert elapsed < FRONTEND_TIMEOUT_S + 10
        # Every request of the silent client got an answer: cut short with an error.
        assert silent.recv_until(lambda m: isinstance(m, Detached), 5) is not None
        assert set(silent.finish) == silent.sent
        cut = [rid for rid in silent.sent if silent.finish[rid] == FinishReason.ERROR]
        assert cut and all("--frontend-timeout" in silent.errors[rid] for rid in cut)
        assert "--frontend-timeout" in silent.detached.reason
        assert "dropped its requests" in daemon.log_text()
        # ... and the engine still serves the client that stayed.
        watcher.add("w-1", prompts[1], eos_token_id=eos_id)
        watcher.wait_finished(["w-1"])
        assert watcher.tokens["w-1"] == reference[1]
        # The silent one wakes up: refused (with an answer) until it says Hello again.
        silent.detached = None
        silent.add("late", prompts[2], eos_token_id=eos_id)
        silent.wait_finished(["late"], timeout=5)
        assert silent.finish["late"] == FinishReason.ERROR and "Hello" in silent.errors["late"]
        assert silent.recv_until(lambda m: isinstance(m, Detached), 5) is not None
        silent.heartbeat = True
        silent.hello()
        silent.add("again", prompts[2], eos_token_id=eos_id)
        silent.wait_finished(["again"])
        assert silent.tokens["again"] == reference[2]
    finally:
        watcher.close()
        silent.close()


@pytest.mark.timeout(120)
def test_garbage_frames_dropped_and_daemon_keeps_serving(daemon, zctx, prompts, reference,
                                                         eos_id):
    evil = zctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.IDENTITY, b"evil")
    evil.connect(daemon.address)
    try:
        for frame in [b"", b"\x00\x01", os.urandom(100), b"hello",
                      encode(BatchPlan(1)),  # a worker message on the frontend socket
                      encode(EngineInfo("m", 1, 1, 1, 1, 1)),  # a core-to-frontend message
                      encode(AddRequest("x", b"", SamplingParams()))[:-3]]:  # truncated
            evil.send(frame)
        evil.send_multipart([b"", encode(Hello("evil"))])  # REQ-style envelope
        evil.send_multipart([encode(Hello("evil")), b"tail"])  # extra part
        # Raw bytes on the ipc socket itself, not even zmq framing.
        path = ipc_path(daemon.address)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(path)
        raw.sendall(os.urandom(4096))
        raw.close()
        # The same socket, now speaking properly, is served.
        evil.send(encode(Hello("evil")))
        decoder = CoreToFrontendDecoder()
        assert evil.poll(10_000), daemon.log_text()
        assert isinstance(decoder.decode(evil.recv()), EngineInfo)
        client = Client(zctx, daemon.address, "after-garbage")
        try:
            client.hello()
            assert _run_prompts(client, "ag", prompts[:3], eos_id) == reference[:3]
        finally:
            client.close()
        assert "dropped a frame" in daemon.log_text()
    finally:
        evil.close(linger=0)


@pytest.mark.timeout(60)
def test_abort_only_own_requests(daemon, zctx, prompts):
    owner, other = Client(zctx, daemon.address, "owner"), Client(zctx, daemon.address, "other")
    try:
        owner.hello()
        other.hello()
        owner.add("mine", prompts[0], max_tokens=480, ignore_eos=True)
        owner.recv_until(lambda m: len(owner.tokens["mine"]) > 0, 20)
        other.send(Abort(["mine"]))  # not its request: ignored
        n = len(owner.tokens["mine"])
        owner.recv_until(lambda m: len(owner.tokens["mine"]) > n + 3, 20)
        assert "mine" not in owner.finish
        owner.send(Abort(["mine", "unknown-id"]))
        owner.wait_finished(["mine"], timeout=10)
        assert owner.finish["mine"] == FinishReason.ABORT
        assert not other.foreign
        assert len(owner.tokens["mine"]) < 480
    finally:
        owner.close()
        other.close()


@pytest.mark.timeout(60)
def test_anonymous_dealer_is_served(daemon, zctx):
    """A DEALER without an identity gets a zmq-generated (binary) one; replies still reach it."""
    anon = zctx.socket(zmq.DEALER)
    anon.connect(daemon.address)
    try:
        anon.send(encode(Hello("anonymous")))
        assert anon.poll(10_000)
        assert isinstance(CoreToFrontendDecoder().decode(anon.recv()), EngineInfo)
    finally:
        anon.close(linger=0)


@pytest.mark.timeout(60)
def test_second_daemon_on_a_live_address_is_refused(daemon, zctx, tiny_llama, prompts,
                                                     reference, eos_id):
    done = subprocess.run([sys.executable, "-m", "tidal.engine_core.daemon", tiny_llama,
                           "--listen", daemon.address], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "already listening" in done.stderr
    client = Client(zctx, daemon.address, "still-there")
    try:
        client.hello()
        assert _run_prompts(client, "st", prompts[:1], eos_id) == reference[:1]
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_bad_request_answered_with_error(daemon, zctx):
    client = Client(zctx, daemon.address, "bad-request")
    try:
        client.hello()
        client.add("too-long", list(range(3, 3 + 600)))  # max_model_len is 512
        client.add("empty", [])
        client.wait_finished(["too-long", "empty"])
        assert client.finish["too-long"] == FinishReason.ERROR
        assert "512" in client.errors["too-long"]
        assert client.finish["empty"] == FinishReason.ERROR
    finally:
        client.close()


def _hostile_add(req_id: str, prompt=(5, 6, 7), prompt_bytes: bytes | None = None,
                 **changes) -> bytes:
    """An AddRequest frame as a hostile local process could send it: fields replaced on the
    wire, past every check a frontend or SamplingParams would make. `sampling_NAME=value`
    replaces a sampling field."""
    ids = pack_token_ids(list(prompt)) if prompt_bytes is None else b""
    wire = msgspec.msgpack.decode(encode(AddRequest(req_id, ids, SamplingParams(
        temperature=0.0, max_tokens=4))))
    if prompt_bytes is not None:
        wire[2] = prompt_bytes
    names = [f.name for f in msgspec.structs.fields(AddRequest)]
    sampling_names = [f.name for f in msgspec.structs.fields(SamplingParams)]
    for key, value in changes.items():
        if key.startswith("sampling_"):
            wire[1 + names.index("sampling")][sampling_names.index(key[9:])] = value
        else:
            wire[1 + names.index(key)] = value
    return msgspec.msgpack.encode(wire)


HOSTILE = {  # req_id -> (frame, words the error must hold: the field first)
    "neg-token": (_hostile_add("neg-token", prompt=(5, -7, 6)), "prompt_token_ids", "-7"),
    "big-token": (_hostile_add("big-token", prompt=(5, 10**6)), "prompt_token_ids", "1000000"),
    "huge-stop": (_hostile_add("huge-stop", sampling_stop_token_ids=[2**63 + 5]),
                  "stop_token_ids", ""),
    "eos": (_hostile_add("eos", eos_token_id=2**40), "eos_token_id", ""),
    "temp-type": (_hostile_add("temp-type", sampling_temperature="hot"),
                  "sampling.temperature", "float"),
    "temp-inf": (_hostile_add("temp-inf", sampling_temperature=float("inf")),
                 "temperature", "finite"),
    "top-k": (_hostile_add("top-k", sampling_top_k=2**40), "top_k", ""),
    "min-tokens": (_hostile_add("min-tokens", sampling_max_tokens=None,
                                sampling_min_tokens=2**62), "min_tokens", ""),
    "n": (_hostile_add("n", sampling_n=4), "n", "got 4"),
    "odd-bytes": (_hostile_add("odd-bytes", prompt_bytes=b"\x01\x02\x03"),
                  "prompt_token_ids", "3 bytes"),
    "nan-arrival": (_hostile_add("nan-arrival", arrival_time=float("nan")), "arrival_time", ""),
}


@pytest.mark.timeout(120)
def test_hostile_requests_are_refused_to_their_sender_alone(daemon, zctx, prompts, reference,
                                                            eos_id):
    """Issue 13: any local process can reach the engine socket. Each hostile AddRequest
    above (a token id outside the vocabulary, a stop id of 2**63+5, a field of the wrong
    type, ...) once killed the worker, and with it every user's requests. Now each gets one
    final output, an error that names the field, marked refused, and no token; the daemon
    stays up, a client running alongside gets its tokens as if alone, and no KV block
    stays in use."""
    good, hostile = Client(zctx, daemon.address, "neighbour"), Client(zctx, daemon.address,
                                                                      "hostile")
    try:
        good.hello()
        hostile.hello()
        for i, p in enumerate(prompts[:4]):
            good.add(f"n-{i}", p, eos_token_id=eos_id)
        for req_id, (frame, _, _) in HOSTILE.items():
            hostile.send_raw(req_id, frame)
        hostile.wait_finished(HOSTILE)
        for req_id, (_, field, words) in HOSTILE.items():
            error = hostile.errors[req_id]
            assert hostile.finish[req_id] == FinishReason.ERROR and hostile.refused[req_id]
            assert error.startswith(field) and words in error, (req_id, error)
            assert hostile.tokens[req_id] == []
        good.wait_finished([f"n-{i}" for i in range(4)])
        assert [good.tokens[f"n-{i}"] for i in range(4)] == reference[:4]
        assert not any(good.refused.values()) and not good.foreign and not hostile.foreign
        stats = good.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        assert daemon.proc.poll() is None, daemon.log_text()
        assert "refused" in daemon.log_text()
    finally:
        good.close()
        hostile.close()


# ---------------------------------------------------------------------------------------------
# daemons of their own: sync scheduling + the simulator's advice + SIGTERM, CURVE + a killed
# worker


@pytest.mark.timeout(150)
def test_sync_scheduling_same_tokens_the_simulators_advice_then_sigterm(tiny_llama, tmp_path,
                                                                        zctx, prompts,
                                                                        reference, eos_id):
    """Synchronous scheduling, every prompt chunked (32-token budget) and a KV cache so small
    that requests are preempted: the same tokens. With a step cost model (--step-cost-model)
    the core has the simulator replay the traffic once the preempted requests are done: its
    log gets the table and the best change. Then SIGTERM mid-generation.

    The spell of preemptions ends after 1 s without one (--preemption-advice-quiet-s; the
    default 5 s was waited out here for nothing: the prompts all arrive at once and run in
    about a second). One daemon for both stories (they were two tests with the same flags
    but the cost model: one start less)."""
    from tidal.engine_core.advice.step_cost import StepCostModel

    cost = tmp_path / "cost.json"
    StepCostModel(0.002, per_prefill_token_s=1e-5, per_decode_req_s=1e-4).save(str(cost))
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--no-async-scheduling",
               "--max-num-batched-tokens", "32", "--max-model-len", "128",
               "--num-gpu-blocks-override", "12", "--step-cost-model", str(cost),
               "--preemption-advice-quiet-s", "1")
    try:
        client = Client(zctx, d.address, "sync")
        client.hello()
        workers = d.workers()
        assert len(workers) == 1
        assert _run_prompts(client, "s", prompts, eos_id) == reference, d.log_text()
        preemptions = client.stats().num_preemptions
        assert preemptions > 0

        deadline = time.monotonic() + 60
        while "Preemption advice" not in d.log_text():
            assert time.monotonic() < deadline and d.proc.poll() is None, d.log_text()
            client.stats()  # heartbeats the core meanwhile
            time.sleep(0.2)
        log = d.log_text()
        assert "The simulator will replay this traffic" in log
        advice = log[log.index("Preemption advice"):]
        assert f"replaying the last {len(prompts)} requests" in advice
        assert f"{preemptions} seen" in advice
        assert "\n  as configured " in advice and "\n  --num-gpu-blocks-override 18 " in advice

        client.add("long", prompts[0], max_tokens=100, ignore_eos=True)
        client.recv_until(lambda m: len(client.tokens["long"]) > 0, 20)
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait(timeout=20) == 0, d.log_text()
        client.recv_until(lambda m: isinstance(m, EngineDead), 5)
        assert client.dead is not None
        assert client.finish.get("long") == FinishReason.ERROR
        assert "SIGTERM" in client.errors["long"]
        assert not any(_alive(pid) for pid in workers)
        assert not os.path.exists(ipc_path(d.address))
        client.close()
    finally:
        d.stop()


@pytest.mark.timeout(150)
def test_curve_then_worker_killed(tiny_llama, tmp_path, zctx, prompts, reference, eos_id):
    """CURVE forced on 127.0.0.1: only the key file's client is served. Then SIGKILL the
    worker with --max-worker-restarts 0: every in-flight request fails with an error, the
    daemon exits non-zero, no process is left behind."""
    key_file, other_keys = str(tmp_path / "engine.keys"), str(tmp_path / "other.keys")
    write_key_file(key_file)
    write_key_file(other_keys)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--engine-key-file", key_file,
               "--max-worker-restarts", "0", listen=address)
    try:
        client = Client(zctx, address, "keyholder", key_file=key_file)
        client.hello()
        intruder = Client(zctx, address, "intruder", key_file=other_keys)
        intruder.send(Hello("intruder"))
        assert intruder.recv_until(lambda m: True, 1.0) is None
        intruder.close()
        assert _run_prompts(client, "k", prompts[:2], eos_id) == reference[:2]

        workers = d.workers()
        assert len(workers) == 1
        for i in range(4):
            client.add(f"doomed-{i}", prompts[i], max_tokens=480, ignore_eos=True)
        client.recv_until(lambda m: all(client.tokens[f"doomed-{i}"] for i in range(4)), 20)
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        client.wait_finished([f"doomed-{i}" for i in range(4)], timeout=10)
        assert time.monotonic() - t0 < 10
        for i in range(4):
            assert client.finish[f"doomed-{i}"] == FinishReason.ERROR
            assert "worker rank 0" in client.errors[f"doomed-{i}"]
        client.recv_until(lambda m: isinstance(m, EngineDead), 5)
        assert client.dead is not None
        assert d.wait(timeout=10) != 0
        assert not any(_alive(pid) for pid in workers)
        client.close()
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hung_worker_times_out_and_all_ranks_are_killed(tiny_llama, tmp_path, zctx, prompts,
                                                        reference, eos_id):
    """TP=2 with async scheduling, chunked prompts and preemptions gives the reference tokens.
    Then rank 0 stops answering (SIGSTOP): with --max-worker-restarts 0, past
    --worker-timeout every in-flight request fails and the daemon kills both ranks."""
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--tensor-parallel-size", "2",
               "--async-scheduling", "--worker-timeout", "2", "--max-worker-restarts", "0",
               "--max-num-batched-tokens", "32",
               "--max-model-len", "128", "--num-gpu-blocks-override", "12")
    try:
        client = Client(zctx, d.address, "tp2")
        client.hello()
        workers = d.workers()
        assert len(workers) == 2
        assert _run_prompts(client, "t", prompts, eos_id) == reference, d.log_text()
        assert client.stats().num_preemptions > 0
        client.add("hung", prompts[0], max_tokens=100, ignore_eos=True)
        client.recv_until(lambda m: len(client.tokens["hung"]) > 0, 20)
        os.kill(workers[0], signal.SIGSTOP)
        t0 = time.monotonic()
        client.wait_finished(["hung"], timeout=15)
        assert 1.5 < time.monotonic() - t0 < 15
        assert client.finish["hung"] == FinishReason.ERROR
        assert "within 2 s" in client.errors["hung"]
        assert d.wait(timeout=10) != 0
        assert not any(_alive(pid) for pid in workers), d.log_text()
        client.close()
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_worker_that_cannot_load_fails_the_start(tiny_llama, tmp_path, zctx):
    """A model folder without weights: the worker reports WorkerFailed, the frontend that
    said Hello gets EngineDead naming the error, the daemon exits 2."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            with open(os.path.join(tiny_llama, name), "rb") as src:
                (broken / name).write_bytes(src.read())
    d = Daemon(str(broken), str(tmp_path / "core.log"))
    try:
        client = Client(zctx, d.address, "hopeful")
        client.send(Hello("hopeful"))
        client.recv_until(lambda m: isinstance(m, EngineDead), 60)
        assert client.dead is not None, d.log_text()
        assert "failed to start" in client.dead.reason
        assert d.wait(timeout=10) == 2
        client.close()
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_kv_cache_too_small_for_max_model_len(tiny_llama, tmp_path, zctx):
    """8 blocks of 16 tokens cannot hold a 512-token context: a clear error, exit 2."""
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--num-gpu-blocks-override", "8")
    try:
        client = Client(zctx, d.address, "hopeful")
        client.send(Hello("hopeful"))
        client.recv_until(lambda m: isinstance(m, EngineDead), 60)
        assert client.dead is not None, d.log_text()
        assert "--max-model-len" in client.dead.reason
        assert d.wait(timeout=10) == 2
        assert "does not fit in the KV cache" in d.log_text()
        client.close()
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_sigterm_during_start_up(tiny_llama, tmp_path, zctx):
    d = Daemon(tiny_llama, str(tmp_path / "core.log"))
    try:
        client = Client(zctx, d.address, "early")
        client.send(Hello("early"))
        deadline = time.monotonic() + 10
        while not d.workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = d.workers()
        assert workers
        # the client's connection (zmq reconnects every 100 ms until the socket exists) and
        # its Hello must reach the daemon first; loading a worker takes longer than this
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait(timeout=15) == 0, d.log_text()
        # Stopped mid start-up (or, on a fast machine, just after): EngineDead either way.
        client.recv_until(lambda m: isinstance(m, EngineDead), 5)
        assert client.dead is not None, d.log_text()
        assert not any(_alive(pid) for pid in workers)
        client.close()
    finally:
        d.stop()


def test_generate_key_file_cli(tmp_path):
    path = tmp_path / "engine.keys"
    done = subprocess.run([sys.executable, "-m", "tidal.engine_core.daemon",
                           "--generate-key-file", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    from tidal.ipc.transport import read_key_file

    keys = read_key_file(str(path))
    assert len(keys.server_public) == 40 and keys.client_public != keys.server_public
    assert (path.stat().st_mode & 0o777) == 0o600


def test_non_loopback_tcp_without_keys_is_refused(tiny_llama, tmp_path):
    done = subprocess.run([sys.executable, "-m", "tidal.engine_core.daemon", tiny_llama,
                           "--listen", "tcp://0.0.0.0:5999"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "engine-key-file" in done.stderr
