"""The serve-benchmark client against a minimal in-test OpenAI-compatible server.

These check the client layer alone (streaming parse, timing, 503 counting, /metrics deltas,
JSON, plot); `test_bench_live.py` runs the same commands against a live `tidal serve`.
"""

import argparse
import asyncio
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_openai_server import FakeOpenAIServer  # noqa: E402

from tidal.frontend.bench import add_bench_args, run_bench  # noqa: E402
from tidal.frontend.bench.datasets import DatasetConfig, build_dataset  # noqa: E402
from tidal.frontend.bench.serve import ServeConfig, arrival_gaps, run_serve_benchmark  # noqa


def _bench(argv):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


def _workload(n=8, output_len=6):
    return build_dataset(DatasetConfig(num_prompts=n, input_len=5, output_len=output_len,
                                       range_ratio=0.5, seed=1))


def test_tokens_counted_equal_tokens_requested_and_metrics_deltas():
    requests = _workload()
    with FakeOpenAIServer() as server:
        config = ServeConfig(base_url=server.url, ignore_eos=True, disable_tqdm=True,
                             metrics_interval_s=0.01)
        run = asyncio.run(run_serve_benchmark(requests, config))
        bodies = server.state.bodies
    s = run["summary"]
    assert s["completed"] == 8 and s["failed"] == 0 and s["model"] == "fake"
    assert s["total_output_tokens"] == sum(r.output_len for r in requests)
    assert s["total_output_tokens"] == s["total_expected_output_tokens"]
    assert s["total_input_tokens"] == 5 * 8  # the server's usage wins over the estimate
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(r.output_len for r in requests)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert s["num_preemptions"] == 4
    assert s["mean_ttft_ms"] > 0 and s["p50_itl_ms"] <= s["p99_itl_ms"]
    assert len(s["timeline"]) >= 1 and "num_requests_running" in s["timeline"][0]
    for r in run["results"]:
        assert len(r.itl) == r.output_len - 1 and r.ttft <= r.latency


def test_failed_requests_counted_when_server_answers_503():
    requests = _workload(n=6, output_len=20)
    with FakeOpenAIServer(max_in_flight=1, token_delay_s=0.01) as server:
        config = ServeConfig(base_url=server.url, ignore_eos=True, disable_tqdm=True)
        s = asyncio.run(run_serve_benchmark(requests, config))["summary"]
    assert s["failed"] >= 1 and s["completed"] >= 1
    assert s["completed"] + s["failed"] == 6
    assert s["failed_by_status"] == {"503": s["failed"]}


def test_max_concurrency_caps_in_flight_requests():
    requests = _workload(n=6, output_len=10)
    with FakeOpenAIServer(max_in_flight=2, token_delay_s=0.005) as server:
        config = ServeConfig(base_url=server.url, max_concurrency=2, disable_tqdm=True)
        s = asyncio.run(run_serve_benchmark(requests, config))["summary"]
    assert s["failed"] == 0 and s["peak_concurrency"] <= 2


def test_arrival_gaps_mean_and_burstiness():
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    poisson = np.array(arrival_gaps(4000, 4.0, 1.0, 0))
    bursty = np.array(arrival_gaps(4000, 4.0, 0.25, 0))
    regular = np.array(arrival_gaps(4000, 4.0, 8.0, 0))
    for gaps in (poisson, bursty, regular):
        assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert bursty.std() > poisson.std() > regular.std()
    assert arrival_gaps(5, 2.0, 1.0, 7) == arrival_gaps(5, 2.0, 1.0, 7)


def test_cli_serve_writes_json_and_plot(tmp_path, capsys):
    result_file, plot_file = tmp_path / "r.json", tmp_path / "p.png"
    with FakeOpenAIServer() as server:
        status = _bench(["serve", "--base-url", server.url, "--num-prompts", "10",
                         "--random-input-len", "4", "--random-output-len", "5",
                         "--ignore-eos", "--request-rate", "50", "--goodput", "ttft:1000",
                         "--result-file", str(result_file), "--plot", str(plot_file),
                         "--save-detailed", "--disable-tqdm", "--metrics-interval", "0.02"])
    assert status == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput" in out
    document = json.loads(result_file.read_text())
    s = document["summary"]
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "p99_tpot_ms", "median_itl_ms",
                "p90_e2el_ms", "request_goodput", "prefix_cache_hit_rate", "num_preemptions"):
        assert key in s
    assert s["total_output_tokens"] == 50 and s["request_rate"] == 50.0
    assert len(document["requests"]) == 10 and "tpot" in document["requests"][0]
    assert plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot_file.stat().st_size > 20000


def test_cli_sweep_prints_a_row_per_rate(tmp_path, capsys):
    result_file, plot_file = tmp_path / "s.json", tmp_path / "s.png"
    with FakeOpenAIServer() as server:
        status = _bench(["sweep", "--base-url", server.url, "--num-prompts", "4",
                         "--random-input-len", "4", "--random-output-len", "3",
                         "--request-rates", "20,inf", "--ignore-eos", "--disable-tqdm",
                         "--result-file", str(result_file), "--plot", str(plot_file)])
    assert status == 0
    table = capsys.readouterr().out
    assert "out tok/s" in table and "inf" in table
    runs = json.loads(result_file.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    assert all(r["total_output_tokens"] == 12 for r in runs)
    assert plot_file.stat().st_size > 10000


def test_cli_bad_flags_exit_2(capsys):
    assert _bench(["serve", "--base-url", "http://127.0.0.1:9", "--goodput", "foo:1"]) == 2
    assert "goodput" in capsys.readouterr().err


def test_unreachable_server_times_out_cleanly():
    config = ServeConfig(base_url="http://127.0.0.1:9", ready_timeout_s=0.5, disable_tqdm=True)
    with pytest.raises(TimeoutError, match="not ready"):
        asyncio.run(run_serve_benchmark(_workload(1), config))


def test_sweep_figure_gives_each_latency_its_own_axis():
    """TPOT (tens of ms) and E2EL (thousands) on separate y axes, so neither lies flat."""
    from tidal.frontend.bench.plot import sweep_figure

    rows = [{"request_rate": rate, "output_throughput": 100.0 * i, "mean_ttft_ms": 50.0 * i,
             "p99_ttft_ms": 90.0 * i, "mean_tpot_ms": 20.0 + i, "p99_tpot_ms": 30.0 + i,
             "mean_e2el_ms": 2000.0 * i, "p99_e2el_ms": 3000.0 * i}
            for i, rate in enumerate((1.0, 4.0, "inf"), start=1)]
    fig = sweep_figure(rows)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["TTFT against throughput", "TPOT against throughput",
                      "E2EL against throughput"]
    tpot, e2el = fig.axes[1], fig.axes[2]
    assert [line.get_label() for line in tpot.get_lines()] == ["mean_tpot_ms", "p99_tpot_ms"]
    assert tpot.get_ylim()[1] < 50 and e2el.get_ylim()[1] > 9000
    import matplotlib.pyplot as plt

    plt.close(fig)
