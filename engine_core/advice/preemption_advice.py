"""After a spell of preemptions, what the simulator predicts for the traffic that caused it.

With a step cost model for this model and machine (`tidal tune profile`, or
`--step-cost-model`), the advisor observes the engine core (`observers.py`) and keeps the
requests it saw lately (`RecentRequests`: references to the `Request` objects, nothing copied
while they run). A spell starts at the first preemption seen; it ends once QUIET_S (the
config's `preemption_advice_quiet_s`) have passed without one and no request it preempted is
still unfinished, or MAX_SPELL_S after it began.
Its window is every request that arrived by then and was unfinished at any time since
LOOKBACK_S before the spell began; once they have all finished (or FINISH_WAIT_S later), the
advisor writes them as a `PreemptionWindow` (ipc/advice.py: lengths, the prefix cache's block
hashes and the times of first token and finish, never tokens) to a file and starts
`python -m tidal.engine_core.advice.advise FILE`: the simulator runs in its own process (at
nice 10, seconds of CPU), never in the step loop, and the engine core imports nothing of it.
When the child answers, the advisor logs its table and quotes its summary in the preemption
warnings that follow (`PreemptionLog.set_prediction`). At most one simulation per
ADVICE_INTERVAL_S.

Why a window around the spell: preemptions come from the KV cache the running requests hold,
so the requests that were running before the first preemption matter as much as those that
arrived during it; and the simulator needs each request's output length, which is known
when it has finished (one still running after FINISH_WAIT_S goes in with the tokens it has,
and the table says how many did).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque

import msgspec

from ..config import EngineConfig, SchedulerConfig, encode_engine_config
from ..preemption_log import PreemptionLog
from ..request import Request
from ...ipc.advice import PreemptionPrediction, PreemptionWindow, WindowRequest

LOOKBACK_S = 60.0
"""Seconds before a spell's first preemption whose requests the window includes."""
MAX_SPELL_S = 60.0
"""A spell still going on after this long is simulated anyway."""
FINISH_WAIT_S = 60.0
"""Longest wait for the window's requests to finish once the spell is over."""
QUIET_S = SchedulerConfig.preemption_advice_quiet_s
"""The default seconds without a preemption that end a spell (the config field says why)."""
ADVICE_INTERVAL_S = 300.0
"""Least seconds between the starts of two simulations."""
CHILD_TIMEOUT_S = 300.0
"""A simulation not done by then is killed (and said so)."""
POLL_S = 0.5
"""`poll` is called on every turn of the daemon's loop (`observers.py`); it does its work at
most this often."""
MAX_FINISHED = 50_000
"""Most finished requests remembered (about 200 bytes each, plus 8 per prompt block)."""
ADVISOR_MODULE = "tidal.engine_core.advice.advise"


def window_request(request: Request, block_size: int) -> WindowRequest:
    """What the simulator needs of one request. Its prefix hashes are the prefix cache's own
    (`Request.block_hashes`, chained, salted, per `block_size` tokens: computed as its blocks
    were), cut to the prompt's full blocks and to 64 bits; none with prefix caching off,
    where sharing changes nothing."""
    num_blocks = request.num_prompt_tokens // block_size
    return WindowRequest(request.add_time, request.num_prompt_tokens,
                         len(request.output_token_ids),
                         b"".join(h[:8] for h in request.block_hashes[:num_blocks]),
                         request.priority, request.num_preemptions,
                         request.first_token_time, request.finish_time)


class RecentRequests:
    """The requests the core saw lately: the unfinished ones (references), and those that
    finished in the last `keep_s` seconds, as `WindowRequest`s (8 bytes per prompt block: a
    finished request's tokens are not kept), at most MAX_FINISHED of them."""

    def __init__(self, keep_s: float, block_size: int) -> None:
        self.keep_s = keep_s
        self.block_size = block_size
        self._unfinished: list[Request] = []
        self._finished: deque[WindowRequest] = deque(maxlen=MAX_FINISHED)

    def add(self, request: Request) -> None:
        self._unfinished.append(request)

    def sweep(self, now: float) -> None:
        """Record what finished since the last sweep; forget what finished before
        now - keep_s (on the scheduler's clock)."""
        still = []
        for request in self._unfinished:
            if request.status.is_finished():
                self._finished.append(window_request(request, self.block_size))
            else:
                still.append(request)
        self._unfinished = still
        while self._finished and self._finished[0].finish_time < now - self.keep_s:
            self._finished.popleft()  # about in finish order: swept every POLL_S

    def clear(self) -> None:
        self._unfinished = []
        self._finished.clear()

    def any_preempted_unfinished(self) -> bool:
        return any(r.num_preemptions for r in self._unfinished)

    def since(self, start: float) -> tuple[list[WindowRequest], list[Request]]:
        """Every request unfinished at some time since `start`: those finished, as records,
        and those still unfinished."""
        return [r for r in self._finished if r.finish_time >= start], list(self._unfinished)


class PreemptionAdvisor:
    """Watches the preemption count; after a spell, runs the simulator in a child process and
    hands its prediction to the preemption warning (see the module docstring)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 step_cost_model: str, preemption_log: PreemptionLog,
                 logger: logging.Logger) -> None:
        self.config = config
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.step_cost_model = step_cost_model
        self.preemption_log = preemption_log
        self.logger = logger
        self.recent = RecentRequests(LOOKBACK_S + MAX_SPELL_S + 10 * POLL_S,
                                     config.cache.block_size)
        self._num_preemptions = 0
        self._spell_start: float | None = None
        self._last_preemption = 0.0  # when poll last saw the count grow
        self._window: tuple[list[WindowRequest], list[Request]] | None = None
        """A spell's requests (finished, unfinished) until the unfinished ones finish."""
        self._window_since = 0.0
        self._next_poll = 0.0
        self._quiet_until = 0.0  # no new spell before this (ADVICE_INTERVAL_S)
        self._child: subprocess.Popen | None = None
        self._child_started = 0.0
        self._window_file: str | None = None
        self.broken = False
        """poll failed (a full temp folder, no process to start): the advisor is off."""
        preemption_log.expect_predictions(True)

    def added(self, request: Request) -> None:
        """The scheduler took a new request."""
        if not self.broken:  # off: nothing sweeps the list any more
            self.recent.add(request)

    def poll(self, num_preemptions: int, now: float) -> None:
        """Called every loop iteration with the scheduler's preemption count. Never raises:
        advice is not worth an engine, so a failure turns the advisor off with a warning."""
        if now < self._next_poll or self.broken:
            return
        self._next_poll = now + POLL_S
        try:
            self._poll(num_preemptions, now)
        except Exception as e:  # noqa: BLE001 - see the docstring
            self.logger.warning("preemption advice off: %s: %s", type(e).__name__, e)
            self.broken = True
            self._window = None
            self.recent.clear()
            self._end_child()
            self.preemption_log.expect_predictions(False)

    def _poll(self, num_preemptions: int, now: float) -> None:
        self.recent.sweep(now)
        grew = num_preemptions > self._num_preemptions
        self._num_preemptions = num_preemptions  # counted even while a simulation runs
        if grew:
            self._last_preemption = now
        if self._child is not None:
            self._collect(now)
            return
        if self._window is not None:
            if (now - self._window_since >= FINISH_WAIT_S
                    or all(r.status.is_finished() for r in self._window[1])):
                self._simulate(now)
            return
        if grew and self._spell_start is None and now >= self._quiet_until:
            self._spell_start = now
        if self._spell_start is not None and self._spell_over(now):
            self._window = self.recent.since(self._spell_start - LOOKBACK_S)
            self._window_since = now
            self._spell_start = None
            self._quiet_until = now + ADVICE_INTERVAL_S

    def _spell_over(self, now: float) -> bool:
        if now - self._spell_start >= MAX_SPELL_S:
            return True
        quiet_s = self.config.scheduler.preemption_advice_quiet_s
        return (now - self._last_preemption >= quiet_s
                and not self.recent.any_preempted_unfinished())

    def _simulate(self, now: float) -> None:
        """Write the window and start the advisor process."""
        (finished, others), self._window = self._window, None
        num_unfinished = sum(not r.status.is_finished() for r in others)
        block_size = self.config.cache.block_size
        requests = sorted(finished + [window_request(r, block_size) for r in others],
                          key=lambda r: r.arrival_time)
        window = PreemptionWindow(encode_engine_config(self.config), self.num_kv_blocks,
                                  self.max_model_len, self.step_cost_model, requests,
                                  num_unfinished, block_size)
        fd, self._window_file = tempfile.mkstemp(prefix="tidal-preemption-window-",
                                                 suffix=".msgpack")
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.msgpack.encode(window))
        # the child deletes the file once read (so does _end_child: whoever comes first)
        self._child = subprocess.Popen([sys.executable, "-m", ADVISOR_MODULE,
                                        self._window_file],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self._child_started = now
        self.logger.info("preemptions: simulating the last %d requests on the step cost model "
                         "%s (child process %d)", len(requests), self.step_cost_model,
                         self._child.pid)

    def _collect(self, now: float) -> None:
        """The child's answer, once it has one."""
        code = self._child.poll()
        if code is None:
            if now - self._child_started > CHILD_TIMEOUT_S:
                self.logger.warning("preemption advice: the simulation took over %.0f s; "
                                    "stopped", CHILD_TIMEOUT_S)
                self._end_child()
            return
        answer = self._child.stdout.read()
        self._end_child()
        try:
            if code != 0:
                raise ValueError(f"exit status {code}")
            prediction = msgspec.msgpack.decode(answer, type=PreemptionPrediction)
        except (ValueError, msgspec.DecodeError) as e:
            self.logger.warning("preemption advice: the simulation failed (%s)", e)
            return
        self.preemption_log.set_prediction(prediction.summary, time.time())
        self.logger.warning("Preemption advice: %s.\n%s", prediction.summary,
                            prediction.report)

    def _end_child(self) -> None:
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.wait()
            self._child.stdout.close()
            self._child = None
        if self._window_file is not None:
            try:
                os.unlink(self._window_file)
            except OSError:  # the child removed it already
                pass
            self._window_file = None

    def close(self) -> None:
        """Stop a simulation still running; remove its file."""
        self._end_child()
