"""What the simulator predicts after a spell of preemptions: the engine core's traffic replayed
as configured and with each flag change its preemption warning suggests.

    python -m tidal.engine_core.advice.advise WINDOW_FILE

The engine core starts this process (`engine_core/advice/preemption_advice.py`) with a
`PreemptionWindow` (msgpack) in WINDOW_FILE: the requests it saw around the preemptions, its
config, its KV block count and the step cost model file. The answer, a `PreemptionPrediction`
(msgpack), goes to stdout; the core quotes its summary in the preemption warnings that follow.
Runs at a lower CPU priority (nice 10): it shares the machine with the engine.

The changes tried, each alone (the ones the warning names that a simulation of this machine
can answer; a larger tensor or pipeline parallel size would need another cost model):
- `--max-num-seqs` at 3/4, 1/2 and 1/4 of the most requests that ran at once (as
  configured, in the simulation);
- a KV cache 1.5 and 2 times as large (`--kv-cache-memory` on a CPU where a block's size is
  known, else `--num-gpu-blocks-override`);
- `--max-num-batched-tokens` halved (where the config still holds);
- `--kv-cache-dtype int8` where the cache is in the compute dtype: the same memory holds
  `int8_block_factor` times the blocks (3.76x float32's, 1.88x bf16's at head_dim 64),
  priced at the same step costs (the cost model was measured with the float cache).

Calibrated to the engine as it ran: the core sends each request's first-token and finish
times, and the steps are priced at the cost model times the factor that makes the simulated
median time per output token (as configured) equal the real one, found in up to
CALIBRATION_ROUNDS simulations after the first (within SCALE_LIMITS, "capped" when held
there). Measured on the demo model through `tidal serve` at 4 req/s, the real decode pace
was 1.5x the served cost model's (the HTTP server and the benchmark client shared the two
cores), and the uncalibrated simulation predicted none of the 5 preemptions seen; a slower
engine holds more requests at once, hence more KV.

The summary names the change that predicts no preemption with the most output throughput;
when none does, the one with the fewest; when the simulation as configured has no
preemption although the core saw some, it says it cannot tell.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from ..config import EngineConfig, decode_engine_config
from .step_cost import StepCostModel
from .simulator import simulate
from .trace import TRACE_BLOCK_TOKENS, Trace, TraceRequest, normalized
from .tuner import format_bytes
from ...ipc.advice import PreemptionPrediction, PreemptionWindow

NICE = 10
"""CPU priority increment of the advisor process."""
CALIBRATION_ROUNDS = 3
CALIBRATION_TOLERANCE = 0.05
"""Calibration stops once the simulated median time per output token is within 5% of the
real one."""
MIN_PACED = 3
"""Fewest finished requests with two or more output tokens to calibrate on."""
SCALE_LIMITS = (0.25, 4.0)
"""The step price factor stays within these (a wilder one means the window says little)."""
_MIB = 2**20


@dataclass(frozen=True)
class Change:
    """One flag change and the engine it makes."""

    flag: str
    """As the user would type it, e.g. `--max-num-seqs 48`."""
    config: EngineConfig
    num_kv_blocks: int


def window_trace(window: PreemptionWindow, cost: StepCostModel) -> tuple[Trace, list[int]]:
    """The window's requests as a trace, the first arriving at 0, and the window index of
    each trace request. The core saw each request when it reached the scheduler; the
    simulator adds the way there (`request_latency`, the serving terms) to a trace's
    arrivals, so it is taken off here. A request that finished without a token (aborted
    while it waited) is left out; one still unfinished without a token counts as one."""
    arrivals = [r.arrival_time - cost.request_latency(r.prompt_len) for r in window.requests]
    kept = [i for i, r in enumerate(window.requests) if r.output_len or not r.finish_time]
    order = sorted(kept, key=arrivals.__getitem__)
    requests = []
    for i in order:
        r = window.requests[i]
        hashes = trace_hashes([r.prefix_hashes[k:k + 8].hex()
                               for k in range(0, len(r.prefix_hashes), 8)],
                              window.block_tokens)
        requests.append(TraceRequest(arrivals[i], r.prompt_len, max(1, r.output_len), hashes,
                                     r.priority))
    trace = normalized(requests, {"source": "engine core preemption window", "clock": "epoch"})
    return trace, order


def trace_hashes(hashes: list[str], block_tokens: int) -> list[str]:
    """Chained hashes per `block_tokens`-token block as a trace's, per 16-token block
    (TRACE_BLOCK_TOKENS; block sizes are powers of two). Smaller blocks: every k-th hash, which
    chains all before it. Larger: each block's hash stands for its k sub-blocks, each
    derived from it (two prompts that share half a large block share none of it here)."""
    if block_tokens == TRACE_BLOCK_TOKENS:
        return list(hashes)
    if block_tokens < TRACE_BLOCK_TOKENS:
        k = TRACE_BLOCK_TOKENS // block_tokens
        return list(hashes[k - 1::k])
    k = block_tokens // TRACE_BLOCK_TOKENS
    return [f"{(int(h, 16) * 0x9E3779B97F4A7C15 + j) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
            for h in hashes for j in range(k)]


def real_time_per_token(window: PreemptionWindow) -> np.ndarray:
    """Seconds per output token after the first, per window request, as the engine ran it
    (NaN where it did not finish, or made one token)."""
    out = np.full(len(window.requests), np.nan)
    for i, r in enumerate(window.requests):
        if r.finish_time > 0 and r.first_token_time > 0 and r.output_len > 1:
            out[i] = (r.finish_time - r.first_token_time) / (r.output_len - 1)
    return out


@dataclass
class Calibration:
    """How the steps were priced, and the as-configured run at that price."""

    factor: float
    """Step price / the cost model's."""
    base: dict
    """The as-configured simulation's summary at that price."""
    pace_s: float
    """The real median seconds per output token (NaN: too few finished requests to say)."""
    runs: int
    """Simulations it took."""
    capped: bool = False
    """The factor hit SCALE_LIMITS before the paces matched."""

    def describe(self) -> str:
        if math.isnan(self.pace_s):
            return ""
        capped = ", capped" if self.capped else ""
        return (f"steps at {self.factor:.2f}x the step cost model{capped}, from the pace the "
                f"engine ran at ({self.pace_s * 1e3:.1f} ms per output token)")


def calibrate(config: EngineConfig, window: PreemptionWindow, cost: StepCostModel,
              trace: Trace, order: list[int]) -> Calibration:
    """Simulate as configured, then again with the step price scaled by real / simulated
    median seconds per output token until they agree (see the module docstring)."""
    real = real_time_per_token(window)[order]
    paced = ~np.isnan(real)
    target = float(np.median(real[paced])) if paced.sum() >= MIN_PACED else math.nan
    result = simulate(config, window.num_kv_blocks, window.max_model_len, cost, trace)
    done = Calibration(1.0, result.summary(), target, 1)
    for _ in range(CALIBRATION_ROUNDS if target > 0 else 0):  # NaN > 0 is False
        sim = (result.finish - result.first_token) / np.maximum(result.output_len - 1, 1)
        simulated = float(np.nanmedian(sim[paced]))
        if not simulated > 0 or abs(target / simulated - 1) <= CALIBRATION_TOLERANCE:
            break
        factor = min(max(done.factor * target / simulated, SCALE_LIMITS[0]), SCALE_LIMITS[1])
        if factor == done.factor:  # held at a limit
            done.capped = True
            break
        result = simulate(config, window.num_kv_blocks, window.max_model_len,
                          cost.with_steps_scaled(factor), trace)
        done = Calibration(factor, result.summary(), target, done.runs + 1,
                           factor in SCALE_LIMITS)
    return done


def changes(config: EngineConfig, num_kv_blocks: int, peak_running: int,
            cost: StepCostModel) -> list[Change]:
    """The flag changes to simulate (see the module docstring), in that order."""
    sched = config.scheduler
    out = []
    running = min(sched.max_num_seqs, max(1, peak_running))
    for fraction in (0.75, 0.5, 0.25):
        seqs = max(1, int(running * fraction))
        if seqs < sched.max_num_seqs and all(c.flag != f"--max-num-seqs {seqs}" for c in out):
            out.append(_change(config, num_kv_blocks, f"--max-num-seqs {seqs}",
                               max_num_seqs=seqs))
    for factor in (1.5, 2.0):
        blocks = int(num_kv_blocks * factor)
        out.append(Change(_kv_flag(config, cost, num_kv_blocks, blocks), config, blocks))
    tokens = sched.max_num_batched_tokens // 2
    try:
        out.append(_change(config, num_kv_blocks, f"--max-num-batched-tokens {tokens}",
                           max_num_batched_tokens=tokens))
    except ValueError:  # below max_num_seqs, or below the context without chunked prefill
        pass
    factor = int8_block_factor(config, cost)
    if factor is not None:
        int8 = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                     kv_cache_dtype="int8"))
        out.append(Change(INT8_FLAG, int8, int(num_kv_blocks * factor)))
    return out


INT8_FLAG = "--kv-cache-dtype int8"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT8_ROW_HEAD_DIM = 64
"""The head size `int8_block_factor` assumes (the cost model does not record it): the
smallest common one, where the float32 scale per row costs most (64 + 4 bytes); 128 would
give 3.88x float32's blocks instead of 3.76x."""


def int8_block_factor(config: EngineConfig, cost: StepCostModel) -> float | None:
    """How many times the blocks the same memory holds with `--kv-cache-dtype int8`
    (kernels/attention/kv_quant.py: head_dim int8 bytes and a float32 scale per token and KV
    head, against head_dim elements of the compute dtype the cost model was measured in);
    None where the cache is already quantized, the block count is forced, or that dtype is
    unknown."""
    elem = DTYPE_BYTES.get(cost.info.get("dtype", ""))
    if (config.cache.kv_cache_dtype != "auto" or elem is None
            or config.cache.num_kv_blocks_override is not None):
        return None
    return elem * INT8_ROW_HEAD_DIM / (INT8_ROW_HEAD_DIM + 4)


def _change(config: EngineConfig, num_kv_blocks: int, flag: str, **scheduler) -> Change:
    new = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                    **scheduler))
    return Change(flag, new, num_kv_blocks)


def _kv_flag(config: EngineConfig, cost: StepCostModel, num_kv_blocks: int,
             blocks: int) -> str:
    """The flag that gives about `blocks` KV blocks: on CPU, bytes rounded up to a MiB where
    the size of a block is known; else (a GPU, a block count set, no size known) the block
    count, which overrides the others."""
    device = config.parallel.device
    if device == "auto":  # what the workers found: the device the cost model measured
        device = cost.info.get("device", "cpu")
    if config.cache.num_kv_blocks_override is not None or device != "cpu":
        return f"--num-gpu-blocks-override {blocks}"
    if config.cache.kv_cache_memory is not None:
        size = config.cache.kv_cache_memory * blocks / num_kv_blocks
    elif (block_bytes := cost.kv_block_bytes(config.cache.block_size)) is not None:
        size = blocks * block_bytes
    else:
        return f"--num-gpu-blocks-override {blocks}"
    return f"--kv-cache-memory {format_bytes(math.ceil(size / _MIB) * _MIB)}"


def advise(window: PreemptionWindow) -> PreemptionPrediction:
    """Simulate the window as configured and with each change; the summary and the table."""
    config = decode_engine_config(window.engine_config)
    cost = StepCostModel.load(window.step_cost_model)
    trace, order = window_trace(window, cost)
    start = time.monotonic()
    calibration = calibrate(config, window, cost, trace, order)
    cost = cost.with_steps_scaled(calibration.factor)
    seen = sum(r.num_preemptions for r in window.requests)
    rows = [("as configured", calibration.base)]
    for change in changes(config, window.num_kv_blocks, calibration.base["max_num_running"],
                          cost):
        result = simulate(change.config, change.num_kv_blocks, window.max_model_len, cost,
                          trace)
        rows.append((change.flag, result.summary()))
    runs = calibration.runs + len(rows) - 1
    elapsed = time.monotonic() - start
    pricing = calibration.describe()
    return PreemptionPrediction(summary(rows, seen, trace, pricing),
                                report(rows, seen, trace, window, runs, elapsed, pricing))


def _load(trace: Trace) -> str:
    n = len(trace.requests)
    if n < 2 or trace.duration < 1:
        return f"{n} requests" + (", all within a second" if n > 1 else "")
    return f"{n} requests over {trace.duration:.0f} s ({trace.mean_rate():.2g} req/s)"


def summary(rows: list[tuple[str, dict]], seen: int, trace: Trace, pricing: str) -> str:
    """One sentence: the best change and what it predicts, against as configured."""
    _, base = rows[0]
    load = _load(trace) + (f" ({pricing})" if pricing else "")
    tried = rows[1:]
    if seen and not base["num_preemptions"]:
        return (f"the simulator does not reproduce them: replaying the last {load}, "
                f"it predicts no preemption as configured ({seen} seen), so it cannot tell "
                f"which change avoids them")
    free = [row for row in tried if row[1]["num_preemptions"] == 0]
    also = ""
    if free:
        flag, best = max(free, key=lambda row: row[1]["output_throughput"])
        verdict = f"with {flag}: no preemptions at that load"
        if flag != INT8_FLAG and any(row[0] == INT8_FLAG for row in free):
            also = (f"; so does {INT8_FLAG}, in the memory it has now (not token-exact: "
                    f"docs/kv-cache-dtype.md)")
    elif tried:
        flag, best = min(tried, key=lambda row: row[1]["num_preemptions"])
        verdict = (f"no single change tried avoids them; the fewest, "
                   f"{best['num_preemptions']}, with {flag}")
    else:
        return (f"the simulator predicts {base['num_preemptions']} preemptions for the last "
                f"{load} ({seen} seen)")
    return (f"the simulator, replaying the last {load}, predicts {verdict} "
            f"(TTFT p99 {_seconds(best['p99_ttft_ms'])}, {best['output_throughput']:.0f} "
            f"output tok/s; as configured {base['num_preemptions']} preemptions, "
            f"{seen} seen, TTFT p99 {_seconds(base['p99_ttft_ms'])}, "
            f"{base['output_throughput']:.0f} output tok/s){also}")


def report(rows: list[tuple[str, dict]], seen: int, trace: Trace, window: PreemptionWindow,
           runs: int, elapsed: float, pricing: str) -> str:
    """The table: one line per setting simulated."""
    unfinished = (f"; {window.num_unfinished} still running, their outputs cut where they "
                  f"were" if window.num_unfinished else "")
    lines = [f"simulated the last {_load(trace)} ({seen} preemptions seen{unfinished}) "
             f"in {len(rows)} settings ({runs} simulations, {elapsed:.1f} s)"
             + (f", {pricing}" if pricing else "")
             + ":",
             f"  {'setting':<34} {'preemptions':>11} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'ITL p50':>8} {'out tok/s':>9}"]
    for flag, s in rows:
        lines.append(f"  {flag:<34} {s['num_preemptions']:>11} "
                     f"{_seconds(s['median_ttft_ms']):>9} {_seconds(s['p99_ttft_ms']):>9} "
                     f"{_seconds(s['median_itl_ms']):>8} {s['output_throughput']:>9.0f}")
    return "\n".join(lines)


def _seconds(ms: float) -> str:
    if ms != ms:  # NaN: no request got there
        return "-"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1e3:.2f} s"


def main(argv: list[str] | None = None) -> int:
    """Read the window file, write the prediction to stdout; 2 on a bad window."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tidal.engine_core.advice.advise WINDOW_FILE", file=sys.stderr)
        return 2
    try:
        os.nice(NICE)
    except OSError:
        pass
    try:
        with open(args[0], "rb") as f:
            data = f.read()
        os.unlink(args[0])  # read: the engine core need not outlive this to clean up
        prediction = advise(msgspec.msgpack.decode(data, type=PreemptionWindow))
    except Exception as e:  # noqa: BLE001 - one line to the core's log, never a traceback
        print(f"preemption advisor: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(msgspec.msgpack.encode(prediction))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
