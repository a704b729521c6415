"""The figure of a `tidal tune` run (matplotlib, Agg backend: no display needed).

Top: p99 TTFT and p99 ITL against the request rate for the best settings (every rate the
search simulated; an x where the setting misses the SLO or falls behind), with the SLO limits
and the requested rate; when none meets the SLO there, the closest settings' curves run below
the requested rate, down to the rate each sustains, and the panels say so. Bottom: the best setting at its
highest sustainable rate over time: running and waiting requests, KV-cache usage.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ...engine_core.advice.simulator import SimResult  # noqa: E402
from ...engine_core.advice.tuner import SLO, Evaluation  # noqa: E402


def _label(e: Evaluation) -> str:
    s = e.setting
    return (f"seqs {s.max_num_seqs}, tokens {s.max_num_batched_tokens}, KV {s.kv_label()}"
            f"{'' if s.enable_chunked_prefill else ', no chunking'}"
            f"{', priority' if s.scheduling_policy == 'priority' else ''}")


def plot_tune(evaluations: list[Evaluation], base_rate: float, slo: SLO, path: str,
              best_run: SimResult | None = None, best_rate: float | None = None, top: int = 5,
              title: str = "") -> None:
    """Write the figure to `path` (PNG); `best_run` is the best setting simulated at
    `best_rate` (its highest sustainable rate)."""
    fig = plt.figure(figsize=(13, 9))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2, 1])
    meeting = [e for e in evaluations if e.meets]
    shown = meeting[:top] or evaluations[:top]
    rates = [p["rate"] for e in shown for p in e.curve] + [base_rate]
    for col, (key, limit, name) in enumerate((("p99_ttft_ms", slo.ttft_p99_s, "p99 TTFT"),
                                              ("p99_itl_ms", slo.itl_p99_s, "p99 ITL"))):
        ax = fig.add_subplot(grid[0, col])
        for e in shown:
            line, = ax.plot([p["rate"] for p in e.curve], [p[key] for p in e.curve],
                            marker="o", markersize=3, label=_label(e))
            misses = [p for p in e.curve if not p["meets"]]
            ax.scatter([p["rate"] for p in misses], [p[key] for p in misses], marker="x",
                       s=40, color=line.get_color())
        if limit is not None:
            ax.axhline(limit * 1e3, color="tab:red", linestyle="--", label="SLO")
        ax.axvline(base_rate, color="gray", linestyle=":", label=f"requested {base_rate:g} req/s")
        ax.set_yscale("log")
        if max(rates) / min(rates) > 8:
            ax.set_xscale("log")
        if not meeting:
            ax.text(0.02, 0.98, f"no setting meets the SLO at {base_rate:g} req/s;\n"
                    "curves: the closest settings at lower rates", transform=ax.transAxes,
                    va="top", fontsize=8, color="tab:red",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} against request rate (simulated; x: misses the SLO or falls "
                     "behind)", fontsize=9)
        ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[1, :])
    if best_run is not None and best_run.timeline.get("time"):
        t = best_run.timeline["time"]
        ax.step(t, best_run.timeline["num_running"], where="post", color="tab:green",
                label="running")
        ax.step(t, best_run.timeline["num_waiting"], where="post", color="tab:orange",
                label="waiting")
        ax.set_ylabel("requests")
        kv = ax.twinx()
        kv.plot(t, [100 * u for u in best_run.timeline["kv_cache_usage"]], color="tab:purple",
                label="KV cache usage %")
        kv.set_ylim(0, 105)
        kv.set_ylabel("KV cache usage (%)")
        handles, labels = ax.get_legend_handles_labels()
        h2, l2 = kv.get_legend_handles_labels()
        ax.legend(handles + h2, labels + l2, fontsize=8, loc="upper left")
        rate = best_rate or base_rate
        ax.set_title(f"best setting at {rate:.3g} req/s over time (simulated): "
                     f"{_label(shown[0])}", fontsize=10)
    ax.set_xlabel("seconds since start")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
