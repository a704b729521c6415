"""The frontend port: the engine side of the frontend conversation (docs/architecture.md §2.1),
written once for the two processes that speak it, the engine core daemon and the
data-parallel router.

    port = FrontendPort(owner, listen, key_file, frontend_timeout)
    port.bind()                  # ValueError / OSError when the address is taken or refused
    port.ready(info)             # answers every Hello that came while starting
    port.drain()                 # each queued frame: protocol here, requests to `owner`
    port.expire_silent()         # frontends silent past frontend_timeout are dropped
    port.send_outputs({client_id: [EngineCoreOutput, ...]})
    port.close()

A frontend is its zmq identity (= its client_id) on one ROUTER socket. What the port does by
itself, the same in both processes:

- **Hello** attaches a frontend and is answered with the `EngineInfo` (again on every Hello).
  Before `ready()` no frontend is attached: Hellos are remembered and answered by `ready()`,
  or with `EngineDead` by `fail_start()`; any other frame is ignored meanwhile.
- **Heartbeat** is echoed, so a frontend that hears nothing for its timeout knows the
  engine is stopped or hung. Every frame counts as a sign of life.
- **Silence.** A frontend that sent nothing for `frontend_timeout` seconds is dropped:
  `owner.drop(client_id, reason)` fails its requests (the ERROR outputs it returns are sent
  first), then the frontend gets `Detached` and is forgotten.
- **Goodbye**: `owner.detach(client_id)` aborts its requests; the frontend is forgotten.
- **Unknown frontends.** Any frame but Hello (and Goodbye, ignored) from a frontend that is
  not attached (it was dropped, or attached to the core this one replaced) is answered with
  `Detached` (an AddRequest also with its ERROR output), never served: only the frontend
  knows which requests it still waits for, so it must say Hello again and fail those itself.
- **Bad frames.** A frame that does not decode is logged (rate limited) and dropped; an
  AddRequest whose fields do not decode is refused to its sender alone
  (`EngineCoreOutput.refused`, the error naming the field).
- **Routing.** Outputs go only to the frontend that sent the request (`send_outputs`).

What the owner decides: `add_request` and `abort` (a frontend may abort only its own
requests), `stats_query` (the daemon answers at once, the router fans the query in from its
cores), and what dropping or detaching a frontend does to its requests.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import zmq

from ..ipc.frontend_messages import (
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
from ..ipc.transport import (
    DEFAULT_FRONTEND_TIMEOUT_S,
    FrontendDecoder,
    bind_engine_socket,
    encode,
    ipc_path,
)

logger = logging.getLogger(__name__)


class PortOwner(Protocol):
    """What the process behind a `FrontendPort` decides (the engine core, the router)."""

    def add_request(self, client_id: str, msg: AddRequest, frame: bytes) -> None:
        """A new request of an attached frontend (`frame`: its bytes, to forward as is)."""
        ...

    def abort(self, client_id: str, req_ids: list[str]) -> None:
        """Abort the sender's own requests among `req_ids`; others are ignored."""
        ...

    def stats_query(self, client_id: str, view_since: int = -1) -> None:
        """Answer with `FrontendPort.send_stats`, now or later (with the live batch view's
        steps after `view_since` when it is 0 or more)."""
        ...

    def detach(self, client_id: str) -> int:
        """The frontend said Goodbye: abort its requests; how many there were."""
        ...

    def drop(self, client_id: str, reason: str) -> list[EngineCoreOutput]:
        """The frontend went silent: end its requests with ERROR and `reason`; their final
        outputs (the port sends them before `Detached`)."""
        ...


@dataclass
class Frontend:
    """An attached frontend."""

    client_id: str
    last_seen: float  # monotonic
    kind: str = "python"
    pid: int = 0


class FrontendPort:
    """The frontend-facing ROUTER socket and the protocol around it (module docstring)."""

    def __init__(self, owner: PortOwner, listen: str, key_file: str | None = None,
                 frontend_timeout: float = DEFAULT_FRONTEND_TIMEOUT_S,
                 ctx: zmq.Context | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if frontend_timeout <= 0:
            raise ValueError(f"frontend_timeout must be positive, got {frontend_timeout}")
        self.owner = owner
        self.listen = listen
        self.key_file = key_file
        self.frontend_timeout = frontend_timeout
        self.ctx = ctx or zmq.Context.instance()
        self.clock = clock
        self.decoder = FrontendDecoder()
        self.frontends: dict[str, Frontend] = {}  # attached, by client_id
        self.pending_hellos: set[str] = set()  # said Hello before `ready()`
        self.info: EngineInfo | None = None  # set by `ready()`
        self.sock: zmq.Socket | None = None
        self._auth = None

    # -- the socket ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the ROUTER at `listen` (frontends may connect and say Hello at once).
        ValueError when the address is taken or refused (see `bind_engine_socket`)."""
        self.sock, self._auth = bind_engine_socket(self.ctx, self.listen, self.key_file)

    def close(self) -> None:
        """Close the socket (queued messages still go out: it lingers), remove an ipc
        socket file, stop the CURVE authenticator."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            path = ipc_path(self.listen)
            if path is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def drain(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Handle every frame already queued (without waiting), until `should_stop()`."""
        while not should_stop():
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_frames(frames)

    # -- start-up ------------------------------------------------------------------------------

    def ready(self, info: EngineInfo) -> None:
        """Serving from now on: `info` answers every Hello, and those that came while
        starting are answered (and attached) now."""
        self.info = info
        now = self.clock()
        for client_id in sorted(self.pending_hellos):
            self.frontends[client_id] = Frontend(client_id, now)
            self.send(client_id, info)
        self.pending_hellos.clear()

    def fail_start(self, reason: str) -> None:
        """Start-up failed: every frontend that already said Hello (queued frames included)
        gets `EngineDead(reason)`, so none waits forever."""
        if self.sock is None:
            return
        self.drain()
        self.broadcast(EngineDead(reason))

    # -- frames from frontends -----------------------------------------------------------------

    def on_frames(self, frames: list[bytes]) -> None:
        """One multipart message from the socket: [identity, frame]."""
        client_id = client_id_of(frames[0])
        if len(frames) != 2:
            self.decoder.drop(f"{len(frames) - 1} frames where one was expected", client_id)
            return
        msg = self.decoder.decode(frames[1], sender=client_id)
        if msg is None:
            refusal = self.decoder.undecodable_request(frames[1])
            if refusal is not None:  # an AddRequest with a bad field: its sender must hear
                self.refuse(client_id, *refusal)
            return
        if self.info is None:  # starting: Hellos are answered by `ready()`
            if isinstance(msg, Hello):
                self.pending_hellos.add(client_id)
            return
        frontend = self.frontends.get(client_id)
        if frontend is None:
            if not isinstance(msg, Hello):
                self._refuse_unknown(client_id, msg)
                return
            frontend = self.frontends[client_id] = Frontend(client_id, self.clock())
            logger.info("frontend %r attached", client_id)
        frontend.last_seen = self.clock()
        self._dispatch(frontend, msg, frames[1])

    def _dispatch(self, frontend: Frontend, msg, frame: bytes) -> None:
        client_id = frontend.client_id
        if isinstance(msg, AddRequest):
            self.owner.add_request(client_id, msg, frame)
        elif isinstance(msg, Abort):
            self.owner.abort(client_id, msg.req_ids)
        elif isinstance(msg, Heartbeat):
            self.send(client_id, msg)  # echoed: the frontend knows the engine lives
        elif isinstance(msg, Hello):
            frontend.kind, frontend.pid = msg.kind, msg.pid
            self.send(client_id, self.info)
        elif isinstance(msg, StatsQuery):
            self.owner.stats_query(client_id, msg.view_since)
        elif isinstance(msg, Goodbye):
            del self.frontends[client_id]
            num_aborted = self.owner.detach(client_id)
            logger.info("frontend %r detached (%d unfinished requests aborted)", client_id,
                        num_aborted)
        else:
            logger.warning("unhandled frontend message %s", type(msg).__name__)

    def _refuse_unknown(self, client_id: str, msg) -> None:
        """A frame from a frontend that never said Hello here, or was dropped."""
        if isinstance(msg, Goodbye):
            return
        reason = (f"the engine core does not know frontend {client_id!r} (it was dropped, or "
                  "the engine core restarted): say Hello")
        logger.info("%s from unknown frontend %r: answered Detached", type(msg).__name__,
                    client_id)
        if isinstance(msg, AddRequest):
            error = EngineCoreOutput(msg.req_id, b"", FinishReason.ERROR, error=reason)
            self.send(client_id, EngineOutputs([error], timestamp=time.time()))
        self.send(client_id, Detached(reason))

    # -- silence -------------------------------------------------------------------------------

    def expire_silent(self) -> None:
        """Drop every frontend silent for longer than `frontend_timeout` (module docstring)."""
        now = self.clock()
        for client_id, frontend in list(self.frontends.items()):
            silent = now - frontend.last_seen
            if silent > self.frontend_timeout:
                self.drop(client_id, f"frontend {client_id!r} was silent for {silent:.1f} s "
                          f"(--frontend-timeout {self.frontend_timeout:g} s): the engine core "
                          "dropped its requests")

    def drop(self, client_id: str, reason: str) -> None:
        """Fail the frontend's requests (ERROR, `reason`), tell it `Detached`, forget it. A
        frontend that is only stalled reads both when it wakes up."""
        ...
        self.frontends.pop(client_id, None)
        outputs = self.owner.drop(client_id, reason)
        if outputs:
            self.send(client_id, EngineOutputs(outputs, timestamp=time.time()))
        self.send(client_id, Detached(reason))
        logger.warning("%s (%d unfinished)", reason, len(outputs))

    def seconds_to_next_expiry(self, most: float) -> float:
        """How long an idle wait may last before a frontend could time out (at most `most`)."""
        if not self.frontends:
            return most
        oldest = min(f.last_seen for f in self.frontends.values())
        return min(most, max(oldest + self.frontend_timeout - self.clock(), 0.01))

    # -- to frontends --------------------------------------------------------------------------

    def send(self, client_id: str, msg) -> None:
        """One message to one frontend."""
        self.sock.send_multipart([identity_of(client_id), encode(msg)], copy=False)

    def send_outputs(self, outputs_by_client: dict[str, list[EngineCoreOutput]],
                     timestamp: float | None = None) -> None:
        """Each frontend its own outputs, one `EngineOutputs` each."""
        timestamp = time.time() if timestamp is None else timestamp
        for client_id, outputs in outputs_by_client.items():
            if outputs:
                self.send(client_id, EngineOutputs(outputs, timestamp=timestamp))

    def send_stats(self, client_ids, stats: SchedulerStats) -> None:
        """The answer to a `StatsQuery`, to each of `client_ids` still attached."""
        msg = EngineOutputs(outputs=[], stats=stats, timestamp=time.time())
        for client_id in client_ids:
            if client_id in self.frontends:
                self.send(client_id, msg)

    def refuse(self, client_id: str, req_id: str, error: str) -> None:
        """Answer a bad request with its final output (an error naming the field)."""
        logger.warning("request %r from %r refused: %s", req_id, client_id, error)
        out = EngineCoreOutput(req_id, b"", FinishReason.ERROR, error=error, refused=True)
        self.send(client_id, EngineOutputs([out], timestamp=time.time()))

    def broadcast(self, msg) -> None:
        """`msg` to every attached frontend and every Hello not answered yet."""
        if self.sock is None:
            return
        for client_id in [*self.frontends, *sorted(self.pending_hellos)]:
            self.send(client_id, msg)


def client_id_of(identity: bytes) -> str:
    """A frontend's zmq identity as its client_id (reversible, whatever the bytes are)."""
    return identity.decode("utf-8", "surrogateescape")


def identity_of(client_id: str) -> bytes:
    return client_id.encode("utf-8", "surrogateescape")
