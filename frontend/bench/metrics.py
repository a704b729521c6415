"""Per-request measurements and the summary statistics every `tidal bench` report prints.

Definitions (vLLM's `bench serve`, all client side, seconds internally, ms in reports):

- TTFT: from sending the request to the first streamed chunk with content.
- ITL: the gaps between successive content chunks of one request (with a stream interval
  above 1 a gap covers several tokens, as in vLLM).
- TPOT: per request, (e2e latency - TTFT) / (output tokens - 1); undefined for 1 token.
- E2EL: from sending to the last byte of the response.
- Goodput: requests per second that met every SLO given (`ttft:MS tpot:MS e2el:MS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ...engine_core.advice.latency import DEFAULT_PERCENTILES, latency_stats, pct_label

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one benchmark request measured."""

    success: bool
    """The server answered 200 and streamed to the end without an error."""
    prompt_len: int
    """Prompt tokens (the server's `usage` when it reports it, else the dataset's count)."""
    expected_output_len: int
    """Tokens asked for (`max_tokens`)."""
    output_len: int = 0
    """Tokens generated (the server's `usage`, else the number of content chunks)."""
    ttft: float = 0.0
    """Seconds to the first content chunk."""
    latency: float = 0.0
    """Seconds from send to the end of the response."""
    itl: list[float] = field(default_factory=list)
    """Seconds between successive content chunks."""
    start_time: float = 0.0
    """When it was sent, seconds since the benchmark started."""
    status_code: int | None = None
    """HTTP status (None when the connection failed)."""
    error: str = ""
    """Why it failed."""

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first, or None with fewer than 2 tokens."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds).

    ValueError naming `goodput` on an unknown metric, a missing colon or a value <= 0.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {name} needs a number of milliseconds, got {value!r}") \
                from None
        if slos[name] <= 0:
            raise ValueError(f"goodput: {name} must be > 0 ms, got {value}")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0); ValueError naming `metric_percentiles` if out of range."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"metric_percentiles: not a comma-separated list: {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"metric_percentiles: each must be in (0, 100], got {text!r}")
    return values


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms) in `slos`."""
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return result.success and all(measured[k] * 1000.0 <= v for k, v in slos.items())


def summarize(results: list[RequestResult], duration: float, *,
              slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    """The report: counts, throughputs and latency statistics over `results`.

    Throughputs divide by `duration` (wall seconds of the measured phase). Token totals count
    successful requests only; failures are counted, and grouped by HTTP status.
    """
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(failed),
        "failed_by_status": _count_statuses(failed),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_expected_output_tokens": sum(r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "percentiles": list(percentiles),
    }
    if slos:
        summary["goodput_slos_ms"] = dict(slos)
        summary["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration
    summary.update(latency_stats([r.ttft for r in ok], "ttft", percentiles))
    summary.update(latency_stats([r.tpot for r in ok if r.tpot is not None], "tpot", percentiles))
    summary.update(latency_stats([g for r in ok for g in r.itl], "itl", percentiles))
    summary.update(latency_stats([r.latency for r in ok], "e2el", percentiles))
    return summary


def _count_statuses(failed: list[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in failed:
        key = str(r.status_code) if r.status_code is not None else "connection"
        counts[key] = counts.get(key, 0) + 1
    return counts


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (from their start times and latencies)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def results_to_json(results: list[RequestResult]) -> list[dict]:
    """Per-request rows for `--save-detailed` (tpot included)."""
    return [dict(asdict(r), tpot=r.tpot) for r in results]


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def format_report(summary: dict, title: str = "Serving Benchmark Result") -> str:
    """The human-readable block printed at the end of a run (vLLM's layout)."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    for status, num in sorted(summary.get("failed_by_status", {}).items()):
        row(f"  failed with {status}:", num)
    for key, label in (("max_concurrency", "Maximum request concurrency:"),
                       ("request_rate", "Request rate configured (RPS):")):
        if key in summary:
            row(label, summary[key] if summary[key] is not None else "none")
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if summary.get("peak_concurrency") is not None:
        row("Peak concurrent requests:", summary["peak_concurrency"])
    if summary.get("prefix_cache_hit_rate") is not None:
        row("Server prefix cache hit rate (%):", 100.0 * summary["prefix_cache_hit_rate"])
    if summary.get("num_preemptions") is not None:
        row("Server preemptions:", summary["num_preemptions"])
    for name in LATENCY_METRICS:
        lines.append(f"{' ' + _TITLES[name] + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"])
        for p in summary["percentiles"]:
            if p == 50:
                continue  # the median, printed above
            row(f"P{pct_label(p)} {name.upper()} (ms):", summary[f"p{pct_label(p)}_{name}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
