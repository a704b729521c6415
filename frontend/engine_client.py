"""A frontend's connection to the engine-core daemon, plus the tokenizer helpers both Python
frontends share.

Protocol (see tidal.ipc.transport): one DEALER per frontend (identity = client_id) to the
daemon's ROUTER. The frontend sends `Hello` first; the daemon answers `EngineInfo` when ready.
Then `AddRequest` / `Abort` / `StatsQuery` / `Goodbye`, and a `Heartbeat` every
`EngineInfo.heartbeat_interval` seconds (a silent frontend's requests are failed by the
daemon). The daemon sends `EngineOutputs` (only this frontend's requests), `EngineDead`, and
`Detached` when it does not know (or no longer knows) this frontend.

`AsyncEngineClient` is a zmq.asyncio socket on the running loop plus a heartbeat task and a
task watching the connection (`LLM` runs an `AsyncLLM` on a private event-loop thread, so this
one client serves both). A disconnect from the daemon (a daemon killed without a word) comes
out of `recv()` as an `EngineDead`, once per disconnect, so no caller waits forever.

`attached` is True from the EngineInfo that answers a Hello until the owner learns that the
core is gone or dropped it (it then calls `reattach()`); heartbeats go out only while
attached. The core echoes each one, so a core that sends nothing at all for
`EngineInfo.frontend_timeout` seconds while attached (stopped, or hung) is taken as lost
too: `recv()` returns an `EngineDead` saying so, once, and `core_silent` is set until the
next EngineInfo (an owner that started the core kills it then, to start it again). Silence
is judged only while this side keeps beating: after a stall of our own (the event loop held
up) the clock starts again, and frames waiting unread count as heard. While re-attaching,
the client says Hello again on every new connection (ZeroMQ reconnects to the same address
by itself), so a core restarted there is found.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..ipc.frontend_messages import Detached, EngineDead, EngineInfo, Goodbye, Heartbeat, Hello
from ..ipc.heartbeat import HeartbeatClock
from ..ipc.messages import is_valid_unicode
from ..ipc.transport import (
    DEFAULT_FRONTEND_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    CoreToFrontendDecoder,
    connect_frontend_socket,
    encode,
)

logger = logging.getLogger(__name__)

_LOST = "the connection to the engine core was lost (the daemon went away)"


def make_client_id(kind: str = "python") -> str:
    """A client id unique to this frontend: kind, pid and a random part."""
    return f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------------
# tokenizer helpers


# tokenizer classes that are plain `tokenizers` files: loaded without AutoTokenizer, whose
# model-config machinery imports torch (seconds of start-up the frontend does not need)
_PLAIN_FAST_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str):
    """The model folder's fast tokenizer (offline; nothing is downloaded)."""
    try:
        if _is_plain_fast_tokenizer(path):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a clear message beats transformers' traceback
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r}: {e}") from e
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        logger.warning("tokenizer at %s is not a fast tokenizer; detokenization is slower", path)
    return tokenizer


def _is_plain_fast_tokenizer(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tokenizer_class = None
    return tokenizer_class in _PLAIN_FAST_CLASSES


def read_eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids: generation_config.json's `eos_token_id` (int or list), else the tokenizer's.

    The first is sent as the request's eos_token_id; any others act as stop token ids.
    """
    ids: list[int] = []
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        ids = [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
    except (OSError, ValueError, AttributeError):
        pass
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [tokenizer.eos_token_id]
    return ids


def encode_prompt(tokenizer, prompt: str | list[int], max_model_len: int,
                  model_vocab_size: int = 0, *, pooling: bool = False) -> list[int]:
    """Token ids of `prompt` (text is tokenized with special tokens, as vLLM does).

    ValueError for an empty prompt, ids outside the vocabulary (the tokenizer's, and the
    model's when `model_vocab_size` is known: EngineInfo.vocab_size), or a prompt that leaves
    no room to generate: like vLLM, a prompt of `max_model_len` tokens or more is refused
    (with `pooling`, an embedding prompt, which generates nothing: more than max_model_len).
    """
    if isinstance(prompt, str):
        if not is_valid_unicode(prompt):
            raise ValueError("prompt must be valid Unicode (it holds a lone surrogate)")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        vocab = min(len(tokenizer), model_vocab_size) if model_vocab_size else len(tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
    if not ids:
        raise ValueError("prompt must not be empty")
    if pooling and len(ids) > max_model_len:
        raise ValueError(f"prompt is too long: {len(ids)} tokens, but the model's maximum "
                         f"context length (max_model_len) is {max_model_len}")
    if not pooling and len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is too long: {len(ids)} tokens, but the model's maximum context length "
            f"(max_model_len) is {max_model_len}, and at least one token must be generated "
            f"(so a prompt may have at most {max_model_len - 1} tokens)")
    return ids


# ---------------------------------------------------------------------------------------------
# asyncio client


class AsyncEngineClient:
    """The connection to one engine core for an asyncio loop (see the module docstring)."""

    def __init__(self, address: str, key_file: str | None = None, kind: str = "python"):
        self.address = address
        self.client_id = make_client_id(kind)
        self.kind = kind
        self.attached = False
        self.heartbeat_interval = HEARTBEAT_INTERVAL_S
        self.silence_limit = DEFAULT_FRONTEND_TIMEOUT_S
        """Seconds without a frame from an attached core before it is taken as hung."""
        self.core_silent = False
        self._clock = HeartbeatClock(HEARTBEAT_INTERVAL_S)
        self._lost_reason = _LOST
        self._reattaching = False
        self._ctx = zmq.asyncio.Context()
        self._decoder = CoreToFrontendDecoder()
        self._sock = connect_frontend_socket(self._ctx, address, self.client_id, key_file)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED
                                                      | zmq.EVENT_DISCONNECTED)
        self._closed = False
        self._heartbeat_task: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._lost = asyncio.Event()

    def start(self) -> None:
        """Say Hello and start the heartbeat and connection-watch tasks (on the running loop)."""
        self.hello()
        self._heartbeat_task = asyncio.ensure_future(self._heartbeat_loop())
        self._monitor_task = asyncio.ensure_future(self._watch_connection())

    def hello(self) -> None:
        self.send_nowait(Hello(self.client_id, self.kind, os.getpid()))

    def on_attached(self, info: EngineInfo) -> None:
        """The core answered Hello: heartbeat at the pace it asks for."""
        self.attached, self._reattaching, self.core_silent = True, False, False
        self.heartbeat_interval = info.heartbeat_interval
        self.silence_limit = info.frontend_timeout
        self._clock = HeartbeatClock(info.heartbeat_interval)

    def reattach(self) -> None:
        """The core is gone or dropped us: stop beating, say Hello now and on every new
        connection until an EngineInfo comes (`on_attached`)."""
        self.attached, self._reattaching = False, True
        self.hello()

    def send_nowait(self, msg) -> None:
        """Send one message without awaiting (the socket queues it; HWM is unbounded)."""
        if self._closed:
            return
        fut = self._sock.send(encode(msg))
        fut.add_done_callback(_log_send_error)

    async def recv(self):
        """The next decoded message; EngineDead when the connection was lost."""
        while True:
            recv = asyncio.ensure_future(self._sock.recv_multipart())
            lost = asyncio.ensure_future(self._lost.wait())
            try:
                done, _ = await asyncio.wait({recv, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                if not recv.done():
                    recv.cancel()  # safe: a cancelled zmq recv consumes no message
            if recv not in done:
                self._lost.clear()
                reason, self._lost_reason = self._lost_reason, _LOST
                return EngineDead(reason)
            frames = recv.result()
            self._clock.heard(time.monotonic())
            if len(frames) != 1:
                self._decoder.drop(f"{len(frames)}-part message")
                continue
            msg = self._decoder.decode(frames[0])
            if msg is not None and not isinstance(msg, Heartbeat):  # an echo: alive, no news
                return msg

    async def wait_for_info(self, timeout: float, alive=None) -> EngineInfo:
        """Await the daemon's EngineInfo (then `attached`); RuntimeError on timeout,
        EngineDead or death.

        `alive()` (optional) is called a few times a second; False means the daemon is gone.
        """
        deadline = time.monotonic() + timeout
        pending = asyncio.ensure_future(self.recv())
        try:
            while time.monotonic() < deadline:
                await asyncio.wait({pending}, timeout=0.1)
                if pending.done():
                    msg = pending.result()
                    if isinstance(msg, EngineInfo):
                        self.on_attached(msg)
                        return msg
                    if isinstance(msg, EngineDead):
                        raise RuntimeError(f"engine core failed to start: {msg.reason}")
                    pending = asyncio.ensure_future(self.recv())
                if alive is not None and not alive():
                    raise RuntimeError("engine core exited before it was ready")
        finally:
            pending.cancel()
        raise RuntimeError(f"engine core at {self.address} did not answer within {timeout:.0f} s")

    async def close(self) -> None:
        """Say Goodbye, stop the tasks, close the socket (idempotent)."""
        if self._closed:
            return
        try:
            await asyncio.wait_for(self._sock.send(encode(Goodbye(self.client_id))), 1.0)
        except (asyncio.TimeoutError, zmq.ZMQError):
            pass
        self._closed = True
        for task in (self._heartbeat_task, self._monitor_task):
            if task is not None:
                task.cancel()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=500)
        self._ctx.term()

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.heartbeat_interval)
            if self.attached:
                self.send_nowait(Heartbeat(self.client_id))
                self._check_core_heard()

    def _check_core_heard(self) -> None:
        """An attached core that echoed nothing for `silence_limit` s is lost (once)."""
        now = time.monotonic()
        self._clock.beat(now)
        if self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            return  # frames wait unread: the core spoke
        silent = self._clock.silent_for(now)
        if not self.core_silent and silent > self.silence_limit:
            self.core_silent = True
            self._lost_reason = (f"the engine core sent nothing for {silent:.1f} s (it echoes "
                                 f"every heartbeat; --frontend-timeout "
                                 f"{self.silence_limit:g} s): it is stopped or hung")
            logger.warning("engine core at %s: %s", self.address, self._lost_reason)
            self._lost.set()

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost.set()
            elif event == zmq.EVENT_CONNECTED and self._reattaching:
                self.hello()  # maybe a new core at the address: the old Hello went nowhere


class CoreLiveness:
    """Whether the engine core at `address` still answers, for a process that owns it but
    sends it no requests (`tidal serve`'s supervisor): a frontend of kind "supervisor" that
    says Hello and beats, without blocking. `silent()` is the seconds the attached core has
    echoed nothing past its --frontend-timeout (stopped or hung), else None; after the
    core is restarted, `reset()` says Hello to the new one (ZeroMQ reconnects by itself)."""

    def __init__(self, address: str, key_file: str | None = None):
        self.client_id = make_client_id("supervisor")
        self._ctx = zmq.Context()
        self._sock = connect_frontend_socket(self._ctx, address, self.client_id, key_file)
        self._decoder = CoreToFrontendDecoder()
        self.reset()

    def reset(self) -> None:
        """Forget the old core; Hello to whichever answers at the address next."""
        self._info: EngineInfo | None = None
        self._clock: HeartbeatClock | None = None  # from the core's EngineInfo on
        self._sock.send(encode(Hello(self.client_id, "supervisor", os.getpid())))

    def silent(self) -> float | None:
        """Read what came, beat when due; the core's silence in seconds once it passes the
        core's --frontend-timeout, else None (also before the first EngineInfo)."""
        now = time.monotonic()
        while self._sock.poll(0):
            msg = self._decoder.decode(self._sock.recv())
            if isinstance(msg, EngineInfo):
                self._info, self._clock = msg, HeartbeatClock(msg.heartbeat_interval, now)
            elif isinstance(msg, (Detached, EngineDead)):
                self.reset()  # dropped (or going away): attach again
                return None
            elif self._clock is not None:
                self._clock.heard(now)
        if self._clock is None:
            return None
        if self._clock.beat_due(now):
            self._clock.beat(now)
            self._sock.send(encode(Heartbeat(self.client_id)))
        silent = self._clock.silent_for(now)
        return silent if silent > self._info.frontend_timeout else None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def _log_send_error(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("send to the engine core failed: %s", fut.exception())
