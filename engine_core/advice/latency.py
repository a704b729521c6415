"""Latency statistics under the keys every report of tidal's uses: `tidal bench serve`
measures them (frontend/bench/metrics.py) and the simulator predicts them (simulator.py), so a
prediction and a measurement compare key by key."""

from __future__ import annotations

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def latency_stats(values_s: list[float], name: str,
                  percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` in ms, keyed `mean_{name}_ms` etc. (0 when empty)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
    }
    for p in percentiles:
        stats[f"p{pct_label(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return stats


def pct_label(p: float) -> str:
    """50.0 -> "50", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)
