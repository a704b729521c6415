"""The data-parallel request router: `tidal core MODEL -dp N` (and so `tidal serve -dp N`,
`LLM(..., data_parallel_size=N)`) runs this process in place of one engine core.

    frontends ──(the frontend protocol, unchanged)──► router ──► engine core 0 ──► workers
                                                             └─► engine core 1 ──► workers

Design. To every frontend the router is an engine core: it binds `--listen`, answers Hello with
an `EngineInfo` (core 0's, KV blocks and sequence slots summed over the cores), and speaks
exactly the frontend's messages (`ipc/frontend_messages.py`), so `tidal serve`,
`--api-server-count`, `LLM`, `AsyncLLM` and their healing work unchanged, and one router places
the requests of all of them, with one memory of which core holds which prefix. To each core the
router is one frontend (a DEALER per core, client id `router-<pid>-<core>`) that heartbeats.
Each core is a private daemon of the router's (`launcher.DaemonProcess`: own process group,
lifeline) with its own workers and KV pool, on a private address. vLLM puts the choice in every
frontend's client and has a coordinator process gather the load; here one process does both,
which costs one hop (outputs are decoded and re-encoded here, a few microseconds per step) and
buys a single prefix memory and frontends that know nothing of DP.

A request. `AddRequest` → `dp_placement.Placement` picks a live core (least load, prefix
affinity) → the frame goes to that core as is. The core's outputs come back in one
`EngineOutputs` per step; the router splits them by the frontend that sent each request and
keeps each unfinished request's generated tokens. `Abort` goes to the cores holding the
sender's own requests. `StatsQuery` is answered with `merge_stats` of a fresh round of
queries to every live core (also run every `STATS_POLL_S` while requests are in flight, and
once after the last one ends: the placement's load).

A core that dies (its process exits), or sends nothing for its `--frontend-timeout` (it
echoes every heartbeat: silence means stopped or hung, and the router kills it), takes down
only itself: its requests are resubmitted to
the live cores under the same request ids, as the frontends' own healing does (prompt plus the
tokens already delivered, `max_tokens` / `min_tokens` reduced, the same seed: greedy and
seeded outputs equal a fault-free run's), so their streams pause and go on. Meanwhile the core
is started again (at most `MAX_CORE_RESTARTS` times within 10 minutes, by the `Supervisor`
rule of every restart in tidal), and takes requests once it answers.
With no live core the requests wait for one; when every core is dead for good, every request
ends with an error, the frontends get `EngineDead` and the router exits 1, and a frontend that
started it starts it again. A core that ends requests itself (a worker failure past its
`--max-worker-restarts`, SIGTERM) sends their ERROR outputs first: those are forwarded.

Toward the frontends the router owns the same `FrontendPort` as a core (frontend_port.py):
Hello, heartbeat echoes, silent frontends dropped (ERROR for their requests, aborted in the
cores, then `Detached`), `Detached` for unknown ones. SIGTERM / SIGINT: every unfinished
request ends with an error, `EngineDead` to the frontends, the cores are stopped, exit 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq

from .args import config_from_args
from .config import EngineConfig
from .dp_cores import core_config, core_env, core_gpu_sets, visible_gpus
from .dp_placement import Placement, merge_stats
from .frontend_port import FrontendPort
from .launcher import DaemonProcess
from .model_files import model_folder
from .restart_budget import RESTART_WINDOW_S
from .stop_signals import StopSignals
from .supervisor import Supervisor
from ..ipc.frontend_messages import (
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
from ..ipc.heartbeat import HeartbeatClock
from ..ipc.lifeline import watch_parent
from ..ipc.messages import pack_token_ids, unpack_token_ids
from ..ipc.resume import lost_finish, resume_params
from ..ipc.transport import (
    DEFAULT_FRONTEND_TIMEOUT_S,
    CoreToFrontendDecoder,
    connect_frontend_socket,
    default_engine_address,
    encode,
    heartbeat_interval,
    new_private_address,
)

logger = logging.getLogger("tidal.router")

EXIT_OK, EXIT_CORES_FAILED, EXIT_BAD_START = 0, 1, 2
MAX_CORE_RESTARTS = 3
"""How many times within 10 minutes the router starts one dead engine core again."""
STATS_POLL_S = 0.25
"""Seconds between two load queries to the cores while requests are in flight."""
STATS_ROUND_TIMEOUT_S = 2.0
"""A stats round waits this long for a busy core, then answers with the others."""
HELLO_RETRY_S = 1.0
"""A core that has not answered Hello (starting, restarting) is asked again this often."""
_POLL_MS = 100  # longest wait: housekeeping (timeouts, heartbeats, core exits) runs this often
_LIFELINE_GRACE_S = 30.0  # the router stops its cores in order; SIGKILLed past this


@dataclass
class _Core:
    """One engine core the router started, and its connection."""

    index: int
    supervisor: Supervisor[DaemonProcess]  # its process, started again when it dies
    sock: zmq.Socket
    client_id: str
    info: EngineInfo | None = None  # None until it answers Hello (starting or restarting)
    last_hello: float = 0.0
    clock: HeartbeatClock | None = None  # beats to it and its echoes, from its EngineInfo on
    dead_for_good: bool = False


@dataclass
class _Routed:
    """An unfinished request: whose it is, where it runs, how to send it again."""

    client_id: str
    core: int | None  # None: waiting for a live core
    add: AddRequest
    generated: bytearray  # packed token ids delivered so far
    aborted: bool = False  # the Abort went to its core: not to be moved if that core dies


class Router:
    """N engine cores behind one frontend socket; `run()` returns the exit code."""

    def __init__(self, config: EngineConfig, listen: str, key_file: str | None = None,
                 frontend_timeout: float = DEFAULT_FRONTEND_TIMEOUT_S,
                 log_level: str = "INFO") -> None:
        self.config = config
        self.listen = listen
        self.frontend_timeout = frontend_timeout
        self.log_level = log_level
        self.num_cores = config.parallel.data_parallel_size
        self.ctx = zmq.Context()
        self.port = FrontendPort(self, listen, key_file, frontend_timeout, self.ctx)
        self.core_decoder = CoreToFrontendDecoder()
        self.placement = Placement(self.num_cores, config.cache.block_size)
        self.cores: list[_Core] = []
        self.routed: dict[str, _Routed] = {}  # req_id -> request
        self.info: EngineInfo | None = None  # once every core answered
        self.signals = StopSignals()  # SIGTERM / SIGINT: stop in order
        self._stats_waiters: set[str] = set()  # client ids the running round answers
        self._stats_next: set[str] = set()  # asked during a round: answered by the next one
        self._view_next = False  # one of them asked for the live batch view
        self._stats_round: set[int] = set()  # cores whose answer the round still waits for
        self._stats_round_started = 0.0
        self._last_poll = 0.0
        self._latest_stats: dict[int, SchedulerStats] = {}  # core -> its last answer
        self._poller: zmq.Poller | None = None
        # the cores' load may differ from their last reports: requests came or went since
        self._load_changed = False

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def stop_reason(self) -> str | None:
        """The stop signal's name once one came."""
        return self.signals.reason

    def run(self) -> int:
        code = EXIT_CORES_FAILED
        with self.signals:
            try:
                code = self._start()
                if code is None:
                    code = self._serve()
                return code
            except Exception as e:  # noqa: BLE001 - a bug must still reach the frontends
                logger.exception("router failed")
                self._fail_everything(f"the data-parallel router failed: "
                                      f"{type(e).__name__}: {e}")
                return EXIT_CORES_FAILED
            finally:
                self._close()
                logger.info("router stopped (exit code %d)", code)

    def _start(self) -> int | None:
        """Bind, start every core, wait until each answers Hello. An exit code on failure."""
        try:
            self.port.bind()
        except (ValueError, OSError) as e:
            logger.error("cannot start: %s", e)
            return EXIT_BAD_START
        logger.info("data-parallel router listening on %s: starting %d engine cores",
                    self.listen, self.num_cores)
        try:
            self._start_cores()
        except InterruptedError:
            return EXIT_OK
        except ValueError as e:  # a GGUF file that does not convert, too few GPUs
            logger.error("cannot start: %s", e)
            self.port.fail_start(f"engine core failed to start: {e}")
            return EXIT_BAD_START
        return self._wait_for_cores()

    def _start_cores(self) -> None:
        """Convert a GGUF file (once here, not by every core at once), then start each core
        on threads or GPUs of its own. ValueError; InterruptedError on a stop signal."""
        folder = model_folder(self.config.model.model, self.signals.requested, self.log_level)
        child = core_config(self.config, folder)
        gpu_sets = core_gpu_sets(self.config, visible_gpus(os.environ))
        for index in range(self.num_cores):
            env = core_env(self.config, dict(os.environ),
                           None if gpu_sets is None else gpu_sets[index])
            start = functools.partial(DaemonProcess, child,
                                      address=new_private_address(f"core{index}"),
                                      extra_args=["--log-level", self.log_level], env=env)
            supervisor = Supervisor(f"engine core {index}", start, MAX_CORE_RESTARTS)
            supervisor.start()
            self.cores.append(self._connect(index, supervisor))

    def _wait_for_cores(self) -> int | None:
        """Until every core answers Hello; then answer the frontends that knocked meanwhile.
        An exit code when a core fails to start or a stop signal comes first."""
        while self.stop_reason is None and any(c.info is None for c in self.cores):
            self._poll_once()
            failed = next((c for c in self.cores if not c.supervisor.alive()), None)
            if failed is not None:
                reason = failed.supervisor.last_words(f"engine core {failed.index} failed "
                                                       "to start")
                logger.error("%s", reason)
                self.port.fail_start(reason)
                return EXIT_BAD_START
        if self.stop_reason is not None:
            self.port.fail_start(f"stopped during start-up ({self.stop_reason})")
            return EXIT_OK
        self.info = self._merged_info()
        self.port.ready(self.info)
        logger.info("router ready: %d engine cores, %d KV blocks in all", self.num_cores,
                    self.info.num_kv_blocks)
        return None

    def _connect(self, index: int, supervisor: Supervisor[DaemonProcess]) -> _Core:
        client_id = f"router-{os.getpid()}-{index}"
        sock = connect_frontend_socket(self.ctx, supervisor.child.address, client_id)
        core = _Core(index, supervisor, sock, client_id)
        self._poller = None
        self._hello(core)
        return core

    def _hello(self, core: _Core) -> None:
        core.last_hello = time.monotonic()
        core.sock.send(encode(Hello(core.client_id, "router", os.getpid())))

    def _merged_info(self) -> EngineInfo:
        infos = [c.info for c in self.cores]
        return msgspec.structs.replace(
            infos[0], num_kv_blocks=sum(i.num_kv_blocks for i in infos),
            max_num_seqs=sum(i.max_num_seqs for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
            heartbeat_interval=heartbeat_interval(self.frontend_timeout),
            frontend_timeout=self.frontend_timeout)

    def _serve(self) -> int:
        while self.stop_reason is None:
            self._poll_once()
            self._watch_cores()
            if self._all_dead_for_good():
                reason = ("every engine core died more often than it may be restarted "
                          f"({MAX_CORE_RESTARTS} restarts each within "
                          f"{RESTART_WINDOW_S / 60:g} min)")
                logger.error("%s; failing every unfinished request", reason)
                self._fail_everything(reason)
                return EXIT_CORES_FAILED
        logger.info("stopping (%s): failing unfinished requests, stopping the cores",
                    self.stop_reason)
        self._fail_everything(f"engine core shut down ({self.stop_reason})")
        return EXIT_OK

    def _close(self) -> None:
        for core in self.cores:
            core.supervisor.child.proc.send_signal(signal.SIGTERM)  # all at once, then wait
        for core in self.cores:
            core.supervisor.stop()
            core.sock.close(linger=0)
        self.port.close()  # linger: queued EngineDead / outputs still go out
        self.ctx.term()

    # -- the loop ------------------------------------------------------------------------------

    def _poll_once(self) -> None:
        """Handle what arrived within `_POLL_MS`, then the timers."""
        if self._poller is None:  # rebuilt when a core's socket changes
            self._poller = zmq.Poller()
            self._poller.register(self.port.sock, zmq.POLLIN)
            for core in self.cores:
                self._poller.register(core.sock, zmq.POLLIN)
        events = dict(self._poller.poll(_POLL_MS))
        if self.port.sock in events:
            self.port.drain()
        for core in self.cores:
            if core.sock in events:
                self._drain(core.sock, lambda frames, c=core: self._on_core_frames(c, frames))
        self._housekeeping(time.monotonic())

    def _drain(self, sock: zmq.Socket, handle) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    def _housekeeping(self, now: float) -> None:
        for core in self.cores:
            if core.info is None and not core.dead_for_good \
                    and now - core.last_hello > HELLO_RETRY_S:
                self._hello(core)
            elif core.info is not None:
                self._beat(core, now)
        if self.info is None:
            return
        self.port.expire_silent()
        if self._stats_round and now - self._stats_round_started > STATS_ROUND_TIMEOUT_S:
            self._finish_stats_round()
        if self._load_changed and not self._stats_round and now - self._last_poll > STATS_POLL_S:
            self._start_stats_round()

    def _beat(self, core: _Core, now: float) -> None:
        """Heartbeat an attached core when due; a core that echoed nothing for its
        --frontend-timeout is stopped or hung: killed, so that `_watch_cores` moves its
        requests and starts it again as after any exit."""
        if core.clock.beat_due(now):
            core.clock.beat(now)
            core.sock.send(encode(Heartbeat(core.client_id)))
        silent = core.clock.silent_for(now)
        if silent > core.info.frontend_timeout:
            core.supervisor.kill_hung(f"echoed no heartbeat for {silent:.1f} s "
                                      f"(--frontend-timeout {core.info.frontend_timeout:g} s)")
            core.info = None

    # -- what the frontend port asks (frontend_port.PortOwner) -------------------------------

    def add_request(self, client_id: str, msg: AddRequest, frame: bytes) -> None:
        if msg.req_id in self.routed:
            self.port.refuse(client_id, msg.req_id, f"req_id {msg.req_id!r} is already in flight")
            return
        request = _Routed(client_id, None, msg, bytearray())
        self.routed[msg.req_id] = request
        self._load_changed = True
        self._place(request, frame)

    def abort(self, client_id: str, req_ids: list[str]) -> None:
        """Abort the sender's own requests among `req_ids` (others are ignored)."""
        by_core: dict[int, list[str]] = {}
        answered = []  # never reached a core: the router answers
        for req_id in req_ids:
            request = self.routed.get(req_id)
            if request is None or request.client_id != client_id:
                continue
            if request.core is None:
                del self.routed[req_id]
                answered.append(EngineCoreOutput(req_id, b"", FinishReason.ABORT))
            else:
                request.aborted = True
                by_core.setdefault(request.core, []).append(req_id)
        self.port.send_outputs({client_id: answered})
        for core, ids in by_core.items():
            self.cores[core].sock.send(encode(Abort(ids)))

    def stats_query(self, client_id: str, view_since: int = -1) -> None:
        # a round already running may have asked before this frontend's last outputs
        # left their core: answer from a round that starts now
        self._stats_next.add(client_id)
        # The live view: each core's step ids are its own, so the router asks every core for
        # its newest steps and the page tells them apart by core (`SchedulerStats.cores`).
        self._view_next |= view_since >= 0
        if not self._stats_round:
            self._start_stats_round()

    def detach(self, client_id: str) -> int:
        return self._forget_client(client_id)

    def drop(self, client_id: str, reason: str) -> list[EngineCoreOutput]:
        outputs = [EngineCoreOutput(rid, b"", FinishReason.ERROR, error=reason)
                   for rid, r in self.routed.items() if r.client_id == client_id]
        self._forget_client(client_id)
        return outputs

    def _place(self, request: _Routed, frame: bytes | None = None) -> None:
        """Send the request to the core the placement picks; with no live core it waits."""
        try:
            prompt = unpack_token_ids(request.add.prompt_token_ids)
        except ValueError:  # not whole int32s: any core refuses it, naming the field
            prompt = []
        core = self.placement.place(prompt, request.add.cache_salt)
        request.core = core
        if core is not None:
            self.cores[core].sock.send(frame if frame is not None else encode(request.add))

    def _forget_client(self, client_id: str) -> int:
        """Abort every request of the frontend in the cores and forget them."""
        own = [rid for rid, r in self.routed.items() if r.client_id == client_id]
        by_core: dict[int, list[str]] = {}
        for req_id in own:
            request = self.routed.pop(req_id)
            if request.core is not None:
                by_core.setdefault(request.core, []).append(req_id)
        for core, ids in by_core.items():
            self.cores[core].sock.send(encode(Abort(ids)))
        self._stats_waiters.discard(client_id)
        self._stats_next.discard(client_id)
        return len(own)

    # -- cores ---------------------------------------------------------------------------------

    def _on_core_frames(self, core: _Core, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.core_decoder.drop(f"{len(frames)}-part message", core.client_id)
            return
        if core.clock is not None:
            core.clock.heard(time.monotonic())
        msg = self.core_decoder.decode(frames[0], sender=f"engine core {core.index}")
        if isinstance(msg, EngineOutputs):
            self._on_outputs(core, msg)
        elif isinstance(msg, EngineInfo):
            self._on_core_info(core, msg)
        elif isinstance(msg, Detached):
            # the core dropped the router (silent past its --frontend-timeout); it failed our
            # requests there first (forwarded): say Hello again
            logger.warning("engine core %d dropped the router: %s", core.index, msg.reason)
            core.info = None
            self.placement.mark_dead(core.index)
        elif isinstance(msg, EngineDead):
            logger.warning("engine core %d is going away: %s", core.index, msg.reason)

    def _on_core_info(self, core: _Core, info: EngineInfo) -> None:
        if core.info is not None:
            return  # a second answer to a repeated Hello
        core.info, core.clock = info, HeartbeatClock(info.heartbeat_interval)
        self.placement.mark_live(core.index)
        if self.info is not None:
            logger.info("engine core %d is serving again", core.index)
        for request in [r for r in self.routed.values() if r.core is None]:
            self._place(request)

    def _on_outputs(self, core: _Core, msg: EngineOutputs) -> None:
        if msg.stats is not None and core.index in self._stats_round:
            self._on_core_stats(core, msg.stats)
        by_client: dict[str, list[EngineCoreOutput]] = {}
        for out in msg.outputs:
            request = self.routed.get(out.req_id)
            if request is None or request.core != core.index:
                continue  # aborted, or a late output of a core the request left
            request.generated += out.new_token_ids
            if out.finish_reason is not None:
                del self.routed[out.req_id]
                self._load_changed = True
            by_client.setdefault(request.client_id, []).append(out)
        self.port.send_outputs(by_client, msg.timestamp)

    def _watch_cores(self) -> None:
        """A core whose process exited: move its requests, start it again."""
        for core in self.cores:
            supervisor = core.supervisor
            if core.dead_for_good or supervisor.alive():
                continue
            moved = self._move_requests_off(core.index)
            then = f"; {moved} of its requests continue on the other cores"
            if not supervisor.may_restart(then=then):
                logger.error("%s: not again%s", supervisor.final_reason, then)
                core.dead_for_good, core.info = True, None
                supervisor.stop()
                continue
            core.sock.close(linger=0)
            supervisor.respawn()  # what is left of its process group is stopped first
            self.cores[core.index] = self._connect(core.index, supervisor)

    def _move_requests_off(self, index: int) -> int:
        """The dead core's requests continue elsewhere (see the module docstring)."""
        self.placement.mark_dead(index)
        self._stats_round.discard(index)
        moved = 0
        for req_id, request in list(self.routed.items()):
            if request.core != index:
                continue
            resumed = None if request.aborted else resume_request(request.add, request.generated)
            if resumed is None:  # aborted (its answer died with the core), or all delivered
                del self.routed[req_id]
                final = EngineCoreOutput(req_id, b"", FinishReason.ABORT) if request.aborted \
                    else lost_output(request.add, request.generated)
                self.port.send_outputs({request.client_id: [final]})
                continue
            request.add, request.generated = resumed, bytearray()
            self._place(request)
            moved += 1
        return moved

    def _all_dead_for_good(self) -> bool:
        return all(c.dead_for_good for c in self.cores)

    # -- statistics ----------------------------------------------------------------------------

    def _start_stats_round(self) -> None:
        self._stats_waiters, self._stats_next = self._stats_next, set()
        view_since, self._view_next = (0 if self._view_next else -1), False
        now = time.monotonic()
        self._last_poll = self._stats_round_started = now
        self._load_changed = bool(self.routed)  # one more round after the last one finished
        self._stats_round = {c.index for c in self.cores if c.info is not None}
        for index in self._stats_round:
            self.placement.query_sent(index)
            core = self.cores[index]
            core.sock.send(encode(StatsQuery(core.client_id, view_since)))
        if not self._stats_round:
            self._finish_stats_round()

    def _on_core_stats(self, core: _Core, stats: SchedulerStats) -> None:
        self._latest_stats[core.index] = stats
        self.placement.report(core.index, stats)
        self._stats_round.discard(core.index)
        if not self._stats_round:
            self._finish_stats_round()

    def _finish_stats_round(self) -> None:
        self._stats_round = set()
        if self._stats_waiters:
            total = merge_stats([self._latest_stats.get(i) or SchedulerStats()
                                 for i in range(self.num_cores)])
            self.port.send_stats(self._stats_waiters, total)
            self._stats_waiters.clear()
        if self._stats_next:
            self._start_stats_round()

    # -- the end -------------------------------------------------------------------------------

    def _fail_everything(self, reason: str) -> None:
        if self.port.sock is None:
            return
        by_client: dict[str, list[EngineCoreOutput]] = {}
        for req_id, request in self.routed.items():
            by_client.setdefault(request.client_id, []).append(
                EngineCoreOutput(req_id, b"", FinishReason.ERROR, error=reason))
        self.routed.clear()
        self.port.send_outputs(by_client)
        self.port.broadcast(EngineDead(reason))


# ---------------------------------------------------------------------------------------------
# pieces without IO


def resume_request(add: AddRequest, generated: bytes) -> AddRequest | None:
    """The request that continues `add` after its `generated` tokens (packed) on another
    core: prompt plus those tokens, the same id, seed and stops (`resume_params`). None when
    it has nothing left to generate (its final output was lost with the core)."""
    delivered = unpack_token_ids(bytes(generated)).tolist()
    if not delivered:
        return add
    params = resume_params(add.sampling, delivered)
    if params is None:
        return None
    prompt = pack_token_ids(unpack_token_ids(add.prompt_token_ids).tolist() + delivered)
    return msgspec.structs.replace(add, prompt_token_ids=prompt, sampling=params,
                                   num_resumed_tokens=add.num_resumed_tokens + len(delivered))


def lost_output(add: AddRequest, generated: bytes) -> EngineCoreOutput:
    """The final output of a request whose every token was delivered but whose finish was
    lost with its core."""
    delivered = unpack_token_ids(bytes(generated)).tolist()
    reason, stop = lost_finish(add.sampling, delivered, add.eos_token_id)
    return EngineCoreOutput(add.req_id, b"", FinishReason[reason.upper()], stop_reason=stop)


# ---------------------------------------------------------------------------------------------
# entry point


def run_router_from_args(ns: argparse.Namespace) -> int:
    """`tidal core -dp N`: the router and its cores, from the daemon's flags; the exit code."""
    logging.basicConfig(level=ns.log_level,
                        format="%(asctime)s %(levelname)s [tidal router] %(message)s")
    if ns.lifeline_fd is not None:  # a private router: stop with the frontend that owns it
        watch_parent(ns.lifeline_fd, _LIFELINE_GRACE_S, what="data-parallel router")
    try:
        config = config_from_args(ns)
    except ValueError as e:
        logger.error("%s", e)
        return EXIT_BAD_START
    listen = ns.listen or default_engine_address()
    return Router(config, listen, ns.engine_key_file, ns.frontend_timeout, ns.log_level).run()


if __name__ == "__main__":  # pragma: no cover - `tidal core -dp N` is the way in
    sys.exit("run `tidal core MODEL --data-parallel-size N`")
