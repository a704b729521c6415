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
  A step holds C = `max_num_batched_tokens - D` prompt tokens beside D decodes. Its price as
  served (`StepCostModel.served_predict`: the worker's time plus the per-step overhead and the
  D + 1 tokens streamed) splits into a fixed part S (intercept, decodes, overhead, streaming)
  and what its prompt tokens add (`prefill_cost`: per token, and per attention pair). So the
  Q queued tokens, whose prompts hold P causal attention pairs (a prompt of L tokens L(L+1)/2;
  the rest of a prefill in progress, the pairs of its remaining tokens), cost
  Q / C * S + prefill_cost(Q, P), plus their share of the way in (`per_prompt_token_latency`);
  plus the step in flight (its decodes: F, 0 when idle), the fixed part of the step that ends
  with the new request's prompt (F, or a bare step's when nothing decodes: the steps a prompt
  spans are whole, and with x tokens up to its last, ceil(x / C) * F + x * marginal cost <=
  F + x * step / C), and the request's fixed way in (`request_latency_s`):

      token work = F + (F or bare step) + request_latency_s + Q / C * S + prefill_cost(Q, P)
                   + Q * per_prompt_token_latency_s

  `s_per_prompt_token`, what the frontend prices a new prompt and the tokens admitted since
  the snapshot with, is S / C + prefill_cost(1, P / Q) + per_prompt_token_latency_s (P / Q of
  the last queue that held any tokens).

  Measured (benchmarks/archive/BENCHMARKS.md, admission check): pricing steps without the
  serving terms and without the request's own step's fixed part, the estimate ran low under
  load, where the
  150 running decodes stream 44 ms of tokens each step on the demo model; pricing a step's
  C tokens as one C-token prompt's pairs (C(C+1)/2, the first version) ran 0.4 s high at a
  median for sharegpt-like prompts of a few hundred tokens.
- **slots**: when the waiting requests outnumber the free places (`max_num_seqs` minus
  running, or fewer when free KV blocks would not hold them), a request waits for that many
  running ones to finish, at the rate they have been finishing (over the last `window_s`).
  Unknown until a finish has been seen; until then this term is 0.

Both are priced by the cost model as measured on a machine at rest. Under a burst the CPU is
shared: on a CPU-only server the HTTP process parsing and tokenizing hundreds of prompts, and
the client beside it, take cores from the workers, and every step runs slower than its price
(the accepted requests of a 300-request burst waited 3.1 s for a 1 s limit,
benchmarks/archive/BENCHMARKS.md).
So the step prices are multiplied by `slowdown(now)`, two factors:

- **the intake now**: the serving cost model charges each arriving request's intake
  (`StepCostModel.arrival_charge`, measured by `tidal tune profile`) to the steps that run
  while it comes in; at a load of L seconds of intake per second (the charges of the requests
  that reached the core in the last `ARRIVAL_WINDOW_S`, `note_arrival`), the steps ahead take
  1 + L times their price for as long as the arrivals go on;
- **what that leaves unexplained**: the median, over the last `SLOWDOWN_WINDOW` steps, of
  each step's measured time at the workers over its price plus the intake charged to it
  (`note_step`, from the engine core's step loop): a neighbour on the machine, a cost model
  measured on a quieter day; 1 until `SLOWDOWN_MIN_STEPS` steps have run.

  Measured (benchmarks/archive/BENCHMARKS.md, "Admission, fifth round"): the median of
  measured over priced
  alone, the first version, followed the intake a few steps late: 1 for a burst's first 0.3 s,
  then 4.5x from its first three steps (a 38-token step at 8.4x its price) where the steps
  that followed ran at 1.8-2.4x, and about 2x after the arrivals had stopped, when the steps
  ran at 1.05-1.4x: estimates 0.3-1.3 s high through the middle of a 150 req/s burst, and
  29-50% of the refused requests would have made it. With the intake as a factor of its own,
  and each step's ratio taken with the requests read after it (`note_step`): 5% over six
  runs, the accepted p90 within 10% of the limit in five.

Not modelled: prefix-cache hits of queued prompts (counted in full: an overestimate), and the
output lengths of running requests (unknown to the engine; the measured finish rate stands in).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from .step_cost import StepCostModel
from ...ipc.worker_messages import BatchPlan

SLOWDOWN_WINDOW = 8
"""How many of the last steps `slowdown()` takes its median from."""
SLOWDOWN_MIN_STEPS = 3
"""Fewer measured steps than this leave the prices as the cost model has them."""
ARRIVAL_WINDOW_S = 0.5
"""The intake load is that of the requests that reached the engine core this many seconds
back (at 150 requests/s, 75 of them)..."""
ARRIVAL_MIN_SPAN_S = 0.1
"""...over the time since the oldest of them, but never less than this: 0.1 s into a burst
its rate is known from the arrivals so far (a full window would read it as a fifth of it for
those 0.1 s), and one lone arrival counts as at most 10 a second."""


@dataclass
class QueueEstimate:
    """The estimate's three parts (seconds)."""

    queue_delay_s: float = 0.0
    s_per_prompt_token: float = 0.0
    s_per_queued_request: float = 0.0


def causal_pairs(num_tokens: int) -> float:
    """Attention pairs (query, key) of the first `num_tokens` tokens of a sequence: token j
    sees j + 1 positions."""
    return num_tokens * (num_tokens + 1) / 2


class QueueDelayEstimator:
    """Lives in the engine core beside the scheduler; `estimate(scheduler, now)` per snapshot."""

    def __init__(self, cost_model: StepCostModel, window_s: float = 10.0) -> None:
        self.cost_model = cost_model
        self.window_s = window_s
        self._finishes: deque[tuple[float, int]] = deque()
        """(time, scheduler.num_finished) samples, one per estimate, the last window_s."""
        self._ratios: deque[float] = deque(maxlen=SLOWDOWN_WINDOW)
        """Measured over priced time (intake included) of the last steps."""
        self._arrivals: deque[tuple[float, float]] = deque()
        """(time, intake charge in seconds) of the requests that arrived in the last
        ARRIVAL_WINDOW_S."""
        self._intake_since_step = 0.0
        """Intake of the requests that arrived since the last step was timed: that step's
        share (see `note_step`)."""
        self._last_step: tuple[float, float] | None = None
        """(measured seconds, price) of the last step timed, its intake still to come."""
        self._pairs_per_token = 0.0
        """Attention pairs per queued prompt token, the last time any was queued: what a
        token admitted since the snapshot (or a new prompt) is priced with."""

    def note_arrival(self, prompt_len: int, now: float) -> None:
        """A request of `prompt_len` prompt tokens reached the engine core at `now`."""
        charge = self.cost_model.arrival_charge(prompt_len)
        self._arrivals.append((now, charge))
        self._intake_since_step += charge

    def note_step(self, plan: BatchPlan, seconds: float) -> None:
        """The workers took `seconds` for `plan` (the engine core's measure).

        The engine core reads its frontends between steps (and every 0.5 s of a longer one),
        so the requests it reads after a step came in while that step ran: a step's ratio is
        taken when the next one is timed, with the intake noted in between. Charged to the
        step timed after them instead, the first big step of a burst (priced 62 ms, measured
        205) carried the few arrivals of the 50 ms step before it and counted as 2.4x."""
        if self._last_step is not None:
            measured, price = self._last_step
            self._ratios.append(measured / (price + self._intake_since_step))
        self._intake_since_step = 0.0
        price = self.cost_model.step_time(plan)
        self._last_step = (seconds, price) if price > 0 and seconds > 0 else None

    def arrival_load(self, now: float) -> float:
        """Seconds of intake per second: the charges of the last ARRIVAL_WINDOW_S's
        arrivals over the time since the oldest of them (ARRIVAL_MIN_SPAN_S at least)."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now - ARRIVAL_WINDOW_S:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        span = max(now - arrivals[0][0], ARRIVAL_MIN_SPAN_S)
        return sum(charge for _, charge in arrivals) / span

    def step_ratio(self) -> float:
        """How much slower than priced (intake included) the last steps ran: their median
        ratio, 1.0 before SLOWDOWN_MIN_STEPS."""
        if len(self._ratios) < SLOWDOWN_MIN_STEPS:
            return 1.0
        return statistics.median(self._ratios)

    def slowdown(self, now: float) -> float:
        """How much slower than the cost model's prices the steps ahead run (see the module
        docstring): the intake now, times what the last steps leave unexplained."""
        return self.step_ratio() * (1.0 + self.arrival_load(now))

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
        num_decodes = context = queued = 0
        pairs = 0.0
        for request in scheduler.running:
            total = len(request.all_token_ids) + request.num_output_placeholders
            done = request.num_computed_tokens
            if total - done > 1:  # a prefill in progress: the rest of its prompt
                queued += total - done
                pairs += causal_pairs(total) - causal_pairs(done)
            else:
                num_decodes += 1
                context += done + 1
        waiting_tokens = 0
        for request in scheduler.waiting:
            waiting_tokens += len(request.all_token_ids)
            pairs += causal_pairs(len(request.all_token_ids))
        queued += waiting_tokens
        if queued:
            self._pairs_per_token = pairs / queued
        chunk = max(scheduler.max_num_batched_tokens - num_decodes, 1)
        slowdown = self.slowdown(now)
        # a full step: its decodes, fixed part and streamed tokens, beside `chunk` prompt
        # tokens priced one by one (their attention pairs at the queue's average)
        step_fixed = (cost.served_predict(chunk, num_decodes, context, 0.0, num_decodes + 1)
                      - cost.prefill_cost(chunk, 0.0))
        per_token = (slowdown * (step_fixed / chunk
                                 + cost.prefill_cost(1, self._pairs_per_token))
                     + cost.per_prompt_token_latency_s)
        in_flight = slowdown * cost.served_predict(0, num_decodes, context, 0.0, num_decodes)
        own_step = in_flight or slowdown * (cost.intercept_s + cost.per_step_overhead_s)
        token_work = (in_flight + own_step + cost.request_latency_s
                      + slowdown * (queued / chunk * step_fixed
                                    + cost.prefill_cost(queued, pairs))
                      + queued * cost.per_prompt_token_latency_s)

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
