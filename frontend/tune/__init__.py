"""`tidal tune`: pick serving settings by simulation.

- `profile`: measure one worker step over a grid of shapes and fit the step cost model
  (`tidal.engine_core.step_cost`).
- `trace`: request traces (arrival time, prompt and output length, salted prefix block hashes;
  never text), from `tidal bench` datasets or recorded by `tidal serve --record-trace`.
- `simulator`: the engine core's own `Scheduler` and block pool driven by a trace on simulated
  time, step durations from the cost model.
- `tuner`: a grid search over scheduler and KV-cache settings against latency SLOs.
- `advise`: the engine core's child process after a spell of preemptions: that traffic
  replayed as configured and with each change the preemption warning suggests.
"""
