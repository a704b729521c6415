"""`tidal tune` end to end on the bundled demo model's config (no model is loaded: the step
cost model is fabricated)."""

import json
import os

import pytest

from tidal.engine_core.advice.step_cost import StepCostModel
from tidal.frontend.cli import main as tidal_main


@pytest.fixture
def cost_file(tmp_path):
    path = str(tmp_path / "cost.json")
    StepCostModel(0.005, 2e-5, 5e-4, 1e-7, info={"kv_block_bytes": 65536, "block_size": 16,
                                                  "num_kv_blocks": 4096}).save(path)
    return path


WORKLOAD = ["--dataset", "random", "--num-prompts", "40", "--input-len", "128",
            "--output-len", "16"]


def test_simulate_prints_the_bench_report(cost_file, tmp_path, capsys):
    result = str(tmp_path / "sim.json")
    rc = tidal_main(["tune", "simulate", "--step-cost-model", cost_file, "--kv-cache-memory",
                     "64MiB", *WORKLOAD, "--request-rate", "5", "--result-file", result])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Simulated Serving Result" in out and "P99 TTFT (ms):" in out
    assert "1024 KV blocks" in out  # 64 MiB / 64 KiB per block
    summary = json.load(open(result))["summary"]
    assert summary["completed"] == 40 and summary["total_output_tokens"] == 40 * 16


def search(cost_file: str, tmp_path, rate: str, capsys) -> tuple[int, str, str, str]:
    """`tidal tune` over two settings at `rate` req/s with a plot and a result file: (exit
    status, stdout, plot path, result path)."""
    plot, result = str(tmp_path / "tune.png"), str(tmp_path / "tune.json")
    rc = tidal_main(["tune", "--step-cost-model", cost_file, *WORKLOAD, "--request-rate", rate,
                     "--slo-ttft-p99", "1s", "--slo-itl-p99", "200ms",
                     "--max-num-seqs-grid", "8,32", "--max-num-batched-tokens-grid", "256",
                     "--kv-cache-memory-grid", "64MiB", "--chunked-prefill-grid", "on",
                     "--plot", plot, "--result-file", result])
    return rc, capsys.readouterr().out, plot, result


def test_search_prints_the_table_and_draws_the_plot(cost_file, tmp_path, capsys):
    rc, out, plot, result = search(cost_file, tmp_path, "5", capsys)
    assert rc == 0, out
    assert "settings meet TTFT p99 <= 1s and ITL p99 <= 200ms at 5 req/s" in out
    assert "Best: tidal serve MODEL --max-num-seqs" in out
    assert os.path.getsize(plot) > 10_000
    settings = json.load(open(result))["settings"]
    assert len(settings) == 2 and all(s["max_rate"] >= 5 for s in settings if s["meets"])


def test_when_no_setting_meets_the_slo_the_report_and_plot_show_the_rates_below(
        cost_file, tmp_path, capsys):
    """Asked for 500 req/s of 128-token prompts (a step takes at least 5 ms): nothing keeps
    up; the report names the rates the closest settings sustain and the plot draws them."""
    rc, out, plot, result = search(cost_file, tmp_path, "500", capsys)
    assert rc == 0, out
    assert "0 of 2 settings meet" in out and "searched below 500 req/s" in out
    assert os.path.getsize(plot) > 10_000
    settings = json.load(open(result))["settings"]
    assert all(0 < s["max_rate"] < 500 and len(s["curve"]) > 3 for s in settings)


def test_a_missing_profile_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    rc = tidal_main(["tune", "simulate", *WORKLOAD])
    assert rc == 2
    assert "run `tidal tune profile`" in capsys.readouterr().err


def test_a_recorded_trace_is_rescaled_to_the_requested_rate(cost_file, tmp_path, capsys):
    from tidal.engine_core.advice.trace import Trace, TraceRequest, trace_header, write_trace

    path = str(tmp_path / "t.jsonl")
    write_trace(path, Trace([TraceRequest(10.0 + i, 64, 8) for i in range(11)],
                            trace_header("test", clock="epoch")))
    rc = tidal_main(["tune", "simulate", "--step-cost-model", cost_file,
                     "--num-gpu-blocks-override", "512", "--trace", path, "--request-rate", "2",
                     "--result-file", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    summary = json.load(open(tmp_path / "r.json"))["summary"]
    assert summary["completed"] == 11
    assert 5.0 <= summary["duration_s"] < 6.0  # 10 gaps of 0.5 s, then the last request


@pytest.mark.timeout(300)
def test_profile_measures_the_worker_then_a_served_engine(tiny_llama, tmp_path, capsys):
    """`tidal tune profile` on a tiny model: step shapes timed on the worker and fitted, then a
    real `tidal serve` with the same flags probed (6 requests one at a time with a short
    prompt and 6 with a long one, then 1 and 8 streams at once: no more than
    --max-num-seqs; then 8 streams alone, and twice while 10 requests arrive); the file holds
    both."""
    out = str(tmp_path / "cost.json")
    rc = tidal_main(["tune", "profile", tiny_llama, "--duration", "1", "--output", out,
                     "--kv-cache-memory", "32MiB", "--max-num-seqs", "16"])
    assert rc == 0
    model = StepCostModel.load(out)
    assert model.info["num_shapes"] >= 12
    # a fit on a busy machine may put the whole fixed cost into the per-request term
    # (intercept 0.0 once, in a fresh clone under load): what must hold is a priced step
    assert model.intercept_s >= 0 and model.predict(0, 1, 16, 0) > 0
    serving = model.info["serving"]
    assert len(serving["latency_probes"]) == 12
    assert [row["batch"] for row in serving["decode_probes"]] == [1, 8]
    assert all(row["median_itl_s"] > 0 for row in serving["decode_probes"])
    assert [r["arrivals"] for r in serving["arrival_probes"]] == [0, 10, 10]
    assert all(len(r["arrival_prompt_tokens"]) == len(r.get("excess_s", ())) == r["arrivals"]
               for r in serving["arrival_probes"][1:])
    assert model.per_arrival_s >= 0.0
    printed = capsys.readouterr().out
    assert "served (through tidal serve)" in printed and out in printed


def test_a_profile_is_always_cached_where_tune_looks_and_says_when_the_machine_was_busy(
        tmp_path, monkeypatch, capsys):
    """`tidal tune profile --output F` then `tidal tune` chain (the profile is cached where
    tune looks as well as written to F), and the profile records the load it was taken
    under, saying so when the machine was busy (issue 38 §6). The measurement itself is
    faked: test_profile_measures_the_worker_then_a_served_engine runs it for real."""
    import tidal.engine_core.advice.profile as profile_module

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_module, "profile_steps", lambda *a, **k: StepCostModel(
        0.005, 2e-5, 5e-4, 1e-7, info={"kv_block_bytes": 65536, "block_size": 16,
                                       "num_kv_blocks": 4096, "num_shapes": 1,
                                       "device": "cpu", "dtype": "float32", "threads": 2,
                                       "attention_backend": "cpu"}))
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 3.0, 2.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    output = str(tmp_path / "served.json")
    assert tidal_main(["tune", "profile", "--no-serving", "--output", output]) == 0
    out = capsys.readouterr().out
    assert "step cost model written to " + output + " and to " in out
    assert "the machine was busy when this profile started (load average 3.5 on 2 cores)" in out
    assert json.load(open(output))["info"]["load_average_before"] == 3.5
    assert tidal_main(["tune", "simulate", *WORKLOAD, "--request-rate", "5"]) == 0  # found
    assert "Simulated Serving Result" in capsys.readouterr().out
