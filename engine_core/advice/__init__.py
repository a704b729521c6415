"""The advisory wing: what prices steps and replays the scheduler, none of it in the step loop.

- `step_cost`: a step's time from its shape (the step cost model), fitted by `profile`
  (which times a real worker in the child process `python -m tidal.workers.step_profile`);
- `queue_estimate`: a new request's wait for its first token (`--max-queue-delay`);
- `preemption_advice`: after a spell of preemptions, the simulator run on that traffic in the
  child process `python -m tidal.engine_core.advice.advise`;
- `trace`, `simulator`, `tuner`, `latency`: request traces, the engine core's own scheduler on
  simulated time, the search over settings against latency SLOs, and the report's statistics,
  for `tidal tune` (frontend/tune/) and the advisor.

It may import the engine core's config, scheduler and requests (docs/architecture.md §3.1,
§8), never torch; importing this package imports nothing.
"""
