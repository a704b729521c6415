"""`tidal bench`: serving, sweep, offline throughput/latency and engine-overhead benchmarks.

The CLI dispatcher calls `add_bench_args(parser)` to add the subcommands and
`run_bench(ns) -> int` to run the chosen one.
"""

from .cli import add_bench_args, run_bench

__all__ = ["add_bench_args", "run_bench"]
