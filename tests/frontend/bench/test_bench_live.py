"""Each `tidal bench` subcommand, briefly, against the real engine on the tiny model.

Offline subcommands go through `LLM` (a private engine-core daemon and worker); the serve
subcommands run against a live `tidal serve` subprocess.
"""

import argparse
import json

import pytest

from tidal.frontend.bench import add_bench_args, run_bench
from tidal.frontend.bench.datasets import DatasetConfig, build_dataset, load_tokenizer

SMALL_KV = ["--kv-cache-memory", "16MiB"]


def _bench(argv):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


def test_throughput_counts_requested_tokens_and_compares(tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "t.json"
    status = _bench(["throughput", tiny_llama, *SMALL_KV, "--dataset-name", "random",
                     "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "5",
                     "--random-range-ratio", "0.5", "--hf-backends", "static",
                     "--hf-max-batch-size", "3", "--disable-tqdm",
                     "--result-file", str(result_file)])
    assert status == 0
    out = capsys.readouterr().out
    assert "tidal / transformers-static:" in out and "output tokens/s" in out
    document = json.loads(result_file.read_text())
    tidal, static = document["results"]
    assert tidal["backend"] == "tidal" and static["backend"] == "transformers-static"
    assert tidal["total_output_tokens"] == static["total_output_tokens"]
    assert tidal["total_prompt_tokens"] == static["total_prompt_tokens"]
    for r in (tidal, static):
        assert r["num_requests"] == 6 and r["output_tokens_per_s"] > 0
        assert r["total_tokens_per_s"] > r["output_tokens_per_s"]
    assert document["ratios"]["transformers-static"] == pytest.approx(
        tidal["output_tokens_per_s"] / static["output_tokens_per_s"])


def test_latency_percentiles_ordered(tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "l.json"
    status = _bench(["latency", tiny_llama, *SMALL_KV, "--input-len", "6", "--output-len", "4",
                     "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                     "--result-file", str(result_file)])
    assert status == 0
    assert "Avg latency:" in capsys.readouterr().out
    document = json.loads(result_file.read_text())
    assert len(document["latencies_s"]) == 3
    values = list(document["percentiles_s"].values())
    assert values == sorted(values) and values[0] > 0


def test_overhead_async_and_sync(tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "o.json"
    status = _bench(["overhead", tiny_llama, *SMALL_KV, "--batch-size", "2",
                     "--output-len", "12", "--num-iters", "1",
                     "--random-weights-dir", str(tmp_path / "models"),
                     "--result-file", str(result_file)])
    assert status == 0
    assert "steps/s" in capsys.readouterr().out
    document = json.loads(result_file.read_text())
    assert "h64-l1" in document["model"]
    for key in ("async", "sync"):
        # one batch of 2: a prefill step yields the first token, then 11 decode steps
        assert document[key]["num_steps"] >= 12 and document[key]["steps_per_s"] > 0


# ---- against a live `tidal serve` ---------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    """`tidal serve` on the tiny model: one running request, one queued, 503 beyond."""
    import subprocess
    import sys
    import time

    import httpx

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.frontend.cli", "serve", tiny_llama, "--port", str(port),
         *SMALL_KV, "--max-num-seqs", "1", "--max-num-queued-reqs", "1",
         "--disable-uvicorn-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    if proc.poll() is not None or time.monotonic() >= deadline:
        proc.kill()
        pytest.fail("tidal serve did not come up")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _serve_args(url, tokenizer, *extra):
    return ["--base-url", url, "--tokenizer", tokenizer, "--disable-tqdm", "--ignore-eos",
            "--random-input-len", "8", *extra]


def test_live_serve_tokens_json_and_plot(tiny_server, tiny_llama, tmp_path, capsys):
    result_file, plot_file = tmp_path / "serve.json", tmp_path / "serve.png"
    status = _bench(["serve", *_serve_args(tiny_server, tiny_llama),
                     "--num-prompts", "6", "--random-output-len", "7", "--random-range-ratio",
                     "0.5", "--max-concurrency", "1", "--num-warmups", "1",
                     "--goodput", "ttft:10000", "e2el:60000", "--metrics-interval", "0.05",
                     "--result-file", str(result_file), "--plot", str(plot_file)])
    assert status == 0, capsys.readouterr().err
    s = json.loads(result_file.read_text())["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == s["total_expected_output_tokens"]  # ignore_eos
    # the server's prompt token counts equal the workload's: prompts are token-exact
    workload = build_dataset(DatasetConfig(num_prompts=6, input_len=8, output_len=7,
                                           range_ratio=0.5), load_tokenizer(tiny_llama))
    assert s["dataset"]["token_exact_prompts"] is True
    assert s["total_input_tokens"] == sum(r.prompt_len for r in workload)
    assert s["total_output_tokens"] == sum(r.output_len for r in workload)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < s[f"p50_{m}_ms"] <= s[f"p90_{m}_ms"] <= s[f"p99_{m}_ms"]
    assert s["num_preemptions"] == 0 and s["prefix_cache_hit_rate"] is not None
    assert s["peak_concurrency"] == 1 and s["timeline"]
    assert plot_file.read_bytes()[:4] == b"\x89PNG"


def test_live_serve_counts_503_under_a_burst(tiny_server, tiny_llama, tmp_path):
    result_file = tmp_path / "burst.json"
    status = _bench(["serve", *_serve_args(tiny_server, tiny_llama), "--num-prompts", "8",
                     "--random-output-len", "16", "--result-file", str(result_file)])
    s = json.loads(result_file.read_text())["summary"]
    assert status == 1  # some requests failed
    assert s["completed"] >= 1 and s["failed"] >= 1 and s["completed"] + s["failed"] == 8
    assert s["failed_by_status"] == {"503": s["failed"]}
    assert s["total_output_tokens"] == 16 * s["completed"]


def test_live_shared_prefix_hits_the_prefix_cache(tiny_server, tiny_llama, tmp_path):
    result_file = tmp_path / "prefix.json"
    status = _bench(["serve", *_serve_args(tiny_server, tiny_llama), "--num-prompts", "5",
                     "--dataset-name", "shared-prefix", "--random-prefix-len", "32",
                     "--random-output-len", "3", "--max-concurrency", "1",
                     "--result-file", str(result_file)])
    assert status == 0
    s = json.loads(result_file.read_text())["summary"]
    # 4 of 5 requests find the 32-token prefix (two 16-token blocks) cached: 128 of 200 tokens
    assert s["prefix_cache_hit_rate"] == pytest.approx(128 / 200)


def test_live_sweep_rows(tiny_server, tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "sweep.json"
    status = _bench(["sweep", *_serve_args(tiny_server, tiny_llama), "--num-prompts", "3",
                     "--random-output-len", "4", "--max-concurrency", "1",
                     "--request-rates", "50,inf", "--result-file", str(result_file),
                     "--plot", str(tmp_path / "sweep.png")])
    assert status == 0
    runs = json.loads(result_file.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    assert all(r["completed"] == 3 and r["total_output_tokens"] == 12 for r in runs)
    assert "out tok/s" in capsys.readouterr().out
