"""How long a request arriving now would wait for its first token (`--max-queue-delay`).

The engine core knows the queue; the frontends answer HTTP. So the core computes the estimate
from the work queued (with the step cost model, `step_cost.py`) and sends it in every
`SchedulerStats`; a frontend adds the new request's own prompt and what it admitted since that
snapshot, and answers 503 with `Retry-After` when the total exceeds the limit:

    estimate = queue_delay_s + (prompt tokens + tokens admitted since) * s_per_prompt_token
               + (requests admitted since) * s_per_queued_request

Two ways a request waits, the larger counts (`queue_delay_s`):

- **token work**: every prompt token queued ahead (waiting requests in full, the rest of
  prefills in progress) must be computed first, a step at a time, next to the running decodes.
  A step holds C = `max_num_batched_tokens - D` prompt tokens beside D decodes, and takes what
  the cost model says for it as served (`StepCostModel.served_predict`: the worker's time plus
  the per-step overhead and the D tokens streamed), so each prompt token costs
  `s_per_prompt_token` = that time / C (plus its share of the way in, `per_prompt_token_
  latency`); plus the step in flight (its decodes: F, 0 when idle), the fixed part of the
  step that ends with the new request's prompt (F, or a bare step's when nothing decodes:
  the steps a prompt spans are whole, and with x tokens up to its last, ceil(x / C) * F +
  x * marginal cost <= F + x * step / C), and the request's fixed way in
  (`request_latency_s`):

      token work = F + (F or bare step) + request_latency_s + queued tokens * s_per_prompt_token

  Measured (BENCHMARKS.md, admission check): pricing steps without the serving terms and
  without the request's own step's fixed part, the estimate ran low under load, where the
  150 running decodes stream 44 ms of tokens each step on the demo model.
- **slots**: when the waiting requests outnumber the free places (`max_num_seqs` minus
  running, or fewer when free KV blocks would not hold them), a request waits for that many
  running ones to finish, at the rate they have been finishing (over the last `window_s`).
  Unknown until a finish has been seen; until then this term is 0.

Not modelled: prefix-cache hits of queued prompts (counted in full: an overestimate), and the
output lengths of running requests (unknown to the engine; the measured finish rate stands in).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tidal.engine_core.step_cost import StepCostModel


@dataclass
class QueueEstimate:
    """The estimate's three parts (seconds)."""

    queue_delay_s: float = 0.0
    s_per_prompt_token: float = 0.0
    s_per_queued_request: float = 0.0


class QueueDelayEstimator:
    """Lives in the engine core beside the scheduler; `estimate(scheduler, now)` per snapshot."""

    def __init__(self, cost_model: StepCostModel, window_s: float = 10.0) -> None:
        self.cost_model = cost_model
        self.window_s = window_s
        self._finishes: deque[tuple[float, int]] = deque()
        """(time, scheduler.num_finished) samples, one per estimate, the last window_s."""

    def finish_rate(self, num_finished: int, now: float) -> float:
        """Requests finished per second over the last window (0 before any finish)."""
        samples = self._finishes
        samples.append((now, num_finished))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        t0, n0 = samples[0]
        if now - t0 <= 0 or num_finished <= n0:
            return 0.0
        return (num_finished - n0) / (now - t0)

    def estimate(self, scheduler, now: float) -> QueueEstimate:
        """The estimate for the scheduler's state now (see the module docstring)."""
        cost = self.cost_model
        num_decodes = context = prefill_left = 0
        for request in scheduler.running:
            left = (len(request.all_token_ids) + request.num_output_placeholders
                    - request.num_computed_tokens)
            if left > 1:
                prefill_left += left
            else:
                num_decodes += 1
                context += request.num_computed_tokens + 1
        waiting_tokens = sum(len(r.all_token_ids) for r in scheduler.waiting)
        chunk = max(scheduler.max_num_batched_tokens - num_decodes, 1)
        step = cost.served_predict(chunk, num_decodes, context, chunk * (chunk + 1) / 2,
                                   num_decodes + 1)
        per_token = step / chunk + cost.per_prompt_token_latency_s
        in_flight = cost.served_predict(0, num_decodes, context, 0.0, num_decodes)
        own_step = in_flight or cost.intercept_s + cost.per_step_overhead_s
        token_work = (in_flight + own_step + cost.request_latency_s
                      + (waiting_tokens + prefill_left) * per_token)

        rate = self.finish_rate(scheduler.num_finished, now)
        per_request = slot_wait = 0.0
        num_waiting = len(scheduler.waiting)
        if rate > 0 and num_waiting:
            room = self._free_places(scheduler, num_waiting, waiting_tokens)
            if num_waiting >= room:
                per_request = 1.0 / rate
                slot_wait = (num_waiting - room + 1) * per_request
        return QueueEstimate(max(token_work, slot_wait), per_token, per_request)

    @staticmethod
    def _free_places(scheduler, num_waiting: int, waiting_tokens: int) -> int:
        """Waiting requests that could be admitted now: free sequence slots, or fewer when
        the free KV blocks hold fewer average waiting requests."""
        free_slots = scheduler.max_num_seqs - len(scheduler.running)
        blocks_each = max(1, -(-waiting_tokens // (num_waiting * scheduler.block_size)))
        free_by_kv = scheduler.kv_cache_manager.num_free_blocks() // blocks_each
        return max(0, min(free_slots, free_by_kv))
