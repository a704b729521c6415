"""The engine core on simulated time: the real `Scheduler` (and its block pool and prefix
cache), fed a request trace, with each step lasting what the step cost model says.

The loop is the engine core's (`EngineCore.step`, engine_core/core.py), with the clock and the
workers replaced:

    add the requests that have arrived by `now`
    if fewer than `depth` plans are in flight:          depth 2 with async scheduling, else 1
        plan = scheduler.schedule(); the worker starts it when it finishes the one before
        (async: go round again and plan the next step before waiting)
    now = when the oldest plan in flight ends; scheduler.update(plan, its sampled tokens)

- The worker side is exact bookkeeping, as a real worker does it: a request samples when its
  scheduled range reaches the end of the tokens the worker knows, and the worker then knows
  one more. Token values are a constant: every request ignores EOS with `max_tokens` = its
  trace output length, so lengths follow the trace (the scheduler never looks at values).
- Prompt token ids come from the trace's prefix hashes (`TraceRequest.token_ids`), so the
  prefix cache shares what the traced requests shared.
- A request whose prompt + output does not fit `max_model_len` is refused, as `tidal serve`
  answers it 400, and counted in `refused`.

Serving (the cost model's serving terms, when `tidal tune profile` measured them; else 0):
a request reaches the scheduler `request_latency + per_prompt_token_latency x its prompt
tokens` after it arrives (its TTFT counts from the arrival), and every step with tokens lasts
`per_step_overhead + per_streamed_token x tokens sampled` longer than the worker's `execute`
(`StepCostModel.served_step_time`): the engine core, the HTTP server and its clients, where
they share the workers' cores; and a step lasts `StepCostModel.arrival_charge(prompt tokens)`
longer for each request that arrives while it runs (arrivals in (start, end] of its
predicted span). Not modelled: a
stream interval above 1.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..config import EngineConfig
from ..request import Request
from ..scheduler import Scheduler
from .latency import DEFAULT_PERCENTILES, latency_stats
from .step_cost import StepCostModel
from .trace import Trace
from ...ipc.messages import SamplingParams, pack_token_ids
from ...ipc.worker_messages import BatchPlan, SampledTokens

_TOKEN = pack_token_ids([1])
"""The token every simulated step samples."""
_CLIENT = "sim"


@dataclass
class SimResult:
    """Per-request times (seconds since the trace started; NaN where it never happened) and
    the run's timeline."""

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    itl: np.ndarray
    """Every gap between two successive tokens of one request."""
    refused: int
    num_preemptions: int
    num_steps: int
    prefix_cache_hit_rate: float | None
    timeline: dict = field(default_factory=dict)
    """Lists per step: time, num_running, num_waiting, kv_cache_usage."""

    def summary(self, percentiles=DEFAULT_PERCENTILES) -> dict:
        """The numbers `tidal bench serve` reports, under the same keys (ms, tok/s)."""
        done = ~np.isnan(self.finish)
        duration = float(np.nanmax(self.finish)) if done.any() else 0.0
        ttft = (self.first_token - self.arrival)[done]
        e2el = (self.finish - self.arrival)[done]
        out = self.output_len[done]
        multi = out > 1
        tpot = (e2el[multi] - ttft[multi]) / (out[multi] - 1)
        input_tokens, output_tokens = int(self.prompt_len[done].sum()), int(out.sum())
        d = max(duration, 1e-9)
        summary = {
            "completed": int(done.sum()), "failed": 0, "refused": self.refused,
            "duration_s": duration, "total_input_tokens": input_tokens,
            "total_output_tokens": output_tokens, "request_throughput": int(done.sum()) / d,
            "output_throughput": output_tokens / d,
            "total_token_throughput": (input_tokens + output_tokens) / d,
            "percentiles": list(percentiles), "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate, "num_steps": self.num_steps,
            "max_num_waiting": max(self.timeline.get("num_waiting") or [0]),
            "max_num_running": max(self.timeline.get("num_running") or [0]),
            "max_kv_cache_usage": max(self.timeline.get("kv_cache_usage") or [0.0]),
            **self._backlog(),
        }
        summary.update(latency_stats(ttft, "ttft", percentiles))
        summary.update(latency_stats(tpot, "tpot", percentiles))
        summary.update(latency_stats(self.itl, "itl", percentiles))
        summary.update(latency_stats(e2el, "e2el", percentiles))
        return summary


    def _backlog(self) -> dict:
        """Mean requests in the system (arrived, unfinished) seen by the arrivals of the second
        quarter and of the last quarter of the trace, and whether it kept up: the later at
        most 1.5 times the earlier plus 2 (a backlog that grows through the trace is an
        overload that a longer trace would turn into unbounded latency)."""
        n = len(self.arrival)
        if n < 8:
            return {"backlog_q2": 0.0, "backlog_q4": 0.0, "keeps_up": True}
        finish = np.sort(np.where(np.isnan(self.finish), np.inf, self.finish))
        index = np.arange(n)
        in_system = index + 1 - np.searchsorted(finish, self.arrival, side="right")
        q2 = float(in_system[n // 4:n // 2].mean())
        q4 = float(in_system[3 * n // 4:].mean())
        return {"backlog_q2": q2, "backlog_q4": q4, "keeps_up": q4 <= 1.5 * q2 + 2}


class Simulator:
    """Runs one trace through a fresh `Scheduler` built from `config` (the daemon's class)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 cost_model: StepCostModel) -> None:
        # without speculative decoding: this simulated worker samples one token per request
        # and step, and cannot verify drafts (the step cost model prices plain decodes)
        config = replace(config, scheduler=replace(config.scheduler, speculative_config=None))
        self.config = config
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        # async scheduling unset: as the daemon decides it for the device the cost was measured on
        self.depth = 1 + config.scheduler.async_on(cost_model.info.get("device", "cpu"))
        self.now = 0.0
        self.scheduler = Scheduler(config, num_kv_blocks, max_model_len)
        self.scheduler.clock = lambda: self.now
        self.scheduler.preemption_log = _NoPreemptionLog()  # counted, not logged
        self._worker_len: dict[str, int] = {}
        """req_id -> tokens the (simulated) worker knows for the request."""

    # -- the worker's side ---------------------------------------------------------------------

    def _execute(self, plan: BatchPlan) -> SampledTokens:
        """Who samples in this plan, as a worker with a persistent batch decides it."""
        known = self._worker_len
        for req_id in plan.finished_req_ids:
            known.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            known.pop(req_id, None)
        sampled = []
        for new in plan.new_requests:
            n = len(new.token_ids) >> 2
            if new.num_computed_tokens + new.num_scheduled_tokens == n:
                sampled.append(new.req_id)
                n += 1
            known[new.req_id] = n
        for cached in plan.cached_requests:
            n = known[cached.req_id]
            if cached.num_computed_tokens + cached.num_scheduled_tokens == n:
                sampled.append(cached.req_id)
                known[cached.req_id] = n + 1
        return SampledTokens(plan.step_id, sampled, _TOKEN * len(sampled))

    # -- the run -------------------------------------------------------------------------------

    def run(self, trace: Trace) -> SimResult:
        """Simulate every request of `trace` to its end; the measurements."""
        requests = trace.requests
        n = len(requests)
        arrival = np.array([r.arrival_time for r in requests], dtype=np.float64)
        first_token = np.full(n, np.nan)
        finish = np.full(n, np.nan)
        last_token: list[float | None] = [None] * n
        itl = array("d")
        refused = 0
        timeline = {"time": [], "num_running": [], "num_waiting": [], "kv_cache_usage": []}
        sched, cost = self.scheduler, self.cost_model
        # when each request reaches the scheduler: its arrival plus the way through the HTTP
        # server (0 without serving terms); in that order
        ready = arrival + np.array([cost.request_latency(r.prompt_len) for r in requests])
        order = np.argsort(ready, kind="stable")
        # what the requests arriving in (start, end] add to a step: charged[hi] - charged[lo]
        by_arrival = np.argsort(arrival, kind="stable")
        arrived = arrival[by_arrival]
        charged = np.concatenate([[0.0], np.cumsum(
            [cost.arrival_charge(requests[i].prompt_len) for i in by_arrival])])
        sampling_by_len: dict[int, SamplingParams] = {}
        in_flight: deque = deque()  # (plan, end time, sampled)
        worker_free = 0.0
        k = 0
        self.now = 0.0
        while k < n or in_flight or sched.has_unfinished_requests():
            while k < n and ready[order[k]] <= self.now:  # the daemon drains its frontends
                i = int(order[k])
                r = requests[i]
                if r.prompt_len + r.output_len > self.max_model_len or r.output_len < 1:
                    refused += 1
                else:
                    params = sampling_by_len.get(r.output_len)
                    if params is None:
                        params = sampling_by_len[r.output_len] = SamplingParams(
                            max_tokens=r.output_len, ignore_eos=True)
                    sched.add(Request(str(i), r.token_ids(i), params, client_id=_CLIENT,
                                      priority=r.priority, arrival_time=r.arrival_time))
                k += 1
            if len(in_flight) < self.depth and sched.has_unfinished_requests():
                plan = sched.schedule()
                sampled = self._execute(plan)
                end = self.now
                if plan.total_num_scheduled_tokens:
                    start = max(self.now, worker_free)
                    end = start + cost.served_step_time(plan, len(sampled.req_ids))
                    if charged[-1]:  # the requests coming in meanwhile slow it
                        end += (charged[np.searchsorted(arrived, end, "right")]
                                - charged[np.searchsorted(arrived, start, "right")])
                    worker_free = end
                in_flight.append((plan, end, sampled))
                timeline["time"].append(self.now)
                timeline["num_running"].append(len(sched.running))
                timeline["num_waiting"].append(len(sched.waiting))
                timeline["kv_cache_usage"].append(sched.kv_cache_manager.usage())
                if len(in_flight) < self.depth:
                    continue
            if not in_flight:  # idle: the next arrival wakes the engine
                if k >= n:
                    raise RuntimeError("simulation stuck: requests wait but nothing can run")
                self.now = max(self.now, float(ready[order[k]]))
                continue
            plan, end, sampled = in_flight.popleft()
            self.now = max(self.now, end)
            outputs = sched.update(plan, sampled).get(_CLIENT, ())
            now = self.now
            for out in outputs:
                i = int(out.req_id)
                if out.new_token_ids:
                    last = last_token[i]
                    if last is None:
                        first_token[i] = now
                    else:
                        itl.append(now - last)
                    last_token[i] = now
                if out.finish_reason is not None:
                    finish[i] = now
            if (not plan.total_num_scheduled_tokens and not in_flight
                    and sched.has_unfinished_requests()):
                # Nothing ran and nothing is in flight: only an arrival can change that.
                if k >= n:
                    raise RuntimeError("simulation stuck: requests wait but nothing can run")
                self.now = max(self.now, float(ready[order[k]]))
        prompt_len = np.array([r.prompt_len for r in requests], dtype=np.int64)
        output_len = np.array([r.output_len for r in requests], dtype=np.int64)
        hit_rate = (sched.prefix_cache_hits / sched.prefix_cache_queries
                    if sched.prefix_cache_queries else None)
        return SimResult(arrival, first_token, finish, prompt_len, output_len,
                         np.frombuffer(itl, dtype=np.float64), refused, sched.num_preemptions,
                         sched.num_steps, hit_rate, timeline)


class _NoPreemptionLog:
    """The scheduler's preemption warning, silenced: the simulator counts preemptions."""

    def record(self, *args) -> None:
        pass


def simulate(config: EngineConfig, num_kv_blocks: int, max_model_len: int,
             cost_model: StepCostModel, trace: Trace) -> SimResult:
    """One run of `trace` on a fresh scheduler."""
    return Simulator(config, num_kv_blocks, max_model_len, cost_model).run(trace)
