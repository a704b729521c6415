"""Encoding, sockets and addresses for the conversations of `ipc/frontend_messages.py` and
`ipc/worker_messages.py` (the overview: `ipc/messages.py`).

Socket map (who binds, who connects, what travels):

    frontend DEALER (identity = client_id) ──connect──► engine core ROUTER  (--listen ADDRESS)
        frontend → core: FrontendMessage   (Hello first, then AddRequest / Abort / Heartbeat /
                                            StatsQuery / Goodbye), one msgpack frame each
        core → frontend: CoreToFrontend    (EngineInfo answers Hello, EngineOutputs, EngineDead,
                                            Detached: "I do not know you (any more): say Hello",
                                            each Heartbeat echoed: "I am alive")
    engine core PUSH (bind, one per rank) ──► worker PULL (connect)   CoreToWorker
    worker PUSH (connect, every rank) ──────► engine core PULL (bind) WorkerToCore

Every message is ONE zmq frame holding one msgpack-encoded Struct (the ROUTER adds the
identity frame in front). Decoders are typed: each accepts exactly the union its side may
receive; anything else (garbage, a message of another conversation, a multi-part message) is
logged at warning level (rate limited) and dropped, and the decoder keeps working.

Public API, for the engine core, the workers and the frontends:

    encode(msg) -> bytes                            any message Struct of ipc/
    FrontendDecoder()   .decode(frame) -> FrontendMessage | None      (engine core side)
                        .undecodable_request(frame) -> (req_id, why) | None  (to refuse it)
    CoreToFrontendDecoder() .decode(frame) -> CoreToFrontend | None   (frontend side)
    CoreToWorkerDecoder() .decode(frame) -> CoreToWorker | None       (worker side)
    WorkerToCoreDecoder() .decode(frame) -> WorkerToCore | None       (engine core side)
    encode_worker_config(cfg) -> str / decode_worker_config(text) -> WorkerConfig  (argv)

    HEARTBEAT_INTERVAL_S, DEFAULT_FRONTEND_TIMEOUT_S, heartbeat_interval(frontend_timeout)
    default_engine_address() -> "ipc://<private dir>/engine.sock"
    new_private_address(tag="engine") -> a fresh ipc:// address, unique per call
    runtime_dir() -> the private (0700) directory of this user
    is_loopback_address(address) / check_listen_address(address, key_file)
    connect_frontend_socket(ctx, address, client_id, key_file=None) -> zmq DEALER
    bind_engine_socket(ctx, address, key_file=None) -> (zmq ROUTER, authenticator | None)
    plan_socket(ctx) / results_socket(ctx) -> the engine core's PUSH to a rank / PULL from all
    bind_private(sock, tag) / bind_curve_tcp(sock, host, keys) -> the address bound
    connect_worker_sockets(ctx, plan_address, result_address, keys=None) -> (PULL, PUSH)

CURVE key file (`write_key_file(path)`, read by `read_key_file(path)`): a text file, mode 0600,
lines `name = value`, `#` comments, holding four Z85 keys:

    server-public-key = ...    the engine core's key pair
    server-secret-key = ...
    client-public-key = ...    the frontends' key pair; the engine core's ZAP handler
    client-secret-key = ...    admits this public key only

The same file is given to the daemon (`--engine-key-file`) and to every frontend; whoever
holds it may use the engine, nobody else gets a byte back.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import stat
import tempfile
import time
import uuid
from base64 import b64decode, b64encode
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq

from .frontend_messages import AddRequest, CoreToFrontend, FrontendMessage
from .worker_messages import CoreToWorker, WorkerConfig, WorkerToCore

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between two Heartbeat messages of a frontend."""

DEFAULT_FRONTEND_TIMEOUT_S = 10.0
"""A frontend silent for longer than this has its requests failed (daemon --frontend-timeout)."""


def heartbeat_interval(frontend_timeout: float) -> float:
    """How often frontends beat for this timeout: every second, or four times per timeout
    when the timeout is shorter than 4 s (the core tells them in EngineInfo)."""
    return min(HEARTBEAT_INTERVAL_S, frontend_timeout / 4)

_DROP_LOG_INTERVAL_S = 1.0

# ---------------------------------------------------------------------------------------------
# encoding

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """One message (any message Struct of ipc/) to one msgpack frame."""
    return _ENCODER.encode(msg)


class TypedDecoder:
    """Decode frames into exactly `msg_type` (a Struct or a tagged union of Structs).

    `decode` never raises: a frame that does not decode (bad msgpack, wrong tag, a field of
    the wrong type, a value that fails validation) is logged and dropped, returning None.
    `num_dropped` counts them; warnings are rate limited to one per second.
    """

    def __init__(self, msg_type, name: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self.name = name
        self.num_dropped = 0
        self._last_log = float("-inf")
        self._num_unlogged = 0

    def decode(self, frame, sender: str | None = None):
        """The message in `frame`, or None when it does not decode (logged, counted)."""
        try:
            return self._decoder.decode(frame)
        except Exception as e:  # noqa: BLE001 - anything a peer sends must not kill us
            self.drop(f"{type(e).__name__}: {e}", sender)
            return None

    def drop(self, why: str, sender: str | None = None) -> None:
        """Count and (rate limited) log a dropped frame."""
        self.num_dropped += 1
        now = time.monotonic()
        if now - self._last_log < _DROP_LOG_INTERVAL_S:
            self._num_unlogged += 1
            return
        more = (f" ({self._num_unlogged} more dropped since last warning)"
                if self._num_unlogged else "")
        who = f" from {sender!r}" if sender is not None else ""
        logger.warning("%s: dropped a frame%s that does not decode: %s%s",
                       self.name, who, why[:300], more)
        self._last_log = now
        self._num_unlogged = 0


class _AddRequestHead(msgspec.Struct, tag="add", array_like=True):
    """The first field of an AddRequest on the wire, the rest ignored."""

    req_id: str


class FrontendDecoder(TypedDecoder):
    """Engine core side of the frontend socket: decodes `FrontendMessage` only."""

    def __init__(self) -> None:
        super().__init__(FrontendMessage, "frontend socket")
        self._head = msgspec.msgpack.Decoder(_AddRequestHead)
        self._add = msgspec.msgpack.Decoder(AddRequest)

    def undecodable_request(self, frame) -> tuple[str, str] | None:
        """For a frame `decode` dropped: (req_id, why it does not decode) when the frame is
        tagged as an AddRequest and its req_id reads as a string, so the engine core can
        refuse that request to its sender instead of leaving it waiting; else None.
        `why` names the field ("sampling.temperature: Expected `float`, got `str`")."""
        try:
            req_id = self._head.decode(frame).req_id
        except Exception:  # noqa: BLE001 - not even an addressable AddRequest
            return None
        try:
            self._add.decode(frame)
        except msgspec.ValidationError as e:
            return req_id, describe_validation_error(e, AddRequest)
        except Exception as e:  # noqa: BLE001 - truncated or malformed msgpack
            return req_id, f"AddRequest does not decode: {e}"
        return None


_ERROR_LOCATION = re.compile(r"^(.*) - at `\$((?:\[\d+\])*)`$", re.DOTALL)


def describe_validation_error(error: msgspec.ValidationError, struct_type) -> str:
    """A msgspec error on an array-like Struct with its location as field names:
    "Expected `float`, got `str` - at `$[3][3]`" -> "sampling.temperature: Expected ...". An
    error a Struct's own validation raised ("temperature must be ...") names its field
    already and is returned as it is."""
    match = _ERROR_LOCATION.match(str(error))
    if match is None:
        return str(error)
    text, location = match.groups()
    path, leaf_type = _field_path(struct_type, [int(i) for i in re.findall(r"\d+", location)])
    if not path or _is_struct(leaf_type):
        return text
    return f"{path}: {text}"


def _field_path(struct_type, indices: list[int]) -> tuple[str, object]:
    """Field names along `indices` (array positions) of an array-like Struct, and the type
    reached; list positions are written `[i]`."""
    path, current = "", struct_type
    for index in indices:
        if not _is_struct(current):
            path, current = f"{path}[{index}]", None
            continue
        fields = msgspec.structs.fields(current)
        index -= current.__struct_config__.tag is not None  # position 0 holds the tag
        if not 0 <= index < len(fields):
            return path, None
        path = f"{path}.{fields[index].name}" if path else fields[index].name
        current = fields[index].type
    return path, current


def _is_struct(t) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


class CoreToFrontendDecoder(TypedDecoder):
    """Frontend side: decodes `CoreToFrontend` (EngineInfo, EngineOutputs, EngineDead,
    Detached, the echo of a Heartbeat) only."""

    def __init__(self) -> None:
        super().__init__(CoreToFrontend, "engine socket")


class CoreToWorkerDecoder(TypedDecoder):
    """Worker side: decodes `CoreToWorker` (BatchPlan, InitKVCache, Shutdown) only."""

    def __init__(self) -> None:
        super().__init__(CoreToWorker, "plan socket")


class WorkerToCoreDecoder(TypedDecoder):
    """Engine core side of the worker results: `WorkerToCore` only."""

    def __init__(self) -> None:
        super().__init__(WorkerToCore, "worker results socket")


def encode_worker_config(config: WorkerConfig) -> str:
    """A WorkerConfig as one base64 command-line argument (msgpack inside)."""
    return b64encode(encode(config)).decode("ascii")


def decode_worker_config(text: str) -> WorkerConfig:
    """Inverse of `encode_worker_config`; raises ValueError when it does not decode."""
    try:
        return msgspec.msgpack.decode(b64decode(text), type=WorkerConfig)
    except (msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"worker config does not decode: {e}") from e


# ---------------------------------------------------------------------------------------------
# addresses


def runtime_dir() -> str:
    """This user's private directory for ipc:// sockets (created with mode 0700).

    $XDG_RUNTIME_DIR/tidal when that is set, else <tmp>/tidal-<uid>. A directory owned by
    someone else, or readable by others, is refused with a ValueError.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "tidal") if base else os.path.join(
        tempfile.gettempdir(), f"tidal-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ValueError(f"socket directory {path} belongs to uid {st.st_uid}, not to you")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def default_engine_address() -> str:
    """Where `tidal core` listens and frontends attach by default."""
    return f"ipc://{os.path.join(runtime_dir(), 'engine.sock')}"


def new_private_address(tag: str = "engine") -> str:
    """A fresh ipc:// address in the private directory, unique per call (per launch)."""
    name = f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    return f"ipc://{os.path.join(runtime_dir(), name)}"


def is_loopback_address(address: str) -> bool:
    """True for ipc:// and inproc:// and for tcp:// on a loopback host (127.x, ::1, localhost)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"tcp://{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen_address(address: str, key_file: str | None) -> None:
    """Refuse (ValueError) an address tidal cannot or should not use as it stands."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ipc", "tcp") or not rest:
        raise ValueError(f"listen address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
    if scheme == "tcp" and not is_loopback_address(address) and key_file is None:
        raise ValueError(
            f"listen address {address} is not loopback: it needs --engine-key-file "
            "(ZeroMQ CURVE keys; make one with `tidal core --generate-key-file PATH`)")


def ipc_path(address: str) -> str | None:
    """The file system path of an ipc:// address, else None."""
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def check_ipc_free(address: str) -> None:
    """ValueError when another process already listens on this ipc:// path.

    ZeroMQ would silently unlink a live socket file and steal the address; a stale file (no
    listener) is fine to reuse.
    """
    path = ipc_path(address)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return
    finally:
        probe.close()
    raise ValueError(f"another process is already listening on {address}")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("": every address of this node) that is free right now
    (torch.distributed's rendezvous, a server `tidal` starts for itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# CURVE keys


@dataclass(frozen=True)
class EngineKeys:
    """The four Z85 keys of a key file (bytes, as pyzmq wants them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


_KEY_NAMES = {
    "server-public-key": "server_public",
    "server-secret-key": "server_secret",
    "client-public-key": "client_public",
    "client-secret-key": "client_secret",
}


def write_key_file(path: str) -> EngineKeys:
    """Generate a server and a client CURVE key pair and write them to `path` (mode 0600)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = EngineKeys(server_public, server_secret, client_public, client_secret)
    lines = ["# tidal engine key file: ZeroMQ CURVE keys (Z85). Whoever holds it may use",
             "# the engine; keep it private. Give it to `tidal core --engine-key-file` and to",
             "# every frontend that attaches."]
    lines += [f"{name} = {getattr(keys, attr).decode('ascii')}"
              for name, attr in _KEY_NAMES.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return keys


def read_key_file(path: str) -> EngineKeys:
    """Parse a key file written by `write_key_file`; ValueError naming what is wrong."""
    values: dict[str, bytes] = {}
    with open(path) as f:
        for num, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = (part.strip() for part in line.partition("="))
            if not sep or name not in _KEY_NAMES or len(value) != 40:
                raise ValueError(f"engine key file {path} line {num}: expected "
                                 "`<server|client>-<public|secret>-key = <40 Z85 chars>`")
            values[_KEY_NAMES[name]] = value.encode("ascii")
    missing = [n for n, a in _KEY_NAMES.items() if a not in values]
    if missing:
        raise ValueError(f"engine key file {path} lacks {', '.join(missing)}")
    if os.stat(path).st_mode & 0o077:
        logger.warning("engine key file %s is readable by other users; chmod 600 it", path)
    return EngineKeys(**values)


def new_keys() -> EngineKeys:
    """A fresh server and client CURVE key pair, in memory only (the engine core's TCP
    sockets to ranks on other machines, `engine_core/ray_executor.py`)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return EngineKeys(server_public, server_secret, client_public, client_secret)


WORKER_KEYS_ENV = "TIDAL_WORKER_CURVE_KEYS"
"""Environment variable that gives a worker process its CURVE keys: the server's public key,
then the client's public and secret keys, Z85, space separated. The environment, not argv:
other users can read a command line, not another user's environment."""


def worker_keys_env(keys: EngineKeys) -> str:
    """The value of WORKER_KEYS_ENV for `keys` (the server's secret key stays out)."""
    return b" ".join([keys.server_public, keys.client_public, keys.client_secret]).decode()


def worker_keys_from_env(environ) -> EngineKeys | None:
    """The keys in `environ[WORKER_KEYS_ENV]` (without the server's secret), or None."""
    text = environ.get(WORKER_KEYS_ENV)
    if not text:
        return None
    parts = text.encode("ascii").split()
    if len(parts) != 3 or any(len(p) != 40 for p in parts):
        raise ValueError(f"{WORKER_KEYS_ENV} must hold three 40-character Z85 keys")
    server_public, client_public, client_secret = parts
    return EngineKeys(server_public, b"", client_public, client_secret)


def curve_server(ctx: zmq.Context, keys: EngineKeys):
    """Start the ZAP authenticator of `ctx` admitting only `keys.client_public`; returns it
    (stop it before terminating `ctx`). Then make each socket bound in `ctx` a server with
    `curve_bind`. One authenticator per context."""
    return _start_authenticator(ctx, keys)


def curve_bind(sock: zmq.Socket, keys: EngineKeys) -> None:
    """Make `sock` (not bound yet) a CURVE server with `keys`."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def curve_connect(sock: zmq.Socket, keys: EngineKeys) -> None:
    """Make `sock` (not connected yet) a CURVE client of the server `keys` names."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class _AllowedKeys:
    """ZAP credentials provider: admits exactly the given client public keys (Z85)."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            logger.warning("refused a CURVE client with an unknown key")
        return allowed


def _start_authenticator(ctx: zmq.Context, keys: EngineKeys):
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    auth.configure_curve_callback(domain="*",
                                  credentials_provider=_AllowedKeys({keys.client_public}))
    return auth


# ---------------------------------------------------------------------------------------------
# sockets


def _tune(sock: zmq.Socket) -> None:
    # Unbounded queues: an output is never dropped because a peer is momentarily slow.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def bind_engine_socket(ctx: zmq.Context, address: str, key_file: str | None = None):
    """The engine core's frontend ROUTER, bound at `address`; returns (socket, authenticator).

    With `key_file` the socket is a CURVE server and a ZAP authenticator (returned; stop it
    after closing the socket) admits only the key file's client key. Without it the address
    must be loopback (see `check_listen_address`).
    """
    check_listen_address(address, key_file)
    check_ipc_free(address)
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    _tune(sock)
    sock.setsockopt(zmq.LINGER, 2000)  # let EngineDead / last outputs reach the frontends
    if key_file is not None:
        keys = read_key_file(key_file)
        auth = _start_authenticator(ctx, keys)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise ValueError(f"cannot listen on {address}: {e}") from e
    path = ipc_path(address)
    if path is not None:
        os.chmod(path, 0o600)  # only this user may connect, whatever the directory allows
    return sock, auth


def connect_frontend_socket(ctx: zmq.Context, address: str, client_id: str,
                            key_file: str | None = None) -> zmq.Socket:
    """A frontend's DEALER to the engine core at `address`, identity = `client_id`.

    Send `Hello(client_id)` first, then a `Heartbeat` every HEARTBEAT_INTERVAL_S. With
    `key_file` the socket is a CURVE client using the key file's keys. A non-loopback tcp://
    address without a key file is refused with ValueError.
    """
    if not client_id:
        raise ValueError("client_id must be a non-empty string")
    check_listen_address(address, key_file)
    sock = ctx.socket(zmq.DEALER)
    _tune(sock)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, client_id.encode("utf-8"))
    if key_file is not None:
        keys = read_key_file(key_file)
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public
    sock.connect(address)
    return sock


# ---------------------------------------------------------------------------------------------
# worker sockets: the engine core binds, each rank connects

PLAN_SEND_TIMEOUT_MS = 5000
"""How long a plan may wait for its rank to take it before `send` raises zmq.Again (the
engine core then counts the rank as stuck)."""


def plan_socket(ctx: zmq.Context) -> zmq.Socket:
    """The engine core's PUSH to one rank (CoreToWorker), not bound yet: an unbounded queue,
    a send that gives up after PLAN_SEND_TIMEOUT_MS, no linger (a rank that is gone gets
    nothing more)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.SNDTIMEO, PLAN_SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def results_socket(ctx: zmq.Context) -> zmq.Socket:
    """The engine core's PULL for what every rank sends (WorkerToCore), not bound yet: an
    unbounded queue."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def bind_private(sock: zmq.Socket, tag: str) -> str:
    """Bind `sock` at a fresh private ipc:// address (ranks on this machine); the address."""
    address = new_private_address(tag)
    sock.bind(address)
    return address


def bind_curve_tcp(sock: zmq.Socket, host: str, keys: EngineKeys) -> str:
    """Bind `sock` on `host` at a port of the kernel's, as a CURVE server with `keys` (ranks
    on other machines; its context runs `curve_server`'s authenticator); the address."""
    curve_bind(sock, keys)
    sock.bind(f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_worker_sockets(ctx: zmq.Context, plan_address: str, result_address: str,
                           keys: EngineKeys | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A rank's (plan PULL, result PUSH), connected to the engine core's `plan_socket` and
    `results_socket`; with `keys` (`worker_keys_from_env`) as CURVE clients. Unbounded
    queues; results linger 2 s, so a WorkerFailed sent as the rank exits still arrives."""
    plan_sock = ctx.socket(zmq.PULL)
    plan_sock.setsockopt(zmq.RCVHWM, 0)
    result_sock = ctx.socket(zmq.PUSH)
    result_sock.setsockopt(zmq.SNDHWM, 0)
    result_sock.setsockopt(zmq.LINGER, 2000)
    if keys is not None:
        curve_connect(plan_sock, keys)
        curve_connect(result_sock, keys)
    # plans first: the core starts sending only after every rank has said ready
    plan_sock.connect(plan_address)
    result_sock.connect(result_address)
    return plan_sock, result_sock
