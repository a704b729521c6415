"""The preemption advisor (engine_core/advice/advise.py): the engine core's window replayed as
configured and with each change the warning suggests; worked out by hand (block size 16,
every step 10 ms, as in test_simulator's preemption case)."""

import subprocess
import sys

import msgspec

from tidal.engine_core.config import encode_engine_config
from tidal.engine_core.advice.advise import advise, changes, trace_hashes
from tidal.engine_core.advice.step_cost import StepCostModel
from tidal.ipc.advice import PreemptionPrediction, PreemptionWindow, WindowRequest

from test_simulator import config


def _window(tmp_path, **overrides) -> PreemptionWindow:
    """A and B arrive together: 16-token prompts, 30 outputs each, two running at most, 5 KV
    blocks (4 usable: one short of the 3 + 3 they need), no prefix caching. As configured, B
    is preempted once (test_simulator.test_preemption_recomputes_the_victim); the core saw it
    preempted once too."""
    cost = tmp_path / "cost.json"
    StepCostModel(0.010).save(str(cost))
    engine = config(max_num_seqs=2, max_num_batched_tokens=64, caching=False)
    requests = [WindowRequest(100.0, 16, 30, b""), WindowRequest(100.0, 16, 30, b"", 0, 1)]
    fields = dict(engine_config=encode_engine_config(engine), num_kv_blocks=5,
                  max_model_len=64, step_cost_model=str(cost), requests=requests)
    return PreemptionWindow(**{**fields, **overrides})


def test_engine_block_hashes_become_16_token_block_hashes():
    """Block size 8: every second hash (it chains the block before). 16: as they are. 32:
    two derived hashes per block, equal where the blocks were."""
    h = [f"{i:016x}" for i in range(1, 5)]
    assert trace_hashes(h, 8) == [h[1], h[3]]
    assert trace_hashes(h, 16) == h
    big = trace_hashes(h[:2], 32)
    assert len(big) == 4 and len(set(big)) == 4 and all(len(x) == 16 for x in big)
    assert trace_hashes(h[:1], 32) == big[:2]


def test_changes_are_the_warnings_flags_at_the_sizes_said():
    """2 ran at most: --max-num-seqs 1 (3/4, 1/2 and 1/4 of 2 all round to 1, tried once);
    1.5x and 2x the blocks, as a block count when no KV size in bytes is known; the token
    budget halved."""
    flags = [c.flag for c in changes(config(max_num_seqs=2, max_num_batched_tokens=64), 5,
                                     2, StepCostModel(0.01))]
    assert flags == ["--max-num-seqs 1", "--num-gpu-blocks-override 7",
                     "--num-gpu-blocks-override 10", "--max-num-batched-tokens 32"]


def test_kv_flag_is_in_bytes_when_the_cost_model_knows_a_blocks_size():
    cost = StepCostModel(0.01, info={"kv_block_bytes": 2**20, "block_size": 16})
    flags = [c.flag for c in changes(config(max_num_seqs=2), 100, 2, cost)]
    assert "--kv-cache-memory 150MiB" in flags and "--kv-cache-memory 200MiB" in flags


def test_prediction_names_the_best_change_that_removes_the_preemption(tmp_path):
    """As configured: 1 preemption, A done at 0.30 s and B at 0.43 s. --max-num-seqs 1: B
    waits for A and ends at 0.60 (60 tokens / 0.6 s = 100 tok/s). 7 or 10 blocks: both fit,
    both end at 0.30 (200 tok/s). Halving the budget to 32 still admits both: 1 preemption.
    The best change without preemptions by throughput is the first at 200 tok/s: 7 blocks."""
    prediction = advise(_window(tmp_path))
    assert prediction.summary.startswith(
        "the simulator, replaying the last 2 requests, all within a second, predicts with "
        "--num-gpu-blocks-override 7: no preemptions at that load (TTFT p99 10 ms, 200 "
        "output tok/s; as configured 1 preemptions, 1 seen, TTFT p99 10 ms, 140 output tok/s)")
    rows = prediction.report.splitlines()
    assert rows[0].startswith("simulated the last 2 requests, all within a second (1 preemptions seen) in 5 settings (5 simulations, ")
    table = {line[2:36].strip(): line[36:].split() for line in rows[2:]}
    assert table["as configured"][0] == "1"
    assert table["--max-num-seqs 1"][0] == "0"
    assert table["--max-num-seqs 1"][-1] == "100"
    assert table["--num-gpu-blocks-override 10"][0] == "0"
    assert table["--max-num-batched-tokens 32"][0] == "1"


def test_int8_kv_cache_is_tried_in_the_same_memory_and_named_when_it_ends_them(tmp_path):
    """A cost model measured in float32: --kv-cache-dtype int8 holds 4 x 64 / 68 = 3.76x the
    blocks (5 -> 18) in the same memory; both requests fit, so the summary names it beside
    the best change. bf16: 2 x 64 / 68 = 1.88x (5 -> 9)."""
    cost = StepCostModel(0.010, info={"dtype": "float32"})
    tried = {c.flag: c for c in changes(config(max_num_seqs=2), 5, 2, cost)}
    assert tried["--kv-cache-dtype int8"].num_kv_blocks == 18
    assert tried["--kv-cache-dtype int8"].config.cache.kv_cache_dtype == "int8"
    bf16 = StepCostModel(0.010, info={"dtype": "bfloat16"})
    assert {c.flag: c for c in changes(config(max_num_seqs=2), 5, 2, bf16)}[
        "--kv-cache-dtype int8"].num_kv_blocks == 9
    path = tmp_path / "float32-cost.json"
    cost.save(str(path))
    prediction = advise(_window(tmp_path, step_cost_model=str(path)))
    assert prediction.summary.endswith(
        "output tok/s); so does --kv-cache-dtype int8, in the memory it has now (not "
        "token-exact: docs/kv-cache-dtype.md)")
    assert "--kv-cache-dtype int8" in prediction.report


def test_says_so_when_the_simulation_has_none_of_the_preemptions_seen(tmp_path):
    """With 10 blocks both requests fit: the simulator cannot reproduce the one preemption the
    core saw, and says it cannot tell which change would avoid it."""
    prediction = advise(_window(tmp_path, num_kv_blocks=10))
    assert prediction.summary == (
        "the simulator does not reproduce them: replaying the last 2 requests, all within a "
        "second, it predicts no preemption as configured (1 seen), so it cannot tell which "
        "change avoids them")


def test_steps_are_priced_at_the_pace_the_engine_really_ran(tmp_path):
    """Three requests in 10 blocks, no preemption: each decodes one token per 10 ms step in
    the simulation, where the engine took 20 ms per token (first token at 100.1, the 30th
    at 100.68). The step price doubles: the report says 2.00x and 20 ms per token."""
    requests = [WindowRequest(100.0, 16, 30, b"", 0, 0, 100.1, 100.68) for _ in range(3)]
    prediction = advise(_window(tmp_path, num_kv_blocks=10, requests=requests))
    assert ", steps at 2.00x the step cost model, from the pace the engine ran at (20.0 ms " \
        "per output token):" in prediction.report
    itl = {line[2:36].strip(): line[36:].split()[5] for line in
           prediction.report.splitlines()[2:]}
    assert itl["as configured"] == "20"


def test_runs_as_the_engine_cores_child_process(tmp_path):
    """The engine core's way in: a window file, the prediction as msgpack on stdout."""
    path = tmp_path / "window.msgpack"
    path.write_bytes(msgspec.msgpack.encode(_window(tmp_path, num_unfinished=1)))
    done = subprocess.run([sys.executable, "-m", "tidal.engine_core.advice.advise", str(path)],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    prediction = msgspec.msgpack.decode(done.stdout, type=PreemptionPrediction)
    assert "no preemptions at that load" in prediction.summary
    assert "1 still running, their outputs cut where they were" in prediction.report


def test_a_bad_window_file_exits_2_with_a_message(tmp_path):
    path = tmp_path / "window.msgpack"
    path.write_bytes(b"not msgpack")
    done = subprocess.run([sys.executable, "-m", "tidal.engine_core.advice.advise", str(path)],
                          capture_output=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode().startswith("preemption advisor:")
    assert done.stdout == b""
