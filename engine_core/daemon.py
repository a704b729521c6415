"""The engine-core daemon (`tidal core MODEL --listen ADDRESS`): the scheduler, the KV block
pool and the executor in one process that serves any number of frontends.

    python -m tidal.engine_core.daemon MODEL [engine flags] [--listen ADDRESS]
        [--engine-key-file PATH] [--frontend-timeout S] [--log-level L]
    python -m tidal.engine_core.daemon --generate-key-file PATH

Life of the process:
1. bind the frontend ROUTER (`--listen`, default `default_engine_address()`), so an address
   that is taken fails at once; frontends may connect and say Hello right away;
2. a GGUF model file: convert it into a cached Hugging Face folder (`model_files.py`), once
   per file; start one worker per TP rank, wait for every WorkerReady, InitKVCache(min blocks);
3. answer each Hello with EngineInfo, then loop over steps (`EngineCore.step`, core.py);
   a request that is bad in itself (a token id outside the vocabulary, an AddRequest that
   does not decode) is refused to its sender alone (`EngineCoreOutput.refused`), never reaches
   a worker, and the engine goes on serving everyone else;
4. SIGTERM / SIGINT: stop admitting, fail what is unfinished, EngineDead to every frontend,
   Shutdown to the workers, join them, exit 0. A bad configuration or a failed start-up:
   exit 2.

A worker that dies, fails or hangs past `--worker-timeout` is healed: every rank is killed,
fresh ones are started (the same `Executor.start` handshake), and every running request goes
back to waiting to be recomputed from its prompt and the tokens it already has, as after a
preemption (`Scheduler.recompute_all`); plans in flight are dropped, their tokens never
delivered. Clients see a pause. Greedy and seeded outputs equal a fault-free run's, because
recompute gives the same KV and seeded draws depend on (seed, position) only. After
`--max-worker-restarts` replacements within 10 minutes (or when the replacement itself fails
that often), the next failure is final: every unfinished request gets FinishReason.ERROR with
a message, EngineDead, the remaining workers are killed, exit 1.

The frontend protocol (Hello, heartbeat echo, dropping silent frontends, `Detached` for
unknown ones, each output to its own frontend) is `frontend_port.FrontendPort`'s, shared with
the data-parallel router; the core answers its questions: a frontend may abort only its own
requests, and a dropped one's requests fail with an error and free their blocks. Heartbeats
are echoed also while a long step runs or replacement workers load.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import zmq

from .advice.observers import observers_for
from .batch_view import BatchViewObserver
from .args import add_engine_args, config_from_args
from .config import (
    EngineConfig,
    is_gguf,
    resolve_max_model_len,
)
from .core import EngineCore, Executor, make_executor
from .executor import WorkerError, WorkerFacts
from .frontend_port import FrontendPort
from .model_files import model_folder
from .progress_log import ProgressLog
from .pooling import pooler_info
from .request import Request, check_pooling, check_request
from .scheduler import Scheduler
from ..ipc.lifeline import watch_parent
from .stop_signals import StopSignals
from .supervisor import Supervisor
from ..ipc.frontend_messages import AddRequest, EngineCoreOutput, EngineDead, EngineInfo
from ..ipc.transport import (
    DEFAULT_FRONTEND_TIMEOUT_S,
    default_engine_address,
    heartbeat_interval,
    write_key_file,
)

logger = logging.getLogger("tidal.engine_core")

EXIT_OK, EXIT_WORKER_FAILED, EXIT_BAD_START = 0, 1, 2
STOP_GRACE_S = 5.0
"""Seconds a stop signal waits for a step still running on the workers."""
LIFELINE_GRACE_S = 15.0
"""Seconds a private daemon whose owner died has to stop after SIGTERM before it is
SIGKILLed: more than its own worst case (a running step, then its workers' shutdown)."""
_HOUSEKEEPING_S = 1.0  # longest idle poll: frontend timeouts are checked at least this often
HEAL_MIN_STARTUP_S = 30.0
"""Least time replacement workers get to start (see `EngineCoreDaemon._heal_startup_timeout`):
in a chaos soak a worker SIGSTOPped while it started as a replacement left the core waiting
out the 600 s start-up limit, deaf to its frontends."""
_COLLECT_SLICE_S = 0.5  # a long step is waited for in slices, to notice a stop signal


class EngineCoreDaemon:
    """One engine core: frontend socket, scheduler, executor; `run()` returns the exit code."""

    def __init__(self, config: EngineConfig, listen: str, key_file: str | None = None,
                 frontend_timeout: float = DEFAULT_FRONTEND_TIMEOUT_S,
                 log_level: str = "INFO") -> None:
        self.config = config
        self.listen = listen
        self.frontend_timeout = frontend_timeout
        self.log_level = log_level
        self.ctx = zmq.Context()
        self.port = FrontendPort(self, listen, key_file, frontend_timeout, self.ctx)
        self.depth = 0  # plans in flight, once the workers said where they run
        self.signals = StopSignals()  # SIGTERM / SIGINT: stop in order
        self.workers = Supervisor("the workers", self._start_workers,
                                  config.parallel.max_worker_restarts,
                                  flag="--max-worker-restarts", how="replacing the workers",
                                  stop=lambda executor: executor.kill())
        self.facts: WorkerFacts | None = None  # what the running workers found
        self.first_start_s = 0.0  # how long the first start of the workers took
        self.executor = self.scheduler = self.info = None
        self.core: EngineCore | None = None  # the step loop, once the workers are up
        self.vocab_size = 0  # the model's, reported by the workers at start-up
        self.model_dir = config.model.model  # the folder loaded (a GGUF file's: converted)
        self.pooler = None  # the embedding model's pooler (--runner pooling), else None
        self.progress = ProgressLog(logger)
        self._idle_poller: zmq.Poller | None = None
        self.batch_view = BatchViewObserver()  # the live view's steps and warnings
        logging.getLogger("tidal").addHandler(self.batch_view.warnings)

    @property
    def stop_reason(self) -> str | None:
        """The stop signal's name once one came."""
        return self.signals.reason

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until a signal or a worker failure; returns the process exit code."""
        code = EXIT_WORKER_FAILED
        with self.signals:
            try:
                code = self._start()
                if code is None:
                    code = self._serve()
                return code
            finally:
                self._close()
                logger.info("engine core stopped (exit code %d)", code)

    def _start(self) -> int | None:
        """Bind, convert a GGUF model, start the workers, build the scheduler. An exit code
        on failure, else None."""
        try:
            if not is_gguf(self.config.model.model):  # a bad folder fails before binding
                resolve_max_model_len(self.config)
            observers = observers_for(self.config, logger)  # the advisory wing's, §8
            self.port.bind()
        except (ValueError, OSError) as e:
            logger.error("cannot start: %s", e)
            return EXIT_BAD_START
        logger.info("engine core listening on %s (model %s)", self.listen, self.config.model.model)
        try:
            # a GGUF file becomes a cached folder (minutes the first time, a hash later)
            self.model_dir = model_folder(self.config.model.model, self.signals.requested,
                                          self.log_level)
            max_model_len = resolve_max_model_len(self.config, self.model_dir)
            self.pooler = pooler_info(self.config, self.model_dir)
            logger.info("starting %d worker(s): torch, the model's weights from %s, the KV "
                        "cache (a first start on this machine also compiles the C kernels)",
                        self.config.parallel.world_size, self.model_dir)
            started = time.monotonic()
            self.workers.start(max_model_len)
            facts = self.facts
            self.first_start_s = time.monotonic() - started
            self.scheduler = Scheduler(self.config, facts.num_kv_blocks, facts.max_model_len,
                                       sliding_window=facts.sliding_window or None)
            self.depth = self.config.pipeline_depth(facts.device)
            self.core = EngineCore(self.scheduler, self.executor, self.depth,
                                   [*observers, self.batch_view])
        except InterruptedError:
            self.port.fail_start(f"engine core stopped during start-up: {self.stop_reason}")
            return EXIT_OK
        except (WorkerError, ValueError, OSError) as e:
            # A rank that cannot load, or a KV cache too small for max_model_len, say.
            logger.error("engine core failed to start: %s", e)
            self.port.fail_start(f"engine core failed to start: {e}")
            return EXIT_BAD_START
        self.vocab_size = facts.vocab_size
        self.info = self._engine_info(facts.num_kv_blocks, facts.max_model_len)
        self.port.ready(self.info)
        return None

    def _start_workers(self, max_model_len: int, stop_requested=None, **options) -> Executor:
        """A fresh executor with every rank loaded (`self.facts`: what the ranks found); the
        executor calls `stop_requested()` a few times a second while it waits (default:
        whether a stop signal came). WorkerError if a rank fails to start, InterruptedError
        on a stop signal: its ranks are killed then."""
        self.executor = make_executor(self.config, max_model_len, self.ctx, **options,
                                      step_timeout=self.config.parallel.worker_timeout,
                                      log_level=self.log_level,
                                      model_dir=self.model_dir)
        self._idle_poller = None  # it polls the executor's process fds
        if self.core is not None:
            self.core.replace_executor(self.executor)
        try:
            self.facts = self.executor.start(stop_requested or self.signals.requested)
        except BaseException:
            self.executor.kill()
            raise
        return self.executor

    def _stop_requested_answering_frontends(self) -> bool:
        """While replacement workers load (seconds): serve the frontends' frames (heartbeats
        echoed, requests queued), so that none takes the core for hung; whether to stop."""
        self._drain_frontends(block=False)
        return self.stop_reason is not None

    def _engine_info(self, num_blocks: int, max_model_len: int) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model=self.model_dir, max_model_len=max_model_len, num_kv_blocks=num_blocks,
            block_size=c.cache.block_size, max_num_seqs=c.scheduler.max_num_seqs,
            max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
            stream_interval=c.scheduler.stream_interval,
            max_num_queued_reqs=c.scheduler.max_num_queued_reqs,
            served_model_name=c.model.name, tokenizer=c.model.tokenizer or self.model_dir,
            vocab_size=self.vocab_size, scheduling_policy=c.scheduler.scheduling_policy,
            max_num_queued_tokens=c.scheduler.max_num_queued_tokens,
            heartbeat_interval=heartbeat_interval(self.frontend_timeout),
            frontend_timeout=self.frontend_timeout,
            max_queue_delay=c.scheduler.max_queue_delay,
            structured_outputs_max_bytes=c.model.structured_outputs_max_bytes,
            structured_outputs_compile_timeout=c.model.structured_outputs_compile_timeout,
            structured_outputs_cache_bytes=c.model.structured_outputs_cache_bytes,
            pooler=self.pooler,
            max_lora_rank=c.lora.max_lora_rank if c.lora.enable_lora else 0)

    def _serve(self) -> int:
        logger.info("engine core ready: %d KV blocks, async scheduling %s, up to %d plan(s) "
                    "in flight", self.info.num_kv_blocks,
                    "on" if self.depth > self.config.parallel.pipeline_parallel_size else "off",
                    self.depth)
        try:
            while self.stop_reason is None:
                try:
                    self._drain_frontends(block=self._is_idle())
                    self.port.expire_silent()
                    self.progress.tick(self.scheduler.stats)
                    self.core.tick()
                    if self.stop_reason is None:
                        self._step()
                except WorkerError as e:
                    self._heal(e)
        except WorkerError as e:
            logger.error("%s; failing every unfinished request", e)
            self.executor.kill()
            self._fail_everything(f"engine core: {e}")
            return EXIT_WORKER_FAILED
        except Exception as e:  # noqa: BLE001 - a bug must still reach the frontends
            logger.exception("engine core failed")
            self.executor.kill()
            self._fail_everything(f"engine core failed: {type(e).__name__}: {e}")
            return EXIT_WORKER_FAILED
        logger.info("stopping (%s): failing unfinished requests, telling frontends",
                    self.stop_reason)
        self._fail_everything(f"engine core shut down ({self.stop_reason})")
        self.executor.shutdown()
        return EXIT_OK

    def _heal(self, failure: WorkerError) -> None:
        """Replace every rank after `failure` and recompute the running requests (see the
        module docstring); a WorkerError once --max-worker-restarts are used up within the
        restart window (`Supervisor`: a replacement that fails to start is one more fault)."""
        cause = str(failure)
        while self.workers.may_restart(cause, f"; {len(self.scheduler.running)} running "
                                       "request(s) will be recomputed from their tokens"):
            self.core.drop_in_flight()
            self.scheduler.recompute_all()
            try:
                self.workers.respawn(self.scheduler.max_model_len,
                                     self._stop_requested_answering_frontends,
                                     startup_timeout=self._heal_startup_timeout())
            except InterruptedError:
                return  # a stop signal: the serve loop ends and fails what is unfinished
            except WorkerError as e:
                cause = str(e)
                continue
            facts = self.facts
            if (facts.num_kv_blocks < self.scheduler.num_kv_blocks
                    or facts.vocab_size != self.vocab_size):
                raise WorkerError(
                    f"the replacement workers report {facts.num_kv_blocks} KV blocks and a "
                    f"vocabulary of {facts.vocab_size}, where the engine core uses "
                    f"{self.scheduler.num_kv_blocks} and {self.vocab_size}")
            return
        raise WorkerError(self.workers.final_reason)

    def _heal_startup_timeout(self) -> float:
        """Seconds replacement workers get to report ready: a replacement that hangs while
        it starts (stopped, say) is one more fault to heal, not a core that waits out the
        first start-up's 10-minute limit without serving anyone. Several times the first
        start, which loaded the same model, and never under HEAL_MIN_STARTUP_S."""
        return max(HEAL_MIN_STARTUP_S, 5 * self.first_start_s)

    def _stats(self):
        """The scheduler's snapshot, with what the observers estimate (with --max-queue-delay,
        a new request's wait) and the restarts this core made."""
        stats = self.core.stats()
        stats.num_worker_restarts = self.workers.budget.total
        return stats

    def _fail_everything(self, reason: str) -> None:
        try:
            self.port.send_outputs(self.scheduler.fail_all(reason))
        finally:
            self.port.broadcast(EngineDead(reason))

    def _close(self) -> None:
        logging.getLogger("tidal").removeHandler(self.batch_view.warnings)
        if self.core is not None:
            self.core.close()  # the observers: a simulation still running is stopped
        if self.executor is not None:
            self.executor.kill()
        self.port.close()  # linger: queued EngineDead / outputs still go out
        self.ctx.term()

    # -- frontends -----------------------------------------------------------------------------

    def _is_idle(self) -> bool:
        return not self.core.has_work()

    def _drain_frontends(self, block: bool, max_wait: float = _HOUSEKEEPING_S) -> None:
        """Handle every queued frontend frame; when `block`, first wait for one (or a timer)."""
        if block:
            if self._idle_poller is None:
                self._idle_poller = zmq.Poller()  # frontends, signals, worker exits
                self._idle_poller.register(self.port.sock, zmq.POLLIN)
                self._idle_poller.register(self.signals.fd, zmq.POLLIN)
                for fd in self.executor.wait_fds():
                    self._idle_poller.register(fd, zmq.POLLIN)
            wait_ms = int(min(self._idle_wait(), max_wait) * 1000)
            events = dict(self._idle_poller.poll(wait_ms))
            if self.signals.fd in events:
                self.signals.clear()
            self.executor.check_alive()
        self.port.drain(self.signals.requested)

    def _idle_wait(self) -> float:
        """Seconds an idle poll may wait: until the next frontend could time out, at most 1 s."""
        return self.port.seconds_to_next_expiry(_HOUSEKEEPING_S)

    # -- what the frontend port asks (frontend_port.PortOwner) -------------------------------

    def add_request(self, client_id: str, msg: AddRequest, frame: bytes) -> None:
        try:
            request = Request.from_add(msg, client_id)
            check_request(request, self.vocab_size, self.config.scheduler.scheduling_policy,
                          self.config.model.structured_outputs_max_bytes)
            check_pooling(request, self.pooler)
            self.core.add(request)
        except ValueError as e:  # it never reaches the scheduler or a worker
            self.port.refuse(client_id, msg.req_id, str(e))

    def abort(self, client_id: str, req_ids: list[str]) -> None:
        """Abort the sender's own requests among `req_ids`; other ids are ignored."""
        requests = self.scheduler.requests
        own = [rid for rid in req_ids
               if (r := requests.get(rid)) is not None and r.client_id == client_id]
        if len(own) < len(req_ids):
            logger.debug("abort from %r: %d of %d ids are not its unfinished requests",
                         client_id, len(req_ids) - len(own), len(req_ids))
        self.port.send_outputs(self.scheduler.abort(own))

    def stats_query(self, client_id: str, view_since: int = -1) -> None:
        stats = self._stats()
        if view_since >= 0:  # the live batch view (ipc/batch_view.py)
            stats.view = self.batch_view.view(view_since, self.core.clock())
        self.port.send_stats([client_id], stats)

    def detach(self, client_id: str) -> int:
        return self.scheduler.abort_client(client_id)

    def drop(self, client_id: str, reason: str) -> list[EngineCoreOutput]:
        return self.scheduler.fail_client(client_id, reason).get(client_id, [])

    # -- one step ------------------------------------------------------------------------------

    def _step(self) -> None:
        """One `EngineCore.step`, its outputs routed to their frontends. A long step is waited
        for in slices; a stop signal does not wait on a hung worker for the whole
        --worker-timeout: after STOP_GRACE_S more seconds it gives up."""
        give_up_at = None
        while (outputs := self.core.step(timeout=_COLLECT_SLICE_S)) is None:
            # a long step (seconds of prefill on a slow CPU) must not silence the core:
            # frontends hear their heartbeats echoed, and new requests queue meanwhile
            self._drain_frontends(block=False)
            if self.stop_reason is not None:
                now = time.monotonic()
                give_up_at = give_up_at or now + STOP_GRACE_S
                if now > give_up_at:
                    raise WorkerError(f"worker rank 0 still busy {STOP_GRACE_S:.0f} s after "
                                      f"{self.stop_reason}")
        self.port.send_outputs(outputs)
        if self.core.stalled:
            # The scheduler had nothing to run (say, every waiting request lacks blocks):
            # wait briefly for a frontend instead of spinning.
            self._drain_frontends(block=True, max_wait=0.05)


# ---------------------------------------------------------------------------------------------
# entry points


def add_daemon_args(parser: argparse.ArgumentParser) -> None:
    """Add --listen, --engine-key-file, --frontend-timeout, --log-level and
    --generate-key-file (the engine flags come from `add_engine_args`)."""
    g = parser.add_argument_group("engine core daemon")
    g.add_argument("--listen", default=None,
                   help="ZeroMQ address frontends attach to: ipc://PATH or tcp://HOST:PORT "
                        "(default: an ipc socket in a directory only you can read)")
    g.add_argument("--engine-key-file", default=None,
                   help="CURVE key file (required to listen on a non-loopback tcp address)")
    g.add_argument("--frontend-timeout", type=float, default=DEFAULT_FRONTEND_TIMEOUT_S,
                   help="abort the requests of a frontend silent for this many seconds "
                        f"(default: {DEFAULT_FRONTEND_TIMEOUT_S:g})")
    g.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   help="log level of the engine core and its workers (default: INFO)")
    g.add_argument("--generate-key-file", metavar="PATH", default=None,
                   help="write a new CURVE key file to PATH and exit")
    g.add_argument("--engine-config", default=None, help=argparse.SUPPRESS)
    # (msgspec JSON of the whole EngineConfig, from an owner that starts a private daemon:
    # launcher.py; the engine flags are then ignored)
    g.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    # (set by the frontend that starts a private daemon: ipc/lifeline.py)


def run_daemon(config: EngineConfig, listen: str | None = None, key_file: str | None = None,
               frontend_timeout: float = DEFAULT_FRONTEND_TIMEOUT_S,
               log_level: str = "INFO") -> int:
    """Run an engine core in this process (main thread) until stopped; the exit code."""
    listen = listen or default_engine_address()
    return EngineCoreDaemon(config, listen, key_file, frontend_timeout, log_level).run()


def run_daemon_from_args(ns: argparse.Namespace) -> int:
    """`tidal core`: run the daemon from parsed engine + daemon flags, or with
    --data-parallel-size N the router and its N cores (`dp_router.py`); the exit code."""
    if not ns.generate_key_file and _data_parallel_size(ns) > 1:
        from .dp_router import run_router_from_args

        return run_router_from_args(ns)
    logging.basicConfig(level=ns.log_level,
                        format="%(asctime)s %(levelname)s [tidal core] %(message)s")
    if ns.lifeline_fd is not None:  # a private daemon: stop with the frontend that owns it
        watch_parent(ns.lifeline_fd, LIFELINE_GRACE_S, what="engine core")
    if ns.generate_key_file:
        write_key_file(ns.generate_key_file)
        print(f"wrote CURVE key file {ns.generate_key_file} (mode 0600); give it to "
              "`tidal core --engine-key-file` and to every frontend")
        return EXIT_OK
    try:
        return run_daemon(config_from_args(ns), ns.listen, ns.engine_key_file,
                          ns.frontend_timeout, ns.log_level)
    except ValueError as e:
        logger.error("%s", e)
        return EXIT_BAD_START


def _data_parallel_size(ns: argparse.Namespace) -> int:
    """The -dp of the flags or of a frontend's whole config (1 when the config is bad: the
    daemon then reports the field)."""
    try:
        return config_from_args(ns).parallel.data_parallel_size
    except ValueError:
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal core",
                                     description="tidal engine-core daemon")
    argv = sys.argv[1:] if argv is None else argv
    # a daemon a frontend starts gets its whole config as --engine-config: no help to print
    add_engine_args(parser, docs="--engine-config" not in argv)
    add_daemon_args(parser)
    return run_daemon_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
