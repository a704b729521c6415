"""The multiprocess executor (`MultiprocExecutor`, the `mp` backend): starts one worker process
per (pipeline stage, tensor-parallel rank) and feeds them plans. Workers are numbered
stage-major (rank = stage * tp + tp_rank); the one that answers with SampledTokens is TP rank 0
of the last stage (rank 0 without pipelining). `core.make_executor` picks it or the Ray one.

    executor = MultiprocExecutor(config, max_model_len)
    facts = executor.start()                       # spawn ranks, handshake, InitKVCache
    executor.submit(plan)                          # broadcast to every rank, do not wait
    sampled = executor.collect(timeout)            # the sampler's SampledTokens, in step order
    executor.shutdown()                            # Shutdown, join, kill stragglers

Sockets (the engine core binds all of them in its private ipc directory):

    one PUSH per rank ──BatchPlan / InitKVCache / Shutdown──► that rank's PULL
    one PULL ◄──WorkerReady (every rank) / SampledTokens (the sampler) / WorkerFailed── all

One PUSH per rank (not a PUB): every rank must receive every plan, in order, and a PUSH with
its single peer queues messages instead of dropping them while a subscriber joins, so no extra
ready barrier is needed; the plan is encoded once and the same bytes are sent N times.

Failures become `WorkerError`: a rank that exits (seen at once through a pidfd in the poll set,
or by `Popen.poll`), a rank that reports `WorkerFailed`, or the sampler silent for longer than
`step_timeout` seconds on an outstanding step. This module never imports torch: the ranks are
separate `python -m tidal.workers.proc` processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import zmq

from .config import EngineConfig
from .cpu_threads import worker_env
from ..ipc.lifeline import lifeline_fd
from ..ipc.transport import (
    PLAN_SEND_TIMEOUT_MS,
    WorkerToCoreDecoder,
    bind_private,
    encode,
    encode_worker_config,
    free_tcp_port,
    ipc_path,
    plan_socket,
    results_socket,
)
from ..ipc.worker_messages import (
    BatchPlan,
    InitKVCache,
    SampledTokens,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
"""Most seconds the ranks may take to load the model and report WorkerReady."""
DEFAULT_STEP_TIMEOUT_S = 300.0
"""Most seconds rank 0 may take to answer a step before the engine core gives up on it."""
_PEER_DEATH_GRACE_S = 1.0
"""How long a rank's failure waits for a peer's death to show: a rank whose send or
collective was cut off by a peer that died fails a moment before that peer is reaped."""


class WorkerError(RuntimeError):
    """A worker died, failed or hung; every in-flight request is lost."""


@dataclass(frozen=True)
class WorkerFacts:
    """What the ranks found at start-up (the smallest over ranks). Facts, not configuration:
    passed to whoever needs them, never written into the frozen EngineConfig."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    """Token ids the model takes: [0, vocab_size)."""
    device: str
    """Where the ranks run ("cpu", "cuda"): whether async scheduling is on by default."""
    sliding_window: int = 0
    """The attention window every layer of the model shares (every rank reports the same
    one), else 0: whether the scheduler frees blocks that fall out of it."""


@dataclass
class _Rank:
    """One worker process and the socket that feeds it."""

    rank: int
    proc: subprocess.Popen
    plan_sock: zmq.Socket
    plan_address: str
    pidfd: int | None  # readable once the process exits (Linux >= 5.3), else None


class MultiprocExecutor:
    """Starts and feeds the worker processes of one engine core (see the module docstring)."""

    def __init__(self, config: EngineConfig, max_model_len: int, ctx: zmq.Context | None = None,
                 *, step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 log_level: str = "INFO", model_dir: str | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.model_dir = model_dir  # the folder the ranks load (None: config.model.model)
        self.step_timeout = step_timeout
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.decoder = WorkerToCoreDecoder()
        self.ranks: list[_Rank] = []
        self.result_sock = results_socket(self.ctx)
        self.result_address = self._bind(self.result_sock, "results")
        # step_id of each submitted plan whose SampledTokens have not come back yet, in order
        self._pending: deque[int] = deque()
        p = config.parallel
        self.sampler_rank = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size  # answers
        self._waiting_since = 0.0  # when rank 0 became busy with the oldest pending step
        self._poller: zmq.Poller | None = None
        self._closed = False

    # -- start-up ------------------------------------------------------------------------------

    def start(self, stop_requested=lambda: False) -> WorkerFacts:
        """Spawn every rank, wait for all WorkerReady, send InitKVCache(minimum blocks).

        Returns the smallest KV block count, context length and vocabulary the ranks report.
        Raises WorkerError when a rank fails, exits, reports no vocabulary or the start-up
        timeout passes, and InterruptedError when `stop_requested()` turns true while waiting.
        """
        self._spawn_ranks(stop_requested)
        self._poller = zmq.Poller()  # results + every rank's pidfd, built once
        self._poller.register(self.result_sock, zmq.POLLIN)
        for r in self.ranks:
            if r.pidfd is not None:
                self._poller.register(r.pidfd, zmq.POLLIN)
        readies = self._wait_ready(stop_requested)
        num_blocks = min(r.num_kv_blocks for r in readies)
        max_model_len = min([self.max_model_len] + [r.max_model_len for r in readies])
        vocab_size = min(r.vocab_size for r in readies)
        if vocab_size < 1:
            raise WorkerError("a worker rank reported no vocabulary size")
        if len({r.num_kv_blocks for r in readies}) > 1:
            logger.info("ranks report %s KV blocks; using the minimum, %d",
                        [r.num_kv_blocks for r in readies], num_blocks)
        self._broadcast(encode(InitKVCache(num_blocks)))
        load_s = max(r.load_seconds for r in readies)
        logger.info("%d worker(s) ready on %s in %.1f s: %d KV blocks of %d tokens, "
                    "max_model_len %d", len(readies), readies[0].device, load_s, num_blocks,
                    self.config.cache.block_size, max_model_len)
        windows = {r.sliding_window for r in readies}  # pipeline stages: all or nothing
        window = windows.pop() if len(windows) == 1 else 0
        if window:
            logger.info("every attention layer sees the last %d positions: a request's blocks "
                        "wholly before its window go back to the pool", window)
        return WorkerFacts(num_blocks, max_model_len, vocab_size, readies[0].device, window)

    def _bind(self, sock: zmq.Socket, tag: str) -> str:
        """Bind `sock` where the ranks can reach it; its address (here: private ipc)."""
        return bind_private(sock, tag)

    def _spawn_ranks(self, stop_requested) -> None:
        """Start every rank (appended to `self.ranks`); they report WorkerReady later."""
        dist_init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        for rank in range(self.config.parallel.world_size):
            self.ranks.append(self._spawn(rank, dist_init_method))

    def _plan_socket(self, rank: int) -> tuple[zmq.Socket, str]:
        """A bound PUSH socket for rank `rank`'s plans, and its address."""
        sock = plan_socket(self.ctx)
        return sock, self._bind(sock, f"plan{rank}")

    def _spawn(self, rank: int, dist_init_method: str) -> _Rank:
        sock, plan_address = self._plan_socket(rank)
        worker_config = self.config.worker_config(rank, self.max_model_len, dist_init_method,
                                                  self.model_dir)
        lifeline = lifeline_fd()  # the rank dies with this process (ipc/lifeline.py)
        cmd = [sys.executable, "-m", "tidal.workers.proc",
               "--config", encode_worker_config(worker_config),
               "--plan-address", plan_address, "--result-address", self.result_address,
               "--lifeline-fd", str(lifeline), "--log-level", self.log_level]
        env = self._worker_env(worker_config.cpu_threads)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True, env=env,
                                pass_fds=(lifeline,))
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        logger.debug("started worker rank %d as pid %d (OMP_NUM_THREADS=%s, cores %s)", rank,
                     proc.pid, env.get("OMP_NUM_THREADS"), worker_config.cpu_cores or "all")
        return _Rank(rank, proc, sock, plan_address, pidfd)

    def _worker_env(self, threads: int | None) -> dict[str, str]:
        """A rank's environment: ours, plus its OpenMP thread count and wait policy
        (`engine_core/cpu_threads.py`; values the user set win)."""
        if threads is None:
            return dict(os.environ)
        return worker_env(dict(os.environ), threads, self.config.parallel.world_size)

    def _wait_ready(self, stop_requested) -> list[WorkerReady]:
        readies: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + self.startup_timeout
        while len(readies) < len(self.ranks):
            if stop_requested():
                raise InterruptedError("stop requested during start-up")
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.ranks))) - set(readies))
                raise WorkerError(f"worker rank(s) {missing} not ready after "
                                  f"{self.startup_timeout:.0f} s")
            msg = self._receive(timeout=0.2)
            if isinstance(msg, WorkerReady):
                readies[msg.rank] = msg
            elif msg is not None:
                logger.warning("unexpected %s from a worker during start-up", type(msg).__name__)
        return [readies[r] for r in sorted(readies)]

    # -- steps ---------------------------------------------------------------------------------

    def submit(self, plan: BatchPlan) -> None:
        """Send `plan` to every rank; returns at once. Rank 0 will answer with SampledTokens."""
        self.check_alive()
        if not self._pending:
            self._waiting_since = time.monotonic()
        self._broadcast(encode(plan))
        self._pending.append(plan.step_id)

    def collect(self, timeout: float | None = None) -> SampledTokens | None:
        """The oldest pending step's tokens, or None if they are not back within `timeout` s.

        Raises WorkerError when a rank died or failed, or rank 0 exceeded `step_timeout`.
        """
        if not self._pending:
            raise RuntimeError("collect() without a submitted step")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            hang_deadline = self._waiting_since + self.step_timeout
            now = time.monotonic()
            if now > hang_deadline:
                raise WorkerError(f"worker rank {self.sampler_rank} did not finish step "
                                  f"{self._pending[0]} "
                                  f"within {self.step_timeout:.0f} s")
            if deadline is not None and now >= deadline:
                return None
            wait = hang_deadline - now if deadline is None else min(deadline, hang_deadline) - now
            msg = self._receive(timeout=max(wait, 0.0))
            if isinstance(msg, SampledTokens):
                return self._accept(msg)
            if msg is not None:
                logger.warning("unexpected %s from a worker, ignored", type(msg).__name__)

    def _accept(self, msg: SampledTokens) -> SampledTokens:
        expected = self._pending[0]
        if msg.step_id != expected:
            raise WorkerError(f"worker rank {self.sampler_rank} answered step {msg.step_id}, "
                              f"expected {expected}")
        self._pending.popleft()
        self._waiting_since = time.monotonic()
        return msg

    def _receive(self, timeout: float):
        """One decoded message from the result socket within `timeout` s, or None.

        Raises WorkerError on WorkerFailed or when a rank's process has exited.
        """
        events = dict(self._poller.poll(int(timeout * 1000)))
        if self.result_sock in events:
            msg = self.decoder.decode(self.result_sock.recv(), sender="worker")
            if isinstance(msg, WorkerFailed):
                raise self._peer_death(msg.rank) or WorkerError(
                    f"worker rank {msg.rank} failed: {_last_line(msg.error)}")
            return msg
        self.check_alive()
        return None

    def check_alive(self) -> None:
        """Raise WorkerError if any rank's process has exited."""
        death = self._death()
        if death is not None:
            raise death

    def _death(self, besides: int | None = None) -> WorkerError | None:
        """The first rank (other than `besides`) whose process has exited, as an error."""
        for r in self.ranks:
            code = r.proc.poll() if r.rank != besides else None
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return WorkerError(f"worker rank {r.rank} (pid {r.proc.pid}) {how}")
        return None

    def _peer_death(self, failed_rank: int) -> WorkerError | None:
        """The death of another rank that made `failed_rank` fail, if one shows within
        _PEER_DEATH_GRACE_S (its cause, so the log names the cause); else None."""
        deadline = time.monotonic() + _PEER_DEATH_GRACE_S
        while (death := self._death(besides=failed_rank)) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        return death

    def wait_fds(self) -> list[int]:
        """File descriptors that become readable when a rank exits (for an idle poll)."""
        return [r.pidfd for r in self.ranks if r.pidfd is not None]

    def _broadcast(self, frame: bytes) -> None:
        for r in self.ranks:
            try:
                r.plan_sock.send(frame, copy=False)
            except zmq.Again:
                self.check_alive()
                seconds = PLAN_SEND_TIMEOUT_MS / 1000
                raise WorkerError(f"worker rank {r.rank} does not accept plans "
                                  f"(nothing read for {seconds:.0f} s)") from None

    # -- shut-down -----------------------------------------------------------------------------

    def shutdown(self, grace: float = 5.0) -> None:
        """Tell every rank to exit, wait up to `grace` s, then kill what is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        frame = encode(Shutdown())
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    r.plan_sock.send(frame, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + grace
        for r in self.ranks:
            try:
                r.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                logger.warning("worker rank %d did not exit within %.0f s; killing it",
                               r.rank, grace)
                r.proc.kill()
                r.proc.wait()
        self._close_sockets()

    def kill(self) -> None:
        """SIGKILL every rank at once (after a failure) and reap them. Idempotent."""
        if self._closed:
            return
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()
        for r in self.ranks:
            r.proc.wait()
        self._closed = True
        self._close_sockets()

    def _close_sockets(self) -> None:
        for r in self.ranks:
            r.plan_sock.close(linger=0)
            if r.pidfd is not None:
                os.close(r.pidfd)
                r.pidfd = None
            _unlink(r.plan_address)
        self.result_sock.close(linger=0)
        _unlink(self.result_address)
        if self._own_ctx:
            self.ctx.term()


def _unlink(address: str) -> None:
    path = ipc_path(address)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
