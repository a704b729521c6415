"""Metric math: TPOT, percentiles, goodput, throughputs, server-metric parsing."""

import math

import pytest

from tidal.frontend.bench.metrics import (
    RequestResult, format_report, meets_slos, parse_goodput, parse_percentiles,
    peak_concurrency, summarize,
)
from tidal.frontend.bench.server_metrics import counter_deltas, parse_prometheus


def _ok(ttft, latency, output_len, start=0.0, prompt_len=10):
    gaps = [(latency - ttft) / max(1, output_len - 1)] * (output_len - 1)
    return RequestResult(True, prompt_len, output_len, output_len, ttft, latency, gaps, start,
                         200)


def test_tpot_excludes_first_token_and_is_none_for_one_token():
    assert _ok(0.1, 1.1, 11).tpot == pytest.approx(0.1)
    assert _ok(0.1, 0.1, 1).tpot is None


def test_summary_counts_throughputs_and_ordered_percentiles():
    results = [_ok(0.01 * i, 0.5 + 0.05 * i, 8, start=0.1 * i) for i in range(1, 41)]
    results.append(RequestResult(False, 10, 8, status_code=503, error="busy"))
    results.append(RequestResult(False, 10, 8, status_code=None, error="refused"))
    s = summarize(results, duration=4.0, percentiles=(50, 90, 99))
    assert s["completed"] == 40 and s["failed"] == 2
    assert s["failed_by_status"] == {"503": 1, "connection": 1}
    assert s["total_output_tokens"] == 320 and s["total_input_tokens"] == 400
    assert s["request_throughput"] == pytest.approx(10.0)
    assert s["output_throughput"] == pytest.approx(80.0)
    assert s["total_token_throughput"] == pytest.approx(180.0)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"p50_{m}_ms"] <= s[f"p90_{m}_ms"] <= s[f"p99_{m}_ms"]
        assert s[f"median_{m}_ms"] == pytest.approx(s[f"p50_{m}_ms"])
    assert s["mean_ttft_ms"] == pytest.approx(205.0)  # mean of 10..400 ms
    assert s["p99_e2el_ms"] <= max(r.latency for r in results[:40]) * 1000 + 1e-9


def test_goodput_counts_requests_meeting_every_slo():
    fast = _ok(0.05, 0.5, 10)     # ttft 50 ms, tpot 50 ms
    slow_ttft = _ok(0.5, 1.0, 10)  # ttft 500 ms
    slow_tpot = _ok(0.05, 2.0, 10)  # tpot ~217 ms
    slos = parse_goodput(["ttft:100", "tpot:60"])
    assert slos == {"ttft": 100.0, "tpot": 60.0}
    assert [meets_slos(r, slos) for r in (fast, slow_ttft, slow_tpot)] == [True, False, False]
    s = summarize([fast, slow_ttft, slow_tpot], duration=2.0, slos=slos)
    assert s["request_goodput"] == pytest.approx(0.5)
    assert summarize([fast], 1.0, slos={"e2el": 400})["request_goodput"] == 0.0


@pytest.mark.parametrize("bad", [["ttft"], ["foo:1"], ["ttft:x"], ["tpot:0"]])
def test_bad_goodput_names_the_flag(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(bad)


def test_percentile_parsing():
    assert parse_percentiles("50, 99.9") == (50.0, 99.9)
    with pytest.raises(ValueError, match="metric_percentiles"):
        parse_percentiles("0,50")


def test_peak_concurrency_from_intervals():
    results = [_ok(0.1, 1.0, 2, start=0.0), _ok(0.1, 1.0, 2, start=0.5),
               _ok(0.1, 1.0, 2, start=1.0), _ok(0.1, 0.2, 2, start=3.0)]
    assert peak_concurrency(results) == 2  # the first ends exactly when the third starts


def test_empty_summary_and_report_render():
    s = summarize([RequestResult(False, 5, 5, status_code=503)], duration=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0
    text = format_report(s)
    assert "Failed requests:" in text and "failed with 503:" in text and "P99 TTFT" in text


def test_prometheus_parsing_sums_labels_and_strips_names():
    text = "\n".join([
        "# HELP tidal:num_requests_running running",
        'tidal:num_requests_running{model_name="m",engine="0"} 3.0',
        'tidal:num_preemptions_total{model_name="m"} 2.0',
        'tidal:num_preemptions_created{model_name="m"} 1.7e9',
        'tidal:prefix_cache_hits_total{model_name="m"} 30',
        'tidal:prefix_cache_queries_total{model_name="m"} 120',
        'tidal:time_to_first_token_seconds_bucket{le="0.1"} 4',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1"} 0.5',
        "process_cpu_seconds_total 12.0",
    ])
    values = parse_prometheus(text)  # tidal's names where there are, not both
    assert values == {"num_requests_running": 3.0, "num_preemptions": 2.0,
                      "prefix_cache_hits": 30.0, "prefix_cache_queries": 120.0}
    vllm_only = "\n".join(line for line in text.splitlines() if "tidal:" not in line)
    assert parse_prometheus(vllm_only) == {"kv_cache_usage_perc": 0.75}


def test_counter_deltas_over_the_run():
    before = {"prefix_cache_hits": 10, "prefix_cache_queries": 100, "num_preemptions": 1}
    after = {"prefix_cache_hits": 70, "prefix_cache_queries": 200, "num_preemptions": 4}
    d = counter_deltas(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.6) and d["num_preemptions"] == 3
    none = counter_deltas({}, {"num_requests_running": 1})
    assert none["prefix_cache_hit_rate"] is None and none["num_preemptions"] is None
    idle = counter_deltas(before, before)
    assert idle["prefix_cache_hit_rate"] == 0.0 and not math.isnan(idle["prefix_cache_hit_rate"])
