"""`tidal serve`: the engine-core daemon plus N HTTP server processes on one port.

    tidal serve [MODEL] [engine flags] [--host H] [--port P] [--api-server-count N]
                [--api-key K | $TIDAL_API_KEY] [--timeout-keep-alive S]
                [--timeout-request-header S]
                [--timeout-request-body S]        (read timeouts: server/timeouts.py)
                [--max-request-body-bytes N]      (413 beyond: server/body_limit.py)
                [--record-trace FILE]             (a request trace for `tidal tune`)
                [--responses-store-size N]        (/v1/responses kept: response_store.py)
    tidal serve --engine ADDRESS [--engine-key-file F] [server flags]   (attach, start no daemon)

Without MODEL (or --model) it serves the bundled demo model (tidal.frontend.demo) under the
name "tidal-demo" unless --served-model-name says otherwise.

Processes:

    tidal serve (supervisor: binds the port, starts the rest, stops everything on SIGTERM/INT)
      ├── engine-core daemon (unless --engine)          engine_core.launcher.DaemonProcess
      └── HTTP server 0..N-1 (spawned)  uvicorn on uvloop, each with its own AsyncLLM attached
                                         to the daemon, all accepting on the one listening
                                         socket the supervisor bound (the kernel hands each
                                         new connection to one of them): server 0 from the
                                         start (503 while loading), the others once attached

With N > 1 the supervisor also makes the shared admission counters (admission.py) and the
Prometheus multiprocess directory (metrics.py), set in the environment before any server
process imports prometheus_client.

Faults stay where they happen, and each process is restarted by the one rule of every
supervisor in tidal (`engine_core/supervisor.py`). An HTTP process that dies is started again
under the same index (its admission slot zeroed); the others, and their streams, go on. A
daemon that dies,
or echoes none of the supervisor's heartbeats for its --frontend-timeout (stopped or hung:
killed first; `engine_client.CoreLiveness`), is started again at the same address (at most
--max-engine-restarts times within 10 minutes, a warning with its last words each); the HTTP
processes answer 503 with Retry-After meanwhile, re-attach when it answers and resubmit
their unfinished requests (prompt plus the tokens already
streamed), so streams go on where they stopped (async_llm.py); requests that wait longer
than --engine-restart-timeout end with an error. The supervisor gives up (exit status 1,
everything stopped) only when a process could not start at all, when one index died more
than `_MAX_RESTARTS` times in `_RESTART_WINDOW_S`, or when its daemon died once more than it
may be restarted. On SIGTERM / SIGINT it exits with status 0: servers first (each ends its
streams with an error event, then detaches), then the daemon. A server attached with
`--engine` outlives that core the same way: 503 while it is away, re-attach and resubmit
when a core answers at the address again.

A supervisor that dies without stopping them (SIGKILL, a crash) takes them along: the daemon
and each server process watch a pipe only the supervisor holds open (`ipc/lifeline.py`), and
on its end-of-file stop as on SIGTERM, SIGKILLed if still there after a grace period. Before,
a server process outlived a SIGKILLed supervisor, holding the port and answering 503 for
good, and the next `tidal serve` on that port could not bind it. The last server process out
then removes the Prometheus multiprocess folder, which the supervisor removes on an orderly
stop (`_remove_metrics_dir_if_last`): it is left only when the last one is killed too.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

from ...engine_core.supervisor import Supervisor
from ...ipc.transport import new_private_address
from ..async_llm import (
    DEFAULT_ENGINE_RESTART_TIMEOUT_S,
    DEFAULT_MAX_ENGINE_RESTARTS,
)
from ..tools.options import add_tool_args, tools_from_args
from ..tools.request import ToolSettings
from .body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from .response_store import DEFAULT_STORE_SIZE
from .timeouts import (
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    DEFAULT_TIMEOUT_REQUEST_BODY_S,
    DEFAULT_TIMEOUT_REQUEST_HEADER_S,
    timed_http_protocol,
)

logger = logging.getLogger("tidal.serve")

_STOP_TIMEOUT_S = 15.0
_POLL_S = 0.25
_MAX_RESTARTS = 5  # restarts of one HTTP process index within _RESTART_WINDOW_S
_RESTART_WINDOW_S = 60.0
EXIT_NOT_STARTED = 3  # an HTTP process whose server never started (it could not attach, say)
_LIFELINE_GRACE_S = 10.0  # uvicorn's own graceful shutdown takes at most 5 s (see serve_one)
_SUPERVISOR_LIFELINE_GRACE_S = 30.0
API_KEY_ENV = "TIDAL_API_KEY"
_METRICS_LOCK = "servers.lock"
"""A file in the Prometheus multiprocess folder (no `.db`: prometheus_client reads only those)
on which each HTTP process holds a shared flock while it lives; the kernel drops it however
the process ends, so an exclusive lock succeeds only once no server process is left."""
"""`tidal serve` run by a tool (`--lifeline-fd`): its orderly stop takes up to 27 s (the HTTP
processes `_STOP_TIMEOUT_S` + 2 s to kill, then the engine core's 10 s), SIGKILL after."""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (tidal.engine_core.args) plus the HTTP server's flags."""
    from ...engine_core.args import add_engine_args, parse_bytes

    add_engine_args(parser)
    add_tool_args(parser)
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free)")
    g.add_argument("--engine", default=None, metavar="ADDRESS",
                   help="attach to the running engine core at ADDRESS instead of starting one")
    g.add_argument("--engine-key-file", default=None,
                   help="CURVE key file of the engine core (with --engine over tcp)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY'; without this flag, "
                   f"${API_KEY_ENV} when set (prefer it: a command line is visible to every "
                   "user of the machine)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP server processes sharing the port (default: 1)")
    g.add_argument("--frontend-timeout", type=float, default=None, metavar="S",
                   help="the engine core started here drops an HTTP process silent for S "
                        "seconds (its requests end with an error; it re-attaches) "
                        "(default: 10; with --engine it is `tidal core`'s flag)")
    g.add_argument("--max-engine-restarts", type=int, default=DEFAULT_MAX_ENGINE_RESTARTS,
                   metavar="N", help="start the engine core started here again when it dies "
                   "or stops answering, at most N times within 10 minutes (default: "
                   f"{DEFAULT_MAX_ENGINE_RESTARTS}; 0: exit 1 when it dies)")
    g.add_argument("--engine-restart-timeout", type=float,
                   default=DEFAULT_ENGINE_RESTART_TIMEOUT_S, metavar="S",
                   help="unfinished requests wait up to S seconds for a lost engine core to "
                   "come back (then they are resubmitted to it), else end with an error "
                   f"(default: {DEFAULT_ENGINE_RESTART_TIMEOUT_S:g}; 0: at once)")
    g.add_argument("--structured-outputs-any-whitespace", action="store_true",
                   help="JSON constraints (response_format, guided_json, structured_outputs) "
                   "allow free whitespace between tokens; default: compact JSON, as the "
                   "OpenAI API writes it (a request may still ask with structured_outputs: "
                   '{"disable_any_whitespace": false})')
    g.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    # (set by a tidal tool that runs this server as its child: ipc/lifeline.py)
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    g.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of the engine core started here and its workers (DEBUG: "
                        "also the tracebacks of start-up errors) (default: INFO)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    g.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   metavar="S", help="close a kept-alive connection idle this many seconds "
                   f"between two requests (default: {DEFAULT_TIMEOUT_KEEP_ALIVE_S})")
    g.add_argument("--timeout-request-header", type=float, metavar="S",
                   default=DEFAULT_TIMEOUT_REQUEST_HEADER_S,
                   help="close a connection whose request head has not arrived this many "
                   "seconds after it opened, or after its first byte following a keep-alive "
                   f"idle (default: {DEFAULT_TIMEOUT_REQUEST_HEADER_S:g})")
    g.add_argument("--record-trace", default=None, metavar="FILE",
                   help="write one JSON line per finished request to FILE: arrival time, "
                        "prompt and output length, keyed prefix-block hashes (never text); "
                        "a trace for `tidal tune --trace FILE`")
    g.add_argument("--timeout-request-body", type=float, metavar="S",
                   default=DEFAULT_TIMEOUT_REQUEST_BODY_S,
                   help="answer 408 and close when a request body has not arrived this many "
                   f"seconds after its head (default: {DEFAULT_TIMEOUT_REQUEST_BODY_S:g})")
    g.add_argument("--max-request-body-bytes", type=parse_bytes, metavar="N",
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="answer 413 to a request body larger than N bytes (16MiB, 1GB, ...) "
                   "before it is parsed; a chunked upload once it passes N (default: 16MiB)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served as model names, with "
                   "--enable-lora: name=path, or JSON {\"name\": ..., \"path\": ...} "
                   "(docs/lora.md)")
    g.add_argument("--no-ui", action="store_true",
                   help="do not serve the live page of the batch and its playground at / "
                   "(docs/ui.md; as llama-server's --no-webui)")
    g.add_argument("--responses-store-size", type=int, metavar="N", default=DEFAULT_STORE_SIZE,
                   help="responses each HTTP process keeps for GET /v1/responses/{id} and "
                   "previous_response_id, least recently used dropped first; 0 keeps none "
                   f"(default: {DEFAULT_STORE_SIZE}; per process: docs/responses.md)")


@dataclass
class ServerSpec:
    """What each HTTP server process needs (picklable; sent to spawned processes)."""

    engine_address: str
    key_file: str | None
    tokenizer: str | None
    served_model_names: list[str] | None
    api_key: str | None
    daemon_pid: int | None
    log_level: str = "info"
    access_log: bool = True
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    timeout_request_header: float = DEFAULT_TIMEOUT_REQUEST_HEADER_S
    timeout_request_body: float = DEFAULT_TIMEOUT_REQUEST_BODY_S
    engine_restart_timeout: float = DEFAULT_ENGINE_RESTART_TIMEOUT_S
    record_trace: tuple[str, bytes] | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    json_any_whitespace: bool = False
    responses_store_size: int = DEFAULT_STORE_SIZE
    tool_settings: ToolSettings | None = None
    chat_template: str | None = None
    lora_modules: list[tuple[str, str]] | None = None  # --lora-modules (name, path)
    api_server_count: int = 1
    ui: bool = True  # --no-ui turns the live page off


# --------------------------------------------------------------------------------------------
# one HTTP server process


def _setup_logging(index: int | None) -> None:
    name = "tidal serve" if index is None else f"tidal serve {index}"
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{name}] %(message)s")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _attach_engine(spec: ServerSpec):
    """AsyncLLM attached to the daemon; fails fast if the daemon process dies meanwhile."""
    import asyncio

    from ..async_llm import AsyncLLM

    create = asyncio.ensure_future(AsyncLLM.create(
        engine=spec.engine_address, key_file=spec.key_file, client_kind="http",
        tokenizer=spec.tokenizer, engine_restart_timeout=spec.engine_restart_timeout))
    while not create.done():
        await asyncio.wait({create}, timeout=_POLL_S)
        if not create.done() and spec.daemon_pid and not _pid_alive(spec.daemon_pid):
            create.cancel()
            raise RuntimeError("the engine core exited while this server was attaching")
    return create.result()


def serve_one(index: int, spec: ServerSpec, sock: socket.socket, slots,
              first_serving=None) -> int:
    """Run one HTTP server process until SIGTERM/SIGINT; its exit status. `first_serving`
    (a multiprocessing Event, with --api-server-count > 1): set once server 0 serves."""
    import asyncio

    import uvicorn

    from .app import Server, ServerSettings, build_app

    _setup_logging(index)
    failed: list[BaseException] = []

    def attach_failed(exc: BaseException) -> None:
        # Our own daemon's failure is echoed by it, once; an --engine attach's is ours to say.
        logger.log(logging.DEBUG if spec.daemon_pid else logging.ERROR,
                   "HTTP server %d could not attach to the engine core: %s", index, exc)
        failed.append(exc)
        server.should_exit = True

    # Only server 0 serves while the engine loads (503 "loading", /health 503): the others
    # accept connections on the shared socket once attached and once server 0 serves.
    # Were they all to accept at once, a request could reach one still attaching after
    # another's /health said 200 (a 503 in the suite beside two busy loops, with
    # --api-server-count 2); and were the others not to wait for server 0, their 200 could
    # come while server 0 still loads the tokenizer, and its next answer be a 503 "Loading
    # model" (CI's suite, 2026-12-05). A server 0 started again after that attaches before
    # it accepts, as the others.
    first = index == 0 and (first_serving is None or not first_serving.is_set())

    async def wait_for_first() -> None:
        while not first_serving.is_set() and not server.should_exit:
            await asyncio.sleep(0.02)
    settings = ServerSettings(served_model_names=spec.served_model_names,
                              api_key=spec.api_key, admission_slots=slots, server_index=index,
                              record_trace=spec.record_trace,
                              max_request_body_bytes=spec.max_request_body_bytes,
                              responses_store_size=spec.responses_store_size,
                              tool_settings=spec.tool_settings,
                              chat_template=spec.chat_template,
                              lora_modules=spec.lora_modules or [],
                              runtime_lora_loads=spec.api_server_count == 1,
                              ui=spec.ui,
                              attach_in_background=first,
                              on_attach_failed=attach_failed,
                              on_attached=(first_serving.set if first_serving is not None
                                           and index == 0 else None),
                              before_serving=(wait_for_first if first_serving is not None
                                              and not first else None),
                              json_any_whitespace=spec.json_any_whitespace)
    app = build_app(lambda: _attach_engine(spec), settings)
    http = timed_http_protocol(spec.timeout_request_header, spec.timeout_request_body)
    config = uvicorn.Config(app, loop="uvloop", http=http, lifespan="on",
                            log_level=spec.log_level, access_log=spec.access_log,
                            timeout_graceful_shutdown=5,
                            timeout_keep_alive=spec.timeout_keep_alive)
    server = Server(config)
    server.run(sockets=[sock])
    return 0 if server.started and not failed else EXIT_NOT_STARTED


def _server_process_main(index: int, spec: ServerSpec, sock: socket.socket, slots,
                         first_serving=None) -> None:
    from ...ipc.lifeline import watch_parent

    supervisor = multiprocessing.parent_process()
    if supervisor is not None:  # its sentinel: multiprocessing's pipe, EOF once it is gone
        watch_parent(supervisor.sentinel, _LIFELINE_GRACE_S, what=f"HTTP server {index}")
    metrics_lock = _hold_metrics_dir()
    if metrics_lock is not None and supervisor is not None:
        signal.signal(signal.SIGTERM, functools.partial(_end_on_sigterm, supervisor,
                                                        metrics_lock))
    sys.exit(serve_one(index, spec, sock, slots, first_serving))


def _end_on_sigterm(supervisor, lock_fd: int, signum: int, _frame) -> None:
    """SIGTERM, which uvicorn raises again once its graceful shutdown is over (and the
    lifeline sends when the supervisor is gone): without the supervisor, remove the metrics
    folder if this is the last server process; then end by the signal, as without this."""
    if not supervisor.is_alive():
        _remove_metrics_dir_if_last(lock_fd)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _hold_metrics_dir() -> int | None:
    """A shared lock on the Prometheus multiprocess folder's `_METRICS_LOCK`, held until this
    process exits; None when there is no such folder (a single HTTP process)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        return None
    fd = os.open(os.path.join(folder, _METRICS_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _remove_metrics_dir_if_last(lock_fd: int) -> None:
    """With the supervisor gone (SIGKILLed: it could not remove the folder), drop this
    process's shared lock; if no other server process holds one, this one is the last out and
    removes the folder. Two ending at once may both remove it: each tries after dropping its
    own lock, so at least one succeeds, and rmtree ignores what is already gone."""
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    os.close(lock_fd)
    try:
        probe = os.open(os.path.join(folder, _METRICS_LOCK), os.O_RDWR)
    except FileNotFoundError:
        return  # another one removed it
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another server process is still there: the last one out removes it
    finally:
        os.close(probe)
    shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# the supervisor


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket every server process accepts on (bound before they start)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _HttpProcess:
    """One HTTP server process (multiprocessing, spawned) as a supervised child."""

    def __init__(self, index: int, spawn_args: tuple) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_server_process_main, args=(index, *spawn_args),
                                name=f"tidal-http-{index}")
        self.proc.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.exitcode is None

    def kill(self) -> None:
        self.proc.kill()

    def stop(self) -> None:
        if self.proc.exitcode is None:
            self.proc.terminate()
        self.proc.join(_STOP_TIMEOUT_S)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(2.0)

    def failure_message(self, what: str) -> str:
        return f"{what} (pid {self.proc.pid}, exit status {self.proc.exitcode})"


class _ProcessTree:
    """Owns the daemon (if any), the server processes and the shared resources; each process
    has its `Supervisor` (engine_core/supervisor.py), the restart rule of every supervisor."""

    def __init__(self, ns: argparse.Namespace):
        self.ns = ns
        self.num_servers = ns.api_server_count
        self.engine: Supervisor | None = None  # of the daemon, unless --engine
        self.servers: list[Supervisor] = []  # of each HTTP process index
        self.metrics_dir: str | None = None
        self.stop_event = threading.Event()
        self.exit_code = 0
        self._spawn_args = None
        """(spec, socket, shared admission slots, the first server's Event: `serve_one`) of
        every HTTP process."""

    def start_engine(self) -> tuple[str, str | None, int | None]:
        """(address, tokenizer folder, daemon pid): start a daemon unless --engine."""
        if self.ns.engine:
            return self.ns.engine, self.ns.tokenizer, None
        from ...engine_core.args import config_from_args
        from ...engine_core.launcher import DaemonProcess
        from ...engine_core.model_files import prepare_model
        from ..demo import apply_demo_model_default

        apply_demo_model_default(self.ns)  # no MODEL: the bundled demo model, "tidal-demo"
        # ValueError names the flag; a Hub id is fetched now, once, before anything starts
        config = prepare_model(config_from_args(self.ns))
        if config.scheduler.max_queue_delay is not None:
            from ...engine_core.advice.step_cost import required_profile

            required_profile(config)  # refused at once, not after the daemon starts
        extra = ["--log-level", self.ns.log_level]
        if self.ns.frontend_timeout is not None:
            extra += ["--frontend-timeout", str(self.ns.frontend_timeout)]
        address = new_private_address()
        self.engine = Supervisor(
            "the engine core", functools.partial(DaemonProcess, config, address=address,
                                                 echo=True, extra_args=extra),
            self.ns.max_engine_restarts, flag="--max-engine-restarts",
            how="starting it again at the same address")
        daemon = self.engine.start()
        return address, config.model.tokenizer_path, daemon.pid

    def start_servers(self, spec: ServerSpec, sock: socket.socket) -> None:
        slots = first_serving = None
        if self.num_servers > 1:
            from .admission import make_shared_slots

            slots = make_shared_slots(self.num_servers)
            first_serving = multiprocessing.get_context("spawn").Event()
            self.metrics_dir = tempfile.mkdtemp(prefix="tidal-prometheus-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        self._spawn_args = (spec, sock, slots, first_serving)
        for index in range(self.num_servers):
            server = Supervisor(f"HTTP server tidal-http-{index}",
                                lambda index=index: _HttpProcess(index, self._spawn_args),
                                _MAX_RESTARTS, window_s=_RESTART_WINDOW_S)
            server.start()
            self.servers.append(server)

    def _restart_server(self, index: int) -> bool:
        """Start HTTP process `index` again after it died; False when it must not be: it
        never started serving, or it died too often lately."""
        server = self.servers[index]
        if server.child.proc.exitcode == EXIT_NOT_STARTED:
            logger.error("%s could not start; shutting down", server.what)
            return False
        if not server.may_restart(then="; the other servers and their streams go on"):
            logger.error("%s; shutting down", server.final_reason)
            return False
        slots = self._spawn_args[2]
        if slots is not None:
            slots[index] = 0  # its unfinished requests died with it
        server.respawn()
        return True

    def watch(self) -> None:
        """Block until a signal or a dead daemon, restarting HTTP processes that die and
        the daemon when it dies or goes silent (stopped or hung: killed first)."""
        liveness = None
        if self.engine is not None:
            from ..engine_client import CoreLiveness

            liveness = CoreLiveness(self.engine.child.address)
        try:
            while not self.stop_event.wait(_POLL_S):
                if self._engine_could_not_start():  # before its servers, which it takes down
                    self.exit_code = 1
                    return
                for index, server in enumerate(self.servers):
                    if not server.alive() and not self._restart_server(index):
                        self.exit_code = 1
                        return
                if liveness is None:
                    continue
                silent = liveness.silent()
                if silent is not None and self.engine.alive():
                    self.engine.kill_hung(f"echoed no heartbeat for {silent:.1f} s")
                    self.engine.child.wait(5.0)
                if not self.engine.alive():
                    if not self._restart_engine():
                        self.exit_code = 1
                        return
                    liveness.reset()
        finally:
            if liveness is not None:
                liveness.close()

    def _engine_could_not_start(self) -> bool:
        """Whether the daemon's first start failed with a start-up error (EXIT_BAD_START: the
        model or the config, found by its workers): not restarted, since the same error would
        recur; its one-line error was echoed already, so this says only what happens."""
        if self.engine is None or self.engine.budget.total or self.engine.alive():
            return False
        from ...engine_core.daemon import EXIT_BAD_START

        if self.engine.child.returncode() != EXIT_BAD_START:
            return False
        logger.error("the engine core could not start (its error is above); not starting it "
                     "again, the same error would recur")
        return True

    def _restart_engine(self) -> bool:
        """Start the dead daemon again at its address; False when it may not be (it died
        more than --max-engine-restarts times)."""
        if not self.engine.may_restart(then="; the HTTP servers re-attach and resubmit their "
                                       "unfinished requests"):
            logger.error("%s; shutting down", self.engine.final_reason)
            return False
        daemon = self.engine.respawn()  # what is left of the old one is stopped first
        spec, *rest = self._spawn_args
        # an HTTP process started from now on watches the new daemon while it attaches
        self._spawn_args = (replace(spec, daemon_pid=daemon.pid), *rest)
        return True

    def stop(self) -> None:
        """Servers first (they detach cleanly), then the daemon, then shared files."""
        procs = [server.child.proc for server in self.servers]
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()  # all at once, then wait
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(2.0)
        if self.engine is not None:
            self.engine.stop()
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _check_args(ns: argparse.Namespace) -> None:
    if ns.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {ns.api_server_count}")
    if _lora_modules(ns) and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for flag in ("max_num_queued_reqs", "max_num_queued_tokens"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    for flag in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body",
                 "max_request_body_bytes"):
        value = getattr(ns, flag)
        if not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if ns.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {ns.responses_store_size}")
    if ns.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts must be >= 0, got {ns.max_engine_restarts}")
    if not ns.engine_restart_timeout >= 0:
        raise ValueError(f"--engine-restart-timeout must be >= 0, got "
                         f"{ns.engine_restart_timeout}")
    if ns.frontend_timeout is not None:
        if ns.engine:
            raise ValueError("--frontend-timeout belongs to the engine core: with --engine, "
                             "give it to `tidal core`")
        if ns.frontend_timeout <= 0:
            raise ValueError(f"--frontend-timeout must be positive, got {ns.frontend_timeout}")


def _lora_modules(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora-modules' (name, path) pairs (ValueError naming the flag)."""
    return parse_lora_modules(getattr(ns, "lora_modules", None))


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules' (name, path) pairs: `name=path` or JSON `{"name", "path"}`; ValueError
    naming the flag otherwise."""
    pairs = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {item!r}: a JSON entry needs \"name\" and "
                                 "\"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: name and path must not be empty")
        if name in (n for n, _ in pairs):
            raise ValueError(f"--lora-modules names {name!r} twice")
        pairs.append((name, path))
    return pairs


def _api_key(ns: argparse.Namespace) -> str | None:
    """--api-key, else $TIDAL_API_KEY. Either way the key reaches the HTTP processes inside
    their ServerSpec, pickled through multiprocessing's pipe, never on a command line
    (/proc/PID/cmdline, `ps`, is readable by every user; a process's environment by its
    owner alone); --api-key itself is on this process's, hence the warning."""
    if ns.api_key:
        logger.warning("--api-key puts the key in this command line, which every user of "
                       "this machine can read (ps); set $%s instead", API_KEY_ENV)
        return ns.api_key
    return os.environ.get(API_KEY_ENV) or None


def _start_recording(path: str | None) -> tuple[str, bytes] | None:
    """--record-trace: the file (created with its header) and the recording's hash key."""
    if not path:
        return None
    from ...engine_core.advice.trace import start_recording

    try:
        key = start_recording(path)
    except OSError as exc:
        raise ValueError(f"--record-trace {path}: {exc}") from None
    logger.info("recording a request trace to %s", path)
    return path, key


def _served_names(names: str | list[str] | None) -> list[str] | None:
    """--served-model-name's names (one or several), None when not given."""
    if not names:
        return None
    return [names] if isinstance(names, str) else list(names)


def run_serve(ns: argparse.Namespace) -> int:
    """`tidal serve`: run until SIGTERM / SIGINT; the exit status."""
    _setup_logging(None)
    if ns.lifeline_fd is not None:  # a tool's child (tidal tune profile, tidal bench chaos)
        from ...ipc.lifeline import watch_parent

        watch_parent(ns.lifeline_fd, _SUPERVISOR_LIFELINE_GRACE_S, what="tidal serve")
    try:
        _check_args(ns)
        tool_settings, chat_template = tools_from_args(ns)
        sock = bind_socket(ns.host, ns.port)
    except (ValueError, OSError) as exc:
        print(f"tidal serve: {exc}", file=sys.stderr)
        return 2
    sup = _ProcessTree(ns)
    previous = {sig: signal.signal(sig, lambda *_: sup.stop_event.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        record_trace = _start_recording(ns.record_trace)  # a bad path fails before the daemon
        address, tokenizer, daemon_pid = sup.start_engine()
        spec = ServerSpec(address, ns.engine_key_file, tokenizer,
                          _served_names(ns.served_model_name),
                          _api_key(ns), daemon_pid, ns.uvicorn_log_level,
                          not ns.disable_uvicorn_access_log, ns.timeout_keep_alive,
                          ns.timeout_request_header, ns.timeout_request_body,
                          ns.engine_restart_timeout, record_trace,
                          max_request_body_bytes=ns.max_request_body_bytes,
                          responses_store_size=ns.responses_store_size,
                          tool_settings=tool_settings, chat_template=chat_template,
                          lora_modules=_lora_modules(ns),
                          api_server_count=ns.api_server_count, ui=not ns.no_ui,
                          json_any_whitespace=ns.structured_outputs_any_whitespace)
        sup.start_servers(spec, sock)
        host, port = sock.getsockname()[:2]
        logger.info("listening on http://%s:%d; starting %d HTTP server process(es) for the "
                    "engine core at %s", host, port, sup.num_servers, address)
        sup.watch()
    except ValueError as exc:
        print(f"tidal serve: {exc}", file=sys.stderr)
        sup.exit_code = 2
    finally:
        sup.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return sup.exit_code
