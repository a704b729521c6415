"""The serving terms of the cost model: what a real `tidal serve` adds to the workers' steps.

`tidal tune profile` times the worker's `execute` alone. A served request also pays the HTTP
server (parse, tokenize, detokenize, one SSE event per token), the engine core (schedule,
update, messages; with async scheduling off, as on the CPU, in series with the steps) and the
client. Where those share the workers' cores (any CPU-only server) they lengthen every step
by an amount that grows with the tokens streamed. Measured here, through a real server started
with the same engine flags and driven by `tidal bench serve`'s own client code, on prompts of
text (so tokenizing is paid as in a benchmark):

- `request_latency_s` + `per_prompt_token_latency_s` x prompt tokens: sequential requests
  for 2 tokens, with short and with long prompts; the median time to the first token less
  the cost model's prefill step for the prompt, at each length, gives the line. The
  simulator delays each request's arrival at the scheduler by it (it covers the way out
  and the first token's way back: tokenizing grows with the prompt).
- `per_step_overhead_s` + `per_streamed_token_s` x tokens sampled: B streams decoding at
  once, for B in `BATCHES`; the median over the streams of each one's mean gap between
  tokens, less the cost model's decode step for B requests at their context, is fitted as
  `a + b * B` (least squares, both >= 0).

- `per_arrival_s`: `ARRIVAL_STREAMS` streams decoding `ARRIVAL_OUTPUT_LEN` tokens while
  `NUM_ARRIVALS` one-token requests come in, spaced several steps apart (`ARRIVAL_ROUNDS`
  rounds, after one quiet round that times them). Each arrival lengthens the
  `ARRIVAL_WINDOW` gaps between tokens from the one it was sent in (`arrival_excess`: their
  sum less as many typical gaps, the median of the gaps outside every window) by its
  prefill (the cost model's), the token it samples (`per_streamed_token_s`) and what its
  handling takes from the steps running meanwhile: that last part is the term, the median
  over arrivals and streams less the first two and less its tokenizing (its prompt tokens
  at the latency line's slope, which the model charges an arriving request's prompt too:
  `per_arrival_prompt_token_s`). A median of single arrivals, not the
  difference of two rounds' total decode time: that difference drowned in how the machine's
  speed drifts between rounds (7.4 and 0.0 ms in two profiles ten minutes apart). This is
  the term that moves the p99s: on a CPU server a step that takes in a request is slow.

The client's own work counts in (as it does in every `tidal bench serve` on the same machine).
What is not captured: how a request's handling grows with its prompt beyond the latency line
(the arrival probes send short prompts), and the overlap async scheduling gives (measured as
the server runs: async off on the CPU, on for CUDA workers, unless the flags say otherwise).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ...engine_core.args import config_to_argv
from ...engine_core.config import EngineConfig, resolve_max_model_len
from ...engine_core.advice.step_cost import StepCostModel, chunk_features
from ...ipc.lifeline import lifeline_fd
from ...ipc.transport import free_tcp_port

BATCHES = (1, 8, 32, 64)
"""Concurrent streams per decode probe (those above --max-num-seqs are skipped)."""
NUM_LATENCY_PROBES = 6
"""Sequential requests per prompt length."""
PROMPT_WORDS = (24, 480)
"""Words of the probes' prompts (a number, then " hello" repeated: one to a few tokens each,
by tokenizer); decode probes take the first."""
OUTPUT_LEN = 40
"""Tokens each decode probe's streams generate; the first and last 8 gaps are not used."""
_EDGE = 8
ARRIVAL_STREAMS = 8
"""Streams decoding while the arrival probe's requests come in (at most --max-num-seqs - 1)."""
ARRIVAL_OUTPUT_LEN = 128
"""Tokens each of those streams generates."""
NUM_ARRIVALS = 10
"""One-token requests sent during the decoding, per round (about 8 steps apart)."""
ARRIVAL_ROUNDS = 2
"""Rounds with arrivals."""
ARRIVAL_WINDOW = 3
"""Gaps an arrival can lengthen: the one it was sent in (its HTTP handling), and the next two
(handling that spills over, and the step that prefills it)."""
_PROBE_NUMBERS = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class ServingTerms:
    """What `measure_serving_terms` found (the `StepCostModel` fields of the same names), and
    the probes it fitted them to (`info`, kept in the cost model's file under "serving")."""

    request_latency_s: float
    per_prompt_token_latency_s: float
    per_step_overhead_s: float
    per_streamed_token_s: float
    per_arrival_s: float
    info: dict


def measure_serving_terms(config: EngineConfig, cost: StepCostModel,
                          ready_timeout_s: float = 300.0) -> ServingTerms:
    """Start `tidal serve` with `config`, probe it, stop it; the fitted terms."""
    port = free_tcp_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        lifeline = lifeline_fd()  # the server stops with this process, SIGKILL included
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.frontend.cli", "serve", *config_to_argv(config),
             "--host", "127.0.0.1", "--port", str(port), "--lifeline-fd", str(lifeline)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=(lifeline,))
        try:
            return asyncio.run(_probe(f"http://127.0.0.1:{port}", config, cost, ready_timeout_s))
        except Exception as e:
            log.seek(0)
            tail = "".join(log.readlines()[-15:])
            raise RuntimeError(f"measuring the serving terms failed: {e}\n{tail}") from e
        finally:
            _stop(proc)


async def _probe(base_url: str, config: EngineConfig, cost: StepCostModel,
                 ready_timeout_s: float) -> ServingTerms:
    import httpx

    from ..bench.serve import wait_until_ready

    async with httpx.AsyncClient(timeout=None) as client:
        model = (await wait_until_ready(client, base_url, ready_timeout_s))[0]
        # warm-up (first runs of each code path), and how many tokens a word makes here: the
        # long prompt must fit half the context (a tiny model's can be short)
        short = await _stream(client, base_url, model, 4, PROMPT_WORDS[0])
        tokens_per_word = max(1.0, short.prompt_len / PROMPT_WORDS[0])
        fit = int(resolve_max_model_len(config) // 2 / tokens_per_word)
        lengths = [min(words, max(fit, 1)) for words in PROMPT_WORDS]
        # per prompt length: (prompt tokens, TTFT less the cost model's prefill step)
        first: dict[int, list[tuple[int, float]]] = {words: [] for words in lengths}
        for _ in range(NUM_LATENCY_PROBES):
            for words in lengths:
                result = await _stream(client, base_url, model, 2, words)
                prefill = cost.predict(*_prefill_features(result.prompt_len))
                first[words].append((result.prompt_len, result.ttft - prefill))
        rows = []
        for batch in [b for b in BATCHES if b <= config.scheduler.max_num_seqs]:
            results = await asyncio.gather(*[
                _stream(client, base_url, model, OUTPUT_LEN, PROMPT_WORDS[0])
                for _ in range(batch)])
            # Each stream's mean gap over its middle tokens, all B decoding: a client that
            # falls behind reads several events at once (gaps of microseconds, then one long
            # one), so single gaps mislead where their mean over a stretch does not.
            gaps = [_mean_gap(r) for r in results]
            context = sum(r.prompt_len + OUTPUT_LEN // 2 for r in results)
            step = cost.predict(0, batch, context, 0.0)
            rows.append({"batch": batch, "median_itl_s": statistics.median(gaps),
                         "predicted_step_s": step})
        overhead, per_token = fit_step_terms(rows)
        streams = min(ARRIVAL_STREAMS, config.scheduler.max_num_seqs - 1)
        arrival_rounds = await _arrival_rounds(client, base_url, model, streams) \
            if streams >= 1 else []
    # the first token's step pays the step terms too (the simulator adds them to every step)
    latency, per_prompt_token = fit_latency_terms({
        statistics.median(n for n, _ in probes):
            statistics.median(t for _, t in probes) - overhead - per_token
        for probes in first.values()})
    per_arrival = fit_arrival_term(arrival_rounds, cost, per_token, per_prompt_token)
    return ServingTerms(latency, per_prompt_token, overhead, per_token, per_arrival, info={
        "latency_probes": [{"prompt_tokens": n, "ttft_less_prefill_s": round(t, 6)}
                           for probes in first.values() for n, t in probes],
        "decode_probes": rows,
        "arrival_probes": arrival_rounds,
        "async_scheduling": config.scheduler.async_scheduling})


async def _arrival_rounds(client, base_url: str, model: str, streams: int) -> list[dict]:
    """A quiet round (when the streams decode, and for how long), then `ARRIVAL_ROUNDS` with
    arrivals; each: the arrivals' prompt tokens, and per arrival the median over the streams
    of its excess (`arrival_excess`)."""
    quiet = await _arrival_round(client, base_url, model, streams, 0, (0.0, 0.0))
    # the first arrival once every stream decodes, the last before 80% of the decoding
    timing = (1.2 * quiet["first_token_s"], 0.8 * quiet["decode_s"] / NUM_ARRIVALS)
    return [quiet] + [await _arrival_round(client, base_url, model, streams, NUM_ARRIVALS,
                                           timing) for _ in range(ARRIVAL_ROUNDS)]


async def _arrival_round(client, base_url: str, model: str, streams: int, arrivals: int,
                         timing: tuple[float, float]) -> dict:
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_stream(client, base_url, model, ARRIVAL_OUTPUT_LEN,
                                         PROMPT_WORDS[0], t0)) for _ in range(streams)]
    sent = []
    first, spacing = timing
    if arrivals:
        await asyncio.sleep(first)
        for _ in range(arrivals):
            sent.append(asyncio.create_task(_stream(client, base_url, model, 1,
                                                    PROMPT_WORDS[0], t0)))
            await asyncio.sleep(spacing)
    results = await asyncio.gather(*tasks)
    extra = await asyncio.gather(*sent)
    round_ = {"arrivals": arrivals,
              "decode_s": statistics.fmean(r.latency - r.ttft for r in results),
              "first_token_s": max(r.ttft for r in results),
              "arrival_prompt_tokens": [r.prompt_len for r in extra]}
    if arrivals:
        sent_at = [r.start_time for r in extra]
        per_stream = [arrival_excess(_token_times(r), sent_at) for r in results]
        round_["excess_s"] = [
            round(statistics.median(e[i] for e in per_stream if e[i] is not None), 6)
            if any(e[i] is not None for e in per_stream) else None
            for i in range(arrivals)]
    return round_


def _token_times(result) -> list[float]:
    """When each of a stream's tokens arrived (seconds since its round began)."""
    times = [result.start_time + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def arrival_excess(token_times: list[float], sent_at: list[float],
                   window: int = ARRIVAL_WINDOW) -> list[float | None]:
    """Per arrival (sent at `sent_at[i]`): how much longer the `window` gaps between tokens
    from the one it was sent in took than `window` typical gaps (the median of the gaps
    outside every arrival's window); None when its window is not all inside the stream's
    middle (the first and last `_EDGE` gaps are not used)."""
    gaps = np.diff(np.asarray(token_times, dtype=np.float64))
    starts = [int(np.searchsorted(token_times, t, "right")) - 1 for t in sent_at]
    usable = [j if _EDGE <= j and j + window <= len(gaps) - _EDGE else None for j in starts]
    inside = np.zeros(len(gaps), dtype=bool)
    for j in usable:
        if j is not None:
            inside[j:j + window] = True
    outside = gaps[_EDGE:len(gaps) - _EDGE][~inside[_EDGE:len(gaps) - _EDGE]]
    if not len(outside):
        return [None] * len(sent_at)
    typical = float(np.median(outside))
    return [None if j is None else float(gaps[j:j + window].sum() - window * typical)
            for j in usable]


def fit_arrival_term(rounds: list[dict], cost: StepCostModel, per_streamed_token_s: float,
                     per_prompt_token_s: float = 0.0) -> float:
    """Seconds each arrival adds to the steps beside it, >= 0: the median excess over the
    arrivals, less what the model already charges an arrival (its prefill in a running step,
    its one token streamed, and `per_prompt_token_s` x its prompt tokens for tokenizing)."""
    excess, charged = [], []
    for r in rounds:
        for e, n in zip(r.get("excess_s", ()), r["arrival_prompt_tokens"]):
            if e is None:
                continue
            excess.append(e)
            # its prefill inside a running step: the prefill step's price less the intercept
            prefill = cost.predict(*_prefill_features(n)) - cost.intercept_s
            charged.append(prefill + per_streamed_token_s + per_prompt_token_s * n)
    if not excess:
        return 0.0
    return max(0.0, statistics.median(excess) - statistics.fmean(charged))


def fit_step_terms(rows: list[dict]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum((a + b * batch - (itl - predicted))^2) over the probes."""
    batch = np.array([r["batch"] for r in rows], dtype=np.float64)
    extra = np.array([r["median_itl_s"] - r["predicted_step_s"] for r in rows])
    if len(rows) == 1:
        return max(0.0, float(extra[0])), 0.0
    b, a = np.polyfit(batch, extra, 1)
    if b < 0:  # no growth with the batch: a constant
        return max(0.0, float(extra.mean())), 0.0
    if a < 0:  # through the origin
        return 0.0, max(0.0, float(batch @ extra / (batch @ batch)))
    return float(a), float(b)


def fit_latency_terms(by_prompt_len: dict[int, float]) -> tuple[float, float]:
    """(a, b) >= 0 of the line a + b * prompt tokens through the probes' two points (the
    latency left after the steps, by prompt length); a constant when it does not grow."""
    (n0, y0), (n1, y1) = sorted(by_prompt_len.items())[0], sorted(by_prompt_len.items())[-1]
    slope = (y1 - y0) / (n1 - n0) if n1 > n0 else 0.0
    if slope <= 0:
        return max(0.0, min(y0, y1) if n1 > n0 else y0), 0.0
    return max(0.0, y0 - slope * n0), slope


def _mean_gap(result) -> float:
    """A stream's mean gap between tokens over its middle (see `_probe`); over all of it when
    tokens that decode to no text (a random tiny model's) left too few gaps to time."""
    middle = result.itl[_EDGE:-_EDGE]
    if middle:
        return statistics.fmean(middle)
    return (result.latency - result.ttft) / max(1, result.output_len - 1)


def _prefill_features(prompt_len: int) -> tuple[int, int, int, float]:
    return chunk_features(0, max(prompt_len, 2))


async def _stream(client, base_url: str, model: str, max_tokens: int, words: int,
                  t0: float | None = None):
    """One streaming request for `max_tokens` tokens after a prompt of `words` words; its
    `start_time` counts from `t0` (default: when it is sent)."""
    from ..bench.datasets import BenchRequest
    from ..bench.serve import ServeConfig, request_body, send_request

    # a number first: no probe's prompt starts like another's, so none is prefix-cached (a
    # cached prompt skips most of its prefill and makes the latency look negative)
    request = BenchRequest(" ".join([str(next(_PROBE_NUMBERS))] + ["hello"] * (words - 1)),
                           words, max_tokens)
    body = request_body(request, model, ServeConfig(ignore_eos=True))
    result = await send_request(client, f"{base_url}/v1/completions", body, request,
                                time.perf_counter() if t0 is None else t0, 300.0)
    if not result.success:
        raise RuntimeError(f"a probe request failed: {result.error}")
    return result


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT the server's session and wait; SIGKILL what is left after 30 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
