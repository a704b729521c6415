"""`tidal tune`: pick serving settings by simulation; the command around the advisory wing
(`tidal.engine_core.advice`: the step cost model and its profile, traces, the simulator, the
tuner).

- `cli`: `tidal tune [profile | simulate]`, the command line;
- `serving_profile`: the serving terms of the step cost model, measured through a real
  `tidal serve` with the same engine flags;
- `workload`: a `tidal bench` dataset as a request trace (what `tidal bench serve` would send);
- `plot`: the search's picture.
"""
