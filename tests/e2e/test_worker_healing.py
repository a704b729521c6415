"""A worker that dies or hangs is replaced, and its requests finish as if nothing happened.

The engine core kills every rank, starts fresh ones and recomputes each running request from
its prompt and the tokens it already has (engine_core/daemon.py, `EngineCoreDaemon._heal`).
These tests run a daemon with the tiny random Llama, speak the wire messages through the raw
client of test_daemon.py, and compare every request's tokens with the same requests run
before the fault on the same daemon: greedy and seeded sampling alike must be identical,
finish reasons included. `--max-worker-restarts` bounds the healing; past it a failure fails
every request as before.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import zmq

from test_daemon import Client, Daemon, _alive
from tidal.ipc.frontend_messages import EngineDead, FinishReason

MAX_TOKENS = 80  # long enough that a fault lands mid-stream on the tiny model


@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # a failed test may leave its client's socket open


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(99)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 40, 64)]


def _submit(client: Client, prefix: str, prompts) -> list[str]:
    """Each prompt twice: greedy, and sampled at temperature 1 with its own seed."""
    ids = []
    for i, p in enumerate(prompts):
        client.add(f"{prefix}-g{i}", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        client.add(f"{prefix}-s{i}", p, max_tokens=MAX_TOKENS, ignore_eos=True,
                   temperature=1.0, seed=1000 + i)
        ids += [f"{prefix}-g{i}", f"{prefix}-s{i}"]
    return ids


def _outputs(client: Client, ids: list[str], prefix: str) -> dict[str, tuple]:
    """(tokens, finish reason) by request id without its round prefix."""
    return {rid[len(prefix):]: (client.tokens[rid], client.finish[rid]) for rid in ids}


def _fault_free(client: Client, prompts, timeout: float) -> dict[str, tuple]:
    """The requests run once with no fault: what every faulty run must reproduce."""
    ids = _submit(client, "clean", prompts)
    client.wait_finished(ids, timeout=timeout)
    return _outputs(client, ids, "clean")


def _run_with_fault(client: Client, d: Daemon, prefix: str, prompts, fault) -> dict:
    """Submit the requests, apply `fault(worker pids)` once all are streaming, wait."""
    ids = _submit(client, prefix, prompts)
    client.recv_until(lambda m: all(len(client.tokens[r]) >= 3 for r in ids), 30)
    assert all(len(client.tokens[r]) < MAX_TOKENS for r in ids), "finished before the fault"
    fault(d.workers())
    client.wait_finished(ids, timeout=60)
    return _outputs(client, ids, prefix)


def _assert_killed_rank_1_heals(client: Client, d: Daemon, prompts, clean: dict,
                                restart: int) -> None:
    """SIGKILL rank 1 of two mid-stream: every request ends with the fault-free tokens, the
    core counts and logs restart number `restart`, and two new ranks replace the old ones."""
    before = d.workers()
    healed = _run_with_fault(client, d, "kill", prompts,
                             lambda pids: os.kill(pids[1], signal.SIGKILL))
    assert healed == clean, d.log_text()
    assert client.stats().num_worker_restarts == restart
    assert f"was killed by signal 9: replacing the workers (restart {restart}" in d.log_text()
    assert not any(_alive(pid) for pid in before) and len(d.workers()) == 2


@pytest.mark.timeout(240)
def test_killed_worker_is_replaced_and_streams_finish_with_fault_free_tokens(
        tiny_llama, tmp_path, zctx, prompts):
    """SIGKILL the worker mid-stream: the core replaces it, every request ends with the
    tokens of a fault-free run (greedy and seeded), the restart is counted and logged. With
    --max-worker-restarts 1 a second SIGKILL is final: errors, EngineDead, exit non-zero."""
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--max-worker-restarts", "1")
    try:
        client = Client(zctx, d.address, "healing")
        client.hello()
        clean = _fault_free(client, prompts, timeout=60)
        assert all(f == FinishReason.LENGTH for _, f in clean.values())

        first = d.workers()
        healed = _run_with_fault(client, d, "kill", prompts,
                                 lambda pids: os.kill(pids[0], signal.SIGKILL))
        assert healed == clean, d.log_text()
        assert client.stats().num_worker_restarts == 1
        assert "replacing the workers (restart 1 of at most 1" in d.log_text()
        second = d.workers()
        assert len(second) == 1 and second != first and not _alive(first[0])

        ids = _submit(client, "final", prompts)
        client.recv_until(lambda m: all(client.tokens[r] for r in ids), 30)
        os.kill(second[0], signal.SIGKILL)
        client.wait_finished(ids, timeout=20)
        assert {client.finish[r] for r in ids} == {FinishReason.ERROR}
        assert all("--max-worker-restarts" in client.errors[r] for r in ids)
        client.recv_until(lambda m: isinstance(m, EngineDead), 5)
        assert d.wait(timeout=10) != 0
        assert not any(_alive(pid) for pid in second)
        client.close()
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hung_then_killed_rank_of_two_is_replaced_each_time(tiny_llama, tmp_path, zctx,
                                                            prompts):
    """TP=2 with chunked prompts: rank 1 stops (SIGSTOP). Past --worker-timeout both ranks
    are killed and replaced, and the streams finish with the fault-free tokens. Then the new
    rank 1 is SIGKILLed mid-stream (rank 0 then waits in a collective that will never
    complete): the core sees the death at once, replaces both ranks again, and the streams
    finish with the fault-free tokens again, greedy and seeded."""
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--tensor-parallel-size", "2",
               "--worker-timeout", "2", "--max-num-batched-tokens", "32")
    try:
        client = Client(zctx, d.address, "tp2-healing")
        client.hello()
        clean = _fault_free(client, prompts, timeout=120)
        stopped = []

        def stop_rank_1(pids):
            stopped.append(pids[1])
            os.kill(pids[1], signal.SIGSTOP)

        t0 = time.monotonic()
        healed = _run_with_fault(client, d, "hang", prompts, stop_rank_1)
        assert time.monotonic() - t0 > 2
        assert healed == clean, d.log_text()
        assert client.stats().num_worker_restarts == 1
        assert "within 2 s: replacing the workers (restart 1" in d.log_text()
        assert not _alive(stopped[0])
        assert len(d.workers()) == 2

        _assert_killed_rank_1_heals(client, d, prompts, clean, restart=2)
        client.close()
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_stage_of_two_is_replaced_and_streams_finish_with_fault_free_tokens(
        tiny_llama, tmp_path, zctx, prompts):
    """PP=2: SIGKILL the second stage mid-stream (the first then waits on a send that will
    never complete): the core sees the death at once, replaces both ranks, and every request
    ends with the fault-free tokens, greedy and seeded. (TP=2: the test above.)"""
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--pipeline-parallel-size", "2")
    try:
        client = Client(zctx, d.address, "tp2-kill")
        client.hello()
        clean = _fault_free(client, prompts, timeout=120)
        _assert_killed_rank_1_heals(client, d, prompts, clean, restart=1)
        client.close()
    finally:
        d.stop()
