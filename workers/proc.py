"""The worker process: ZeroMQ sockets around one `Worker` (one tensor-parallel rank).

Started by the engine core's executor as

    python -m tidal.workers.proc --config B64 --plan-address A --result-address B --lifeline-fd F

where B64 is the msgpack-encoded `WorkerConfig` (see `tidal.ipc.transport.encode_worker_config`).

Conversation (the engine core binds both sockets, the worker connects):

    plan PULL  ◄── CoreToWorker: InitKVCache once, then BatchPlan per step, Shutdown at the end
    result PUSH ──► WorkerToCore: WorkerReady after loading (every rank), SampledTokens per
                    step (rank 0 only), WorkerFailed if anything raises (then exit 1)

The worker never outlives the engine core: F is the read end of the core's lifeline pipe, and
the worker SIGKILLs itself the moment it reads end-of-file there (`ipc/lifeline.py`; a worker
has nothing to save). SIGINT is ignored (a Ctrl-C reaches the whole process group; the engine
core decides, then sends Shutdown).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import sys
import time
import traceback

import zmq

from ..ipc.lifeline import watch_parent
from ..ipc.transport import (
    CoreToWorkerDecoder,
    connect_worker_sockets,
    decode_worker_config,
    encode,
    worker_keys_from_env,
)
from ..ipc.worker_messages import (
    BatchPlan,
    InitKVCache,
    SampledTokens,
    Shutdown,
    WorkerConfig,
    WorkerFailed,
)

logger = logging.getLogger(__name__)

IDLE_AFTER_MS = 50
"""A worker counts as idle (background chores such as committing the KV cache may run,
`workers/host_memory.py`) once no plan has come for this long, not in the gap between two
steps: committing in those ~1-3 ms gaps took the CPU the engine core was planning the next
step on, and a saturated offline run of the 7M model took 10% longer (5.70-6.36 s against
5.17-5.80 s over four runs each, 2-vCPU Xeon, 2026-12-02)."""


class WorkerProcess:
    """Sockets, handshake and step loop of one rank; `run()` returns the exit code."""

    def __init__(self, config: WorkerConfig, plan_address: str, result_address: str,
                 load_threads=None) -> None:
        """`load_threads`: a `cpu_contention.LoadThreads` made when the process started
        (None: load on torch's threads)."""
        self.config = config
        self.load_threads = load_threads
        self.ctx = zmq.Context()
        # Over TCP to another machine (the Ray executor) the core's sockets are CURVE servers.
        keys = worker_keys_from_env(os.environ)
        self.plan_sock, self.result_sock = connect_worker_sockets(
            self.ctx, plan_address, result_address, keys)
        self.decoder = CoreToWorkerDecoder()
        self.worker = None
        self.ready = False  # WorkerReady sent
        self.contention = None  # CpuContention, once loaded

    def run(self) -> int:
        try:
            from .host_memory import keep_freed_memory
            from .worker import Worker

            _freeze_imported_heap()
            keep_freed_memory()  # before any step's temporaries (host_memory.py says why)
            self.worker = Worker(self.config)
            with self._loading():
                self.worker.load()
                self.worker.determine_num_kv_blocks()
            self.result_sock.send(encode(self.worker.ready_message()))
            self.ready = True
            self.contention = self._contention()
            self._loop()
            return 0
        except Exception as exc:  # noqa: BLE001 - report anything to the core, exit non-zero
            error = traceback.format_exc()
            # A ValueError while loading is the model's or the config's (an architecture tidal
            # does not run, say): the engine core prints it once, in one line; the traceback
            # is for --log-level debug. Anything else may be a bug: its traceback, always.
            expected = isinstance(exc, ValueError) and not self.ready
            logger.log(logging.DEBUG if expected else logging.ERROR,
                       "worker rank %d failed:\n%s", self.config.worker_index, error)
            self.result_sock.send(encode(WorkerFailed(self.config.worker_index,
                                                      error[-4000:])))
            return 1
        finally:
            self._close()

    def _loading(self):
        """One thread for the load where the start was contended, on the CPU with
        cpu_wait_policy=auto (`cpu_contention.LoadThreads`); else nothing changes."""
        if (self.load_threads is None or self.worker.device.type != "cpu"
                or self.config.cpu_wait_policy != "auto"):
            return contextlib.nullcontext()
        return self.load_threads.loading()

    def _contention(self):
        """The rank's CpuContention: while other processes take the cores it halves the
        steps' threads and throttles libgomp's spinning, only where the rank computes on the
        CPU with cpu_wait_policy=auto and runs libgomp (workers/cpu_contention.py)."""
        from .cpu_contention import ContendedMode, CpuContention, OpenMPThrottle

        import torch

        on_cpu = self.worker.device.type == "cpu"
        # the steps' threads as torch has them (the config's count, or OMP_NUM_THREADS)
        threads = torch.get_num_threads() if on_cpu else (
            self.config.cpu_threads or os.cpu_count() or 1)
        throttle = None
        if self.config.cpu_wait_policy == "auto" and on_cpu:
            omp = OpenMPThrottle(threads)
            if omp.available:
                throttle = ContendedMode(threads, omp).engage
        monitor = CpuContention(self.config.worker_index, threads, throttle=throttle)
        if self.load_threads is not None and self.load_threads.was_contended:
            monitor.start_throttled(self.load_threads.share)  # the first steps too
        return monitor

    def _loop(self) -> None:
        while True:
            if not self.plan_sock.poll(IDLE_AFTER_MS):  # no plan for a while: idle until one
                self.worker.set_idle(True)
                # work deferred from load, one piece at a time while no plan waits
                while self.worker.idle_chore() and not self.plan_sock.poll(0):
                    pass
            raw = self.plan_sock.recv()
            self.worker.set_idle(False)
            msg = self.decoder.decode(raw)
            if msg is None:  # the persistent batch would miss this plan's deltas: stop loudly
                raise RuntimeError("a message from the engine core does not decode")
            if isinstance(msg, BatchPlan):
                self._execute(msg)
            elif isinstance(msg, InitKVCache):
                self.worker.init_kv_cache(msg.num_blocks)
            elif isinstance(msg, Shutdown):
                return

    def _execute(self, plan: BatchPlan) -> None:
        started = time.monotonic()
        sampled = self.worker.execute(plan)
        self.contention.step(time.monotonic() - started)  # warns when cores are taken
        if not self.config.reports_tokens:
            return
        if sampled is None:  # nothing sampled this step: still answer, the core waits
            sampled = SampledTokens(plan.step_id, [], b"")
        self.result_sock.send(encode(sampled))

    def _close(self) -> None:
        if self.worker is not None:
            try:
                self.worker.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("worker rank %d: shutdown failed", self.config.rank)
        self.plan_sock.close(linger=0)
        self.result_sock.close()
        self.ctx.term()


def _freeze_imported_heap() -> None:
    """Move every object the imports made (torch's ~180,000) to the collector's permanent
    generation and turn collection back on (`main` turns it off first thing).

    Python's cyclic collector runs a full pass whenever enough allocations pile up, and each
    pass walks every tracked object: importing torch (~1 s of a worker's ~1.2 s start) spent
    ~0.11 s in such passes, and the first full pass after it, which came during the model's
    load, took 60-80 ms more (perf, the demo model on the 2-vCPU Zen 4 EPYC, 2026-12-04).
    Frozen, the imports' objects are never walked again, so a full pass in a step only
    walks what the worker made since. They are frozen without a collection first (that
    pass costs ~0.09 s): the ~7,000 unreachable objects the imports left stay in memory.
    vLLM freezes its engine core's start-up heap the same way (`freeze_gc_heap`)."""
    gc.freeze()
    gc.enable()


def _skip_numba_blas_probe() -> None:
    """Spare a process numba's BLAS probe; call before its first compile or cache load.

    At its first compile (a cache load included) numba imports `numba.np.arraymath`, which
    imports `scipy.linalg.cython_blas` only to learn whether `np.dot` inside compiled code
    may call BLAS: 0.23 s of a worker's 0.73 s numba start-up, measured on this project's
    2-vCPU VM. No tidal kernel calls BLAS from compiled code (`kernels/cpu/cpu_fused.py`,
    `kernels/attention/numba_attention.py`; matrix products are torch's), so the worker process marks
    that module absent (`sys.modules[...] = None`, Python's own way to make an import fail):
    numba then records "no BLAS", and a compiled `np.dot`, were one ever added, would fail
    with numba's own "scipy ... is required" error. Only the worker process does this; a
    process that imports tidal as a library keeps scipy."""
    sys.modules.setdefault("scipy.linalg.cython_blas", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tidal worker process (started by tidal core)")
    parser.add_argument("--config", required=True, help="base64 msgpack WorkerConfig")
    parser.add_argument("--plan-address", required=True)
    parser.add_argument("--result-address", required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True,
                        help="read end of the engine core's lifeline pipe")
    parser.add_argument("--log-level", default="INFO")
    gc.disable()  # until the imports are done (`_freeze_imported_heap`)
    args = parser.parse_args(argv)
    from .cpu_contention import LoadThreads, apply_wait_policy

    load_threads = LoadThreads()  # the start's run-queue wait, from here (torch not loaded)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(args.lifeline_fd, grace_s=0, what="worker")
    config = decode_worker_config(args.config)
    _skip_numba_blas_probe()
    apply_wait_policy(config.cpu_wait_policy, os.environ)  # before torch loads libgomp
    if config.cpu_cores:  # before torch starts its thread pools: they inherit the mask
        os.sched_setaffinity(0, config.cpu_cores)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [tidal worker {config.worker_index}] %(name)s: %(message)s")
    proc = WorkerProcess(config, args.plan_address, args.result_address, load_threads)
    return proc.run()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's slow teardown (torch's), once sockets are flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
