"""`tidal serve`: the engine-core daemon plus N HTTP server processes on one port.

    tidal serve [MODEL] [engine flags] [--host H] [--port P] [--api-server-count N]
                [--api-key K] [--timeout-keep-alive S] [--timeout-request-header S]
                [--timeout-request-body S]        (read timeouts: server/timeouts.py)
                [--record-trace FILE]             (a request trace for `tidal tune`)
    tidal serve --engine ADDRESS [--engine-key-file F] [server flags]   (attach, start no daemon)

Without MODEL (or --model) it serves the bundled demo model (tidal.frontend.demo) under the
name "tidal-demo" unless --served-model-name says otherwise.

Processes:

    tidal serve (supervisor: binds the port, starts the rest, stops everything on SIGTERM/INT)
      ├── engine-core daemon (unless --engine)          launcher.DaemonProcess
      └── HTTP server 0..N-1 (spawned)  uvicorn on uvloop, each with its own AsyncLLM attached
                                         to the daemon, all accepting on the one listening
                                         socket the supervisor bound (the kernel hands each
                                         new connection to one of them)

With N > 1 the supervisor also makes the shared admission counters (admission.py) and the
Prometheus multiprocess directory (metrics.py), set in the environment before any server
process imports prometheus_client. The supervisor exits when a server process or the daemon
dies (exit status 1), or on SIGTERM / SIGINT (exit status 0): servers first (they detach
from the daemon), then the daemon.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass

from tidal.frontend.server.timeouts import (
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    DEFAULT_TIMEOUT_REQUEST_BODY_S,
    DEFAULT_TIMEOUT_REQUEST_HEADER_S,
    timed_http_protocol,
)

logger = logging.getLogger("tidal.serve")

_STOP_TIMEOUT_S = 15.0
_POLL_S = 0.25


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (tidal.engine_core.args) plus the HTTP server's flags."""
    from tidal.engine_core.args import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free)")
    g.add_argument("--engine", default=None, metavar="ADDRESS",
                   help="attach to the running engine core at ADDRESS instead of starting one")
    g.add_argument("--engine-key-file", default=None,
                   help="CURVE key file of the engine core (with --engine over tcp)")
    g.add_argument("--api-key", default=os.environ.get("TIDAL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TIDAL_API_KEY)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP server processes sharing the port (default: 1)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
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
    record_trace: tuple[str, bytes] | None = None


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

    from tidal.frontend.async_llm import AsyncLLM

    create = asyncio.ensure_future(AsyncLLM.create(
        engine=spec.engine_address, key_file=spec.key_file, client_kind="http",
        tokenizer=spec.tokenizer))
    while not create.done():
        await asyncio.wait({create}, timeout=_POLL_S)
        if not create.done() and spec.daemon_pid and not _pid_alive(spec.daemon_pid):
            create.cancel()
            raise RuntimeError("the engine core exited while this server was attaching")
    return create.result()


def serve_one(index: int, spec: ServerSpec, sock: socket.socket, slots) -> int:
    """Run one HTTP server process until SIGTERM/SIGINT; its exit status."""
    import uvicorn

    from tidal.frontend.server.app import ServerSettings, build_app

    _setup_logging(index)
    settings = ServerSettings(served_model_names=spec.served_model_names,
                              api_key=spec.api_key, admission_slots=slots, server_index=index,
                              record_trace=spec.record_trace)
    app = build_app(lambda: _attach_engine(spec), settings)
    http = timed_http_protocol(spec.timeout_request_header, spec.timeout_request_body)
    config = uvicorn.Config(app, loop="uvloop", http=http, lifespan="on",
                            log_level=spec.log_level, access_log=spec.access_log,
                            timeout_graceful_shutdown=5,
                            timeout_keep_alive=spec.timeout_keep_alive)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0 if server.started else 3


def _server_process_main(index: int, spec: ServerSpec, sock: socket.socket, slots) -> None:
    sys.exit(serve_one(index, spec, sock, slots))


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


class _Supervisor:
    """Owns the daemon (if any), the server processes and the shared resources."""

    def __init__(self, ns: argparse.Namespace):
        self.ns = ns
        self.num_servers = ns.api_server_count
        self.daemon = None
        self.procs: list[multiprocessing.Process] = []
        self.metrics_dir: str | None = None
        self.stop_event = threading.Event()
        self.exit_code = 0

    def start_engine(self) -> tuple[str, str | None, int | None]:
        """(address, tokenizer folder, daemon pid): start a daemon unless --engine."""
        if self.ns.engine:
            return self.ns.engine, self.ns.tokenizer, None
        from tidal.engine_core.args import config_from_args
        from tidal.frontend.demo import apply_demo_model_default
        from tidal.frontend.launcher import DaemonProcess

        apply_demo_model_default(self.ns)  # no MODEL: the bundled demo model, "tidal-demo"
        config = config_from_args(self.ns)  # ValueError names the flag
        if config.scheduler.max_queue_delay is not None:
            from tidal.engine_core.step_cost import required_profile

            required_profile(config)  # refused at once, not after the daemon starts
        self.daemon = DaemonProcess(config, echo=True)
        return self.daemon.address, config.model.tokenizer_path, self.daemon.pid

    def start_servers(self, spec: ServerSpec, sock: socket.socket) -> None:
        ctx = multiprocessing.get_context("spawn")
        slots = None
        if self.num_servers > 1:
            from tidal.frontend.server.admission import make_shared_slots

            slots = make_shared_slots(self.num_servers)
            self.metrics_dir = tempfile.mkdtemp(prefix="tidal-prometheus-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        for index in range(self.num_servers):
            proc = ctx.Process(target=_server_process_main, args=(index, spec, sock, slots),
                               name=f"tidal-http-{index}")
            proc.start()
            self.procs.append(proc)

    def watch(self) -> None:
        """Block until a signal, a dead server process or a dead daemon."""
        while not self.stop_event.wait(_POLL_S):
            for proc in self.procs:
                if proc.exitcode is not None:
                    logger.error("HTTP server %s exited with status %s; shutting down",
                                 proc.name, proc.exitcode)
                    self.exit_code = 1
                    return
            if self.daemon is not None and not self.daemon.alive():
                logger.error("%s; shutting down",
                             self.daemon.failure_message("the engine core exited"))
                self.exit_code = 1
                return

    def stop(self) -> None:
        """Servers first (they detach cleanly), then the daemon, then shared files."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(2.0)
        if self.daemon is not None:
            self.daemon.stop()
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _check_args(ns: argparse.Namespace) -> None:
    if ns.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {ns.api_server_count}")
    if ns.max_num_queued_reqs is not None and ns.max_num_queued_reqs < 1:
        raise ValueError(f"--max-num-queued-reqs must be at least 1, got "
                         f"{ns.max_num_queued_reqs}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    for flag in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
        value = getattr(ns, flag)
        if not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")


def _start_recording(path: str | None) -> tuple[str, bytes] | None:
    """--record-trace: the file (created with its header) and the recording's hash key."""
    if not path:
        return None
    from tidal.tune.trace import start_recording

    try:
        key = start_recording(path)
    except OSError as exc:
        raise ValueError(f"--record-trace {path}: {exc}") from None
    logger.info("recording a request trace to %s", path)
    return path, key


def run_serve(ns: argparse.Namespace) -> int:
    """`tidal serve`: run until SIGTERM / SIGINT; the exit status."""
    _setup_logging(None)
    try:
        _check_args(ns)
        sock = bind_socket(ns.host, ns.port)
    except (ValueError, OSError) as exc:
        print(f"tidal serve: {exc}", file=sys.stderr)
        return 2
    sup = _Supervisor(ns)
    previous = {sig: signal.signal(sig, lambda *_: sup.stop_event.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        record_trace = _start_recording(ns.record_trace)  # a bad path fails before the daemon
        address, tokenizer, daemon_pid = sup.start_engine()
        spec = ServerSpec(address, ns.engine_key_file, tokenizer,
                          [ns.served_model_name] if ns.served_model_name else None,
                          ns.api_key, daemon_pid, ns.uvicorn_log_level,
                          not ns.disable_uvicorn_access_log, ns.timeout_keep_alive,
                          ns.timeout_request_header, ns.timeout_request_body, record_trace)
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
