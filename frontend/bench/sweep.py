"""`tidal bench sweep`: the same workload at several request rates, one after the other.

Prints a throughput-latency table (one row per rate) and, with `--plot`, draws the curve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

from .datasets import BenchRequest
from .serve import ServeConfig, run_serve_benchmark

SWEEP_COLUMNS = (
    ("request_rate", "rate", "{}"),
    ("completed", "ok", "{}"),
    ("failed", "failed", "{}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("mean_ttft_ms", "TTFT mean", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99", "{:.1f}"),
    ("mean_tpot_ms", "TPOT mean", "{:.1f}"),
    ("p99_e2el_ms", "E2EL p99", "{:.1f}"),
)


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; ValueError naming `request_rates` if bad."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"request_rates: not a comma-separated list of numbers: {text!r}") \
            from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request_rates: each rate must be > 0 (or inf), got {text!r}")
    return rates


def run_sweep(requests: list[BenchRequest], config: ServeConfig, rates: list[float]) -> list[dict]:
    """One serve benchmark per rate (warm-ups only before the first); their summaries."""
    rows = []
    for i, rate in enumerate(rates):
        run_config = dataclasses.replace(config, request_rate=rate,
                                         num_warmups=config.num_warmups if i == 0 else 0)
        summary = asyncio.run(run_serve_benchmark(requests, run_config))["summary"]
        summary.pop("timeline", None)
        rows.append(summary)
    return rows


def format_sweep_table(rows: list[dict]) -> str:
    """A fixed-width table: one line per rate, the columns of `SWEEP_COLUMNS`."""
    header = "".join(f"{title:>12}" for _, title, _ in SWEEP_COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for key, _, fmt in SWEEP_COLUMNS:
            value = row.get(key)
            if isinstance(value, float) and math.isinf(value):
                value = "inf"
            cells.append(f"{fmt.format(value) if value is not None else '-':>12}")
        lines.append("".join(cells))
    return "\n".join(lines)
