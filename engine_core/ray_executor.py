"""The Ray executor (`--distributed-executor-backend ray`): the ranks on a Ray cluster, across
machines, with the same public methods, plans and results as the multiprocess executor
(`RayExecutor` subclasses `MultiprocExecutor`).

    engine core (a Ray driver) ── ray.init() ──► the cluster (RAY_ADDRESS, or `ray start`)
      placement group: one bundle per rank, {"GPU": 1} on GPU hosts, {"CPU": T} on CPU hosts
      one `_RankHost` actor per rank, in its bundle, on whichever node Ray picked
        └── starts `python -m tidal.workers.proc` there: the very worker of the mp backend

What travels, and where (the choice, and why):

- Plans and results keep the multiprocess executor's ZeroMQ conversation unchanged (one
  PUSH per rank, one PULL for WorkerReady / SampledTokens / WorkerFailed; msgspec frames),
  so everything after start-up (`submit`, `collect`, the step timeout, the order check) is
  `MultiprocExecutor`'s own code. Only the addresses differ: the core binds `tcp://<its node
  IP, as Ray reports it>:<a random port>` instead of private ipc files, since ranks on another
  machine cannot reach a file. Ray carries only start-up arguments (strings) and the exit
  codes, never a step, so the hot path pays nothing for Ray.
- Each actor hosts its rank as a child process rather than being the rank: the engine core
  (and the actor class it defines) never imports torch, and the rank runs the same code,
  environment set-up and logging as under mp. The child watches the actor's lifeline pipe
  (`ipc/lifeline.py`), so an actor that dies, however (`ray.kill`, its node lost, its owner
  the engine core gone: Ray kills a driver's actors with it), takes its rank with it; a
  rank that exits ends the actor's `wait` call, which `check_alive` sees. No orphans.
- torch.distributed meets at `tcp://<rank 0's node IP>:<a port free there>`, both asked of
  rank 0's actor (127.0.0.1 would mean a different machine to every other node).

Failures are `WorkerError`s, as under mp, so the daemon heals or fails them the same way:
a rank's process that exits (`worker rank 1 (pid 4711 on node 10.0.0.2) was killed by
signal 9`), an actor that dies (`... its Ray actor died`), or rank 0 silent past the step
timeout (a lost node's rank also stops answering). There is no file descriptor to poll for
an actor, so `wait_fds` is empty: the idle daemon calls `check_alive` at least once a second.

The core's TCP sockets are ZeroMQ CURVE servers with a key pair made for each executor; a
ZAP handler admits only the ranks' client key, which reaches them through Ray (the actor
call's arguments) and their environment (`ipc/transport.py`, WORKER_KEYS_ENV), never a
command line. Anyone else who connects gets nothing and can inject nothing. Ray's own
traffic, which carries those keys, is as private as the cluster's network (or Ray's TLS).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from .config import EngineConfig
from .cpu_threads import worker_env
from .executor import MultiprocExecutor, WorkerError
from ..ipc.lifeline import lifeline_fd
from ..ipc.transport import (
    WORKER_KEYS_ENV,
    bind_curve_tcp,
    curve_server,
    encode,
    encode_worker_config,
    free_tcp_port,
    new_keys,
    worker_keys_env,
)
from ..ipc.worker_messages import Shutdown

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "tidal"
"""Ray namespace of the rank actors, named `tidal-<core pid>-<hex>-rank<r>`."""
_ACTOR_CALL_TIMEOUT_S = 120.0  # an actor's start-up (a Python process on its node) and calls
_DEATH_NOTICE_S = 2.0  # a rank's failure waits this long for Ray to report a peer's death
_KILL_WAIT_S = 10.0  # most seconds `kill` waits for Ray to confirm its actors are dead


class _RankHost:
    """A Ray actor (made remote by `_host_class`) that starts one rank's worker process on
    its node and waits for it (its node imports this module: tidal, never torch)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        """This node's IP address as Ray reports it (what other nodes reach it by)."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node right now (torch.distributed's rendezvous)."""
        return free_tcp_port("")

    def start(self, worker_args: list[str], threads: int, keys: str) -> int:
        """Start `python -m tidal.workers.proc worker_args...` with `threads` OpenMP threads
        and the CURVE `keys` (WORKER_KEYS_ENV), tied to this actor's lifetime; its pid."""
        lifeline = lifeline_fd()
        cmd = [sys.executable, "-m", "tidal.workers.proc", *worker_args,
               "--lifeline-fd", str(lifeline)]
        env = {**worker_env(dict(os.environ), threads), WORKER_KEYS_ENV: keys}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True, env=env,
                                     pass_fds=(lifeline,))
        return self.proc.pid

    def wait(self) -> int:
        """Block until the worker process exits; its exit status (negative: a signal)."""
        return self.proc.wait()


_HOST_CLASS = None


def _host_class():
    """`_RankHost` as a Ray actor class (two calls at once: `wait` blocks for the rank's life)."""
    global _HOST_CLASS
    if _HOST_CLASS is None:
        import ray

        _HOST_CLASS = ray.remote(max_concurrency=2, max_restarts=0)(_RankHost)
    return _HOST_CLASS


@dataclass
class _RayRank:
    """One rank: its actor, the socket that feeds it, and the call that ends with it."""

    rank: int
    host: object  # the _RankHost actor handle
    node_ip: str
    plan_sock: zmq.Socket
    plan_address: str
    done: object = None  # ObjectRef of host.wait(): ready once the worker process has exited
    pid: int = 0  # the worker process's pid, on its node
    pidfd: None = None  # mp's exit fd: an actor has none (`MultiprocExecutor._close_sockets`)


class RayExecutor(MultiprocExecutor):
    """`MultiprocExecutor` with its ranks in Ray actors (see the module docstring)."""

    def __init__(self, config: EngineConfig, max_model_len: int, ctx: zmq.Context | None = None,
                 **options) -> None:
        self._ray = _connect()
        self.node_ip = self._ray.util.get_node_ip_address()
        self.threads = config.parallel.cpu_threads or 1
        self._placement = None
        self._hosts: list = []
        self._name = f"tidal-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.keys = new_keys()
        self._auth = None  # the ZAP authenticator of our context, started at the first bind
        # A context of our own (`ctx` is not used): one ZAP authenticator per context, and
        # the daemon's may hold its frontend socket's (--engine-key-file).
        super().__init__(config, max_model_len, None, **options)

    # -- start-up (MultiprocExecutor.start calls _spawn_ranks, then waits for WorkerReady) ------

    def _bind(self, sock: zmq.Socket, tag: str) -> str:
        """Bind on this node's IP (reachable from the other nodes), a port of the kernel's,
        as a CURVE server that admits only our ranks' key (fresh for each executor)."""
        if self._auth is None:
            self._auth = curve_server(self.ctx, self.keys)
        return bind_curve_tcp(sock, self.node_ip, self.keys)

    def _spawn_ranks(self, stop_requested) -> None:
        bundle, device = self._bundle()
        self._reserve(bundle, stop_requested)
        num_ranks = self.config.parallel.world_size
        self._hosts = [self._new_host(rank, bundle) for rank in range(num_ranks)]
        ips = self._call([h.node_ip.remote() for h in self._hosts], "report its node")
        port = self._call(self._hosts[0].free_port.remote(), "find a free port")
        dist_init_method = f"tcp://{ips[0]}:{port}"
        for rank, (host, ip) in enumerate(zip(self._hosts, ips)):
            self._start_rank(rank, host, ip, device, dist_init_method)
        logger.info("worker ranks on Ray nodes %s (%s bundles of %s), torch.distributed at %s",
                    ips, len(ips), bundle, dist_init_method)

    def _bundle(self) -> tuple[dict[str, float], str]:
        """One rank's reservation and the device it runs on: a GPU where the cluster has one
        per rank (or --device cuda), else `threads` CPUs."""
        device = self.config.parallel.device
        if device == "auto":
            gpus = self._ray.cluster_resources().get("GPU", 0)
            device = "cuda" if gpus >= self.config.parallel.world_size else "cpu"
        if device == "cuda":
            return {"GPU": 1.0}, "cuda"
        return {"CPU": float(self.threads)}, "cpu"

    def _reserve(self, bundle: dict[str, float], stop_requested) -> None:
        """Reserve a placement group of one `bundle` per rank (packed onto as few nodes as
        hold them) and wait until it is ready. WorkerError at once when the cluster's nodes
        cannot hold them all; `kill()` frees it whatever happens here."""
        from ray.util.placement_group import placement_group

        num_ranks = self.config.parallel.world_size
        fits = _bundles_that_fit(self._ray.nodes(), bundle)
        if fits < num_ranks:
            raise WorkerError(
                f"the Ray cluster can hold {fits} of the {num_ranks} rank(s) of {bundle} "
                f"each (cluster resources: {self._ray.cluster_resources()}); add nodes "
                "(`ray start --address ...`) or lower --tensor-parallel-size / "
                "--pipeline-parallel-size")
        self._placement = placement_group([dict(bundle) for _ in range(num_ranks)],
                                          strategy="PACK", name=self._name)
        deadline = time.monotonic() + self.startup_timeout
        while not self._ray.wait([self._placement.ready()], timeout=0.2)[0]:
            if stop_requested():
                raise InterruptedError("stop requested during start-up")
            if time.monotonic() > deadline:
                raise WorkerError(f"Ray did not reserve {num_ranks} bundle(s) of {bundle} "
                                  f"within {self.startup_timeout:.0f} s")

    def _new_host(self, rank: int, bundle: dict[str, float]):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._placement,
                                                    placement_group_bundle_index=rank)
        return _host_class().options(
            num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
            scheduling_strategy=strategy, name=f"{self._name}-rank{rank}",
            namespace=ACTOR_NAMESPACE).remote()

    def _start_rank(self, rank: int, host, node_ip: str, device: str,
                    dist_init_method: str) -> None:
        sock, plan_address = self._plan_socket(rank)
        r = _RayRank(rank, host, node_ip, sock, plan_address)
        self.ranks.append(r)  # from here on its socket is closed with the others
        # The rank's node decides nothing: its device, threads and no core pinning (core
        # numbers are this machine's) are fixed here, the same for every rank.
        config = msgspec.structs.replace(
            self.config.worker_config(rank, self.max_model_len, dist_init_method,
                                      self.model_dir),
            device=device, cpu_threads=self.threads, cpu_cores=None)
        args = ["--config", encode_worker_config(config), "--plan-address", plan_address,
                "--result-address", self.result_address, "--log-level", self.log_level]
        r.pid = self._call(host.start.remote(args, self.threads, worker_keys_env(self.keys)),
                           f"start rank {rank}")
        r.done = host.wait.remote()
        logger.debug("started worker rank %d as pid %d on Ray node %s", rank, r.pid, node_ip)

    def _call(self, refs, what: str):
        """`ray.get(refs)` within the actor-call timeout; WorkerError naming `what`."""
        try:
            return self._ray.get(refs, timeout=_ACTOR_CALL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise WorkerError(f"a Ray rank actor did not {what} within "
                              f"{_ACTOR_CALL_TIMEOUT_S:.0f} s") from None
        except self._ray.exceptions.RayError as e:
            raise WorkerError(f"a Ray rank actor could not {what}: {_first_line(e)}") from None

    # -- liveness ------------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise WorkerError if any rank's process has exited or its actor died."""
        endings = self._endings(timeout=0)
        if endings:
            raise WorkerError(endings[0][0])

    def _peer_death(self, failed_rank: int) -> WorkerError | None:
        """None: a rank's failure is led by its cause in `_receive` (`_with_root_cause`),
        from Ray's notice of the death rather than a process handle."""
        return None

    def _endings(self, timeout: float) -> list[tuple[str, bool]]:
        """How each rank that ended did (`_ending`), kills first, once every rank has ended
        or `timeout` s have passed."""
        started = [r for r in self.ranks if r.done is not None]
        if not started:
            return []
        ended, _ = self._ray.wait([r.done for r in started], num_returns=len(started),
                                  timeout=timeout)
        endings = [self._ending(r) for r in started if r.done in ended]
        return sorted(endings, key=lambda ending: not ending[1])  # a kill before its echo

    def _receive(self, timeout: float):
        try:
            return super()._receive(timeout)
        except WorkerError as failure:
            raise WorkerError(self._with_root_cause(str(failure))) from None

    def _with_root_cause(self, failure: str) -> str:
        """`failure` led by the death that caused it, if Ray reports one soon.

        A rank whose peer died fails in its next collective (gloo: "Connection closed by
        peer") and says so at once, while Ray's notice of the peer's death (its actor killed,
        its node lost) comes a moment later. Waiting up to `_DEATH_NOTICE_S` for it (on the
        failure path only) lets the error name the actor that died, not the rank that
        noticed."""
        endings = self._endings(timeout=_DEATH_NOTICE_S)
        if endings and endings[0][1] and endings[0][0] not in failure:
            return f"{endings[0][0]}; then {failure}"
        return failure

    def _ending(self, r: _RayRank) -> tuple[str, bool]:
        """How rank `r` ended (its `done` is ready), and whether it was killed (its actor
        died, or a signal) rather than exiting by itself."""
        who = f"worker rank {r.rank} (pid {r.pid} on node {r.node_ip})"
        try:
            code = self._ray.get(r.done, timeout=0)
        except self._ray.exceptions.RayError as e:
            return f"{who}: its Ray actor died ({_first_line(e)})", True
        if code < 0:
            return f"{who} was killed by signal {-code}", True
        return f"{who} exited with code {code}", False

    def wait_fds(self) -> list[int]:
        """None: an actor has no file descriptor here (the daemon polls `check_alive`)."""
        return []

    # -- shut-down -----------------------------------------------------------------------------

    def shutdown(self, grace: float = 5.0) -> None:
        """Tell every rank to exit, wait up to `grace` s, then kill the actors and free the
        placement group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        frame = encode(Shutdown())
        for r in self.ranks:
            try:
                r.plan_sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        done = [r.done for r in self.ranks if r.done is not None]
        if done:
            ended, _ = self._ray.wait(done, num_returns=len(done), timeout=grace)
            if len(ended) < len(done):
                logger.warning("%d worker rank(s) did not exit within %.0f s; killing their "
                               "actors", len(done) - len(ended), grace)
        self._release()
        self._close_sockets()

    def kill(self) -> None:
        """Kill every rank's actor at once (its process dies with it) and free the placement
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._auth is not None:  # before the context terminates: it holds a socket there
            self._auth.stop()
            self._auth = None
        super()._close_sockets()

    def _release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for host in self._hosts:
            try:
                self._ray.kill(host, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead, or the cluster is gone
                logger.debug("ray.kill of a rank actor: %s", e)
        # Wait for the deaths (each `done` then resolves) before freeing the bundles: a
        # replacement placement group asked for while they still hold their CPUs fails,
        # and Ray retries it with a growing back-off (45 s measured here, against 3 s).
        done = [r.done for r in self.ranks if r.done is not None]
        if done:
            self._ray.wait(done, num_returns=len(done), timeout=_KILL_WAIT_S)
        if self._placement is not None:
            try:
                remove_placement_group(self._placement)
            except Exception as e:  # noqa: BLE001
                logger.debug("removing the placement group: %s", e)
        self._hosts, self._placement = [], None


def _connect():
    """The `ray` module, connected to a cluster: RAY_ADDRESS, else the one `ray start` began
    on this machine, else a new local one (ray.init's own order). WorkerError without ray."""
    try:
        import ray
    except ImportError:
        raise WorkerError("distributed_executor_backend=ray needs the ray package: "
                          "pip install 'tidal[ray]'") from None
    if not ray.is_initialized():
        # ray.init installs a SIGTERM handler that raises SystemExit; the daemon's own
        # handlers (stop admitting, fail what is unfinished, shut the workers down) must stay.
        handlers = _signal_handlers()
        try:
            ray.init(logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise WorkerError(f"cannot join a Ray cluster: {e}") from None
        finally:
            _restore_signal_handlers(handlers)
        logger.info("joined the Ray cluster at %s: %s", ray.get_runtime_context().gcs_address,
                    ray.cluster_resources())
    return ray


def _signal_handlers() -> dict:
    """SIGTERM's and SIGINT's handlers now (empty outside the main thread: none can change)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}


def _restore_signal_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _bundles_that_fit(nodes: list[dict], bundle: dict[str, float]) -> int:
    """How many copies of `bundle` the alive `nodes` (ray.nodes()) hold in total."""
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        total += int(min(have.get(key, 0.0) // amount for key, amount in bundle.items()))
    return total


def _first_line(error: Exception) -> str:
    """The line of a Ray error that says why: Ray's "The actor is dead because ..." (killed
    by `ray.kill`, its node has died, ...) when present, else its first line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    why = [line for line in lines if line.startswith("The actor is dead because")]
    return (why or lines or [type(error).__name__])[0]
