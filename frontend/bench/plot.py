"""PNG figures of benchmark runs (matplotlib, Agg backend: no display needed).

`plot_serve`: four latency histograms (TTFT, TPOT, ITL, E2EL) above a timeline of the run:
the server's running and waiting requests and the client's in-flight count (left axis) and the
server's KV-cache usage in percent (right axis), as sampled from `/metrics`.
`plot_sweep`: the throughput-latency curves of a `tidal bench sweep` (TTFT, TPOT, E2EL, each on
its own axis).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import RequestResult  # noqa: E402

_HISTOGRAMS = (
    ("ttft", "Time to first token (ms)"),
    ("tpot", "Time per output token (ms)"),
    ("itl", "Inter-token latency (ms)"),
    ("e2el", "End-to-end latency (ms)"),
)


def _latencies_ms(results: list[RequestResult], name: str) -> list[float]:
    ok = [r for r in results if r.success]
    if name == "ttft":
        values = [r.ttft for r in ok]
    elif name == "tpot":
        values = [r.tpot for r in ok if r.tpot is not None]
    elif name == "itl":
        values = [g for r in ok for g in r.itl]
    else:
        values = [r.latency for r in ok]
    return [v * 1000.0 for v in values]


def _draw_histogram(ax, values: list[float], title: str, summary: dict, name: str) -> None:
    ax.set_title(title, fontsize=10)
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    # Clip the x range at twice the p99 so a few outliers do not squash the histogram.
    p99 = summary.get(f"p99_{name}_ms") or max(values)
    high = min(max(values), 2.0 * p99) if p99 > 0 else max(values)
    num_beyond = sum(v > high for v in values)
    ax.hist(values, bins=min(40, max(5, len(values) // 3)), range=(0.0, max(high, 1e-6)),
            color="tab:blue", alpha=0.8)
    if num_beyond:
        ax.text(0.98, 0.5, f"{num_beyond} beyond {high:.0f} ms", ha="right",
                transform=ax.transAxes, fontsize=8)
    for key, style in (("median", "-"), ("p99", "--")):
        value = summary.get(f"{key}_{name}_ms")
        if value is not None:
            ax.axvline(value, color="tab:red", linestyle=style, label=f"{key} {value:.1f}")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)


def _draw_timeline(ax, timeline: list[dict]) -> None:
    ax.set_title("Timeline (sampled from the server's /metrics)", fontsize=10)
    ax.set_xlabel("seconds since start")
    if not timeline:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    t = [s["t"] for s in timeline]
    for key, label, color in (("num_requests_running", "server running", "tab:green"),
                              ("num_requests_waiting", "server waiting", "tab:orange"),
                              ("client_in_flight", "client in flight", "tab:gray")):
        if any(key in s for s in timeline):
            ax.step(t, [s.get(key, 0) for s in timeline], where="post", label=label, color=color)
    ax.set_ylabel("requests")
    handles, labels = ax.get_legend_handles_labels()
    if any("kv_cache_usage_perc" in s for s in timeline):
        kv_ax = ax.twinx()
        kv_ax.plot(t, [100.0 * s.get("kv_cache_usage_perc", 0.0) for s in timeline],
                   color="tab:purple", label="KV cache usage %")
        kv_ax.set_ylabel("KV cache usage (%)")
        kv_ax.set_ylim(0, 105)
        kv_handles, kv_labels = kv_ax.get_legend_handles_labels()
        handles, labels = handles + kv_handles, labels + kv_labels
    ax.legend(handles, labels, fontsize=8, loc="upper left", framealpha=0.6)


def plot_serve(summary: dict, results: list[RequestResult], path: str) -> None:
    """Write the serve-run figure to `path` (PNG)."""
    fig = plt.figure(figsize=(12, 10))
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 1.2])
    for i, (name, title) in enumerate(_HISTOGRAMS):
        _draw_histogram(fig.add_subplot(grid[i // 2, i % 2]),
                        _latencies_ms(results, name), title, summary, name)
    _draw_timeline(fig.add_subplot(grid[2, :]), summary.get("timeline", []))
    fig.suptitle(_serve_title(summary), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _serve_title(summary: dict) -> str:
    return (f"{summary.get('model', '')}  rate={summary.get('request_rate')}  "
            f"ok={summary['completed']} failed={summary['failed']}  "
            f"{summary['output_throughput']:.1f} output tok/s")


_SWEEP_PANELS = (
    ("TTFT", ("mean_ttft_ms", "p99_ttft_ms")),
    ("TPOT", ("mean_tpot_ms", "p99_tpot_ms")),
    ("E2EL", ("mean_e2el_ms", "p99_e2el_ms")),
)
"""One panel (its own linear y axis) per latency: TPOT is tens of ms where E2EL is thousands,
so on one axis TPOT's curve lay flat along the bottom."""


def sweep_figure(rows: list[dict]):
    """The throughput-latency figure of a sweep (one point per request rate): TTFT, TPOT and
    E2EL side by side against output tokens/s, each on its own y axis."""
    fig, axes = plt.subplots(1, len(_SWEEP_PANELS), figsize=(15, 5))
    x = [r["output_throughput"] for r in rows]
    for ax, (title, keys) in zip(axes, _SWEEP_PANELS):
        keys = [k for k in keys if any(k in r for r in rows)] or keys[:1]
        for key in keys:
            ax.plot(x, [r.get(key, 0.0) for r in rows], marker="o", label=key)
        for r, xi in zip(rows, x):
            ax.annotate(f"{r['request_rate']} rps", (xi, r.get(keys[0], 0.0)), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title} against throughput")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_sweep(rows: list[dict], path: str) -> None:
    """Write `sweep_figure(rows)` to `path` (PNG)."""
    fig = sweep_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)
