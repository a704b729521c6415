"""Traces: the file round trip, keyed prefix hashes, and the bench workload they stand for."""

import json
import stat

import pytest

from tidal.engine_core.advice.trace import (
    Trace, TraceRecorder, TraceRequest, block_hashes, read_trace, start_recording, trace_header,
    write_trace,
)
from tidal.frontend.bench.datasets import DatasetConfig, build_dataset
from tidal.frontend.bench.serve import arrival_gaps
from tidal.frontend.tune.workload import trace_from_dataset


def test_write_then_read_gives_the_same_trace(tmp_path):
    requests = [TraceRequest(0.5, 40, 7, block_hashes(list(range(40))), priority=2),
                TraceRequest(0.25, 16, 1, ["00000000000000aa"], finish_reason="stop")]
    path = str(tmp_path / "t.jsonl")
    write_trace(path, Trace(requests, trace_header("test")))
    back = read_trace(path)
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.prefix_hashes, r.priority,
             r.finish_reason) for r in back.requests] == [
        (0.25, 16, 1, ["00000000000000aa"], 0, "stop"),
        (0.5, 40, 7, requests[0].prefix_hashes, 2, None)]  # sorted by arrival
    assert back.header["source"] == "test"


def test_recorder_writes_hashes_never_tokens_and_shifts_wall_clock(tmp_path):
    path = str(tmp_path / "rec.jsonl")
    key = start_recording(path)
    recorder = TraceRecorder(path, key)
    prompt = [5, 6, 7] * 11  # 33 tokens: 2 full blocks
    recorder.record(1000.0, prompt, 4, finish_reason="length")
    recorder.record(1002.5, prompt[:20], 9, priority=1)
    recorder.close()
    text = open(path).read()
    assert "5, 6, 7" not in text
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows[0]["format"] == "tidal-trace" and rows[0]["clock"] == "epoch"
    trace = read_trace(path)
    a, b = trace.requests
    assert (a.arrival_time, b.arrival_time) == (0.0, 2.5)
    assert len(a.prefix_hashes) == 2 and b.prefix_hashes == a.prefix_hashes[:1]
    assert a.prefix_hashes == block_hashes(prompt, key)
    assert block_hashes(prompt, b"another key") != a.prefix_hashes  # keyed per recording


def test_recorded_trace_is_readable_by_its_owner_alone(tmp_path):
    """--record-trace: the file describes users' prompts, so it is created 0600, and an
    existing world-readable file is made 0600 as it is truncated."""
    fresh, old = tmp_path / "fresh.jsonl", tmp_path / "old.jsonl"
    old.write_text("left from before\n")
    old.chmod(0o644)
    for path in (fresh, old):
        start_recording(str(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "left from before" not in old.read_text()


def test_chained_hashes_share_exactly_the_common_prefix():
    a, b = list(range(64)), list(range(40)) + [999] * 24
    ha, hb = block_hashes(a), block_hashes(b)
    assert ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]


def test_token_ids_rebuild_the_sharing():
    shared = block_hashes(list(range(48)))
    one, two = TraceRequest(0, 50, 1, shared), TraceRequest(0, 60, 1, shared[:2])
    ids1, ids2 = one.token_ids(0), two.token_ids(1)
    assert len(ids1) == 50 and len(ids2) == 60
    assert ids1[:32] == ids2[:32] and ids1[32:48] != ids2[32:48]
    assert all(0 <= t < 2**31 for t in ids1 + ids2)


def test_bad_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(trace_header("x")) + "\n" + '{"arrival_time": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_trace(str(path))
    path.write_text('{"arrival_time": 0, "prompt_len": 3, "output_len": 1}\n')
    with pytest.raises(ValueError, match="no header"):
        read_trace(str(path))


def test_dataset_trace_matches_what_bench_serve_sends():
    """Same lengths as the bench workload and the same arrival times as its Gamma gaps."""
    config = DatasetConfig(name="random", num_prompts=20, input_len=64, output_len=8,
                           range_ratio=0.5, prefix_len=32, seed=3)
    trace = trace_from_dataset(config, request_rate=4.0, burstiness=0.5, seed=3)
    bench = build_dataset(config)
    assert [r.prompt_len for r in trace.requests] == [r.prompt_len for r in bench]
    assert [r.output_len for r in trace.requests] == [r.output_len for r in bench]
    gaps = arrival_gaps(20, 4.0, 0.5, 3)
    assert [r.arrival_time for r in trace.requests] == pytest.approx(
        [sum(gaps[:i + 1]) for i in range(20)])
    assert all(r.prefix_hashes[:2] == trace.requests[0].prefix_hashes[:2]
               for r in trace.requests)  # the 32-token shared prefix: two blocks
