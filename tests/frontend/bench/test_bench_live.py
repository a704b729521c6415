"""Each `tidal bench` subcommand, briefly, against the real engine on the tiny model.

Offline subcommands go through `LLM` (a private engine-core daemon and worker); the serve
subcommands run against a live `tidal serve` subprocess.
"""

import argparse
import json

import pytest

from tidal.frontend.bench import add_bench_args, run_bench

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
