"""The tuner: simulate a grid of settings on one trace, keep those that meet the SLO, and find
the highest request rate each can sustain.

For every setting (max_num_seqs x max_num_batched_tokens x KV blocks x chunked prefill x
policy; combinations the engine refuses are skipped):

1. simulate the trace at the requested rate; the setting *meets* the SLO when every request
   completes, each p99 given (TTFT, ITL) is within its limit, and the engine keeps up: the
   requests in the system seen by the last quarter of the arrivals are at most 1.5 times
   (plus 2) those seen by the second quarter (`SimResult.summary()["keeps_up"]`). Without
   that test a short trace passes at rates the engine cannot sustain: the batch grows through
   the whole trace and drains after it, before the latencies show it;
2. for a setting that meets it, the highest sustainable rate: the same trace arriving m times
   faster (the Gamma gaps scale exactly), m doubled until the SLO fails (at most
   `MAX_MULTIPLIER`), then bisected until the bracket is within `RATE_PRECISION`;
3. when no setting meets it (a demanding SLO, or a cost model profiled on a slow machine),
   the `BELOW_TOP` closest settings are searched downwards the same way (m halved until the
   SLO holds, at least 1/`MAX_MULTIPLIER`), so the report can say what rate they do sustain
   and the plot draws a curve rather than one point per setting.

Settings are ranked by that rate, then by output throughput there. With a finite trace the
queue in overload grows with the trace's length, so the rate found is for a burst of that
many requests; longer traces give a slightly lower, steadier figure.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..config import EngineConfig, check_lengths
from .step_cost import StepCostModel
from .simulator import simulate
from .trace import Trace

MAX_MULTIPLIER = 64.0
RATE_PRECISION = 1.05
"""The bisection stops when the failing rate is within 5% of the sustainable one."""
BELOW_TOP = 5
"""How many of the closest settings are searched below the requested rate when none meets
the SLO there (as many as the plot draws)."""
_CURVE_KEYS = ("p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms", "output_throughput",
               "request_throughput", "num_preemptions", "max_num_waiting", "max_kv_cache_usage",
               "completed", "keeps_up")


@dataclass(frozen=True)
class Setting:
    """One point of the search: the flags `tidal serve` would take."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    kv_cache_memory: int | None = None
    """Bytes per rank the blocks stand for (None when given as a block count)."""

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        return dataclasses.replace(
            base,
            cache=dataclasses.replace(base.cache, kv_cache_memory=self.kv_cache_memory
                                      or base.cache.kv_cache_memory),
            scheduler=dataclasses.replace(
                base.scheduler, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                scheduling_policy=self.scheduling_policy))

    def kv_label(self) -> str:
        if self.kv_cache_memory is not None:
            return format_bytes(self.kv_cache_memory)
        return f"{self.num_kv_blocks} blocks"

    def flags(self) -> str:
        """The `tidal serve` flags of this setting."""
        kv = (f"--kv-cache-memory {format_bytes(self.kv_cache_memory)}"
              if self.kv_cache_memory is not None
              else f"--num-gpu-blocks-override {self.num_kv_blocks}")
        chunked = "" if self.enable_chunked_prefill else " --no-enable-chunked-prefill"
        return (f"--max-num-seqs {self.max_num_seqs} --max-num-batched-tokens "
                f"{self.max_num_batched_tokens} {kv}{chunked} --scheduling-policy "
                f"{self.scheduling_policy}")


@dataclass(frozen=True)
class SLO:
    """Latency limits in seconds (None = no limit on that metric)."""

    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "itl_p99_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"slo {name} must be positive, got {value}")

    def met(self, summary: dict, num_requests: int) -> bool:
        """Every request that fits the context completed, the engine kept up, and each p99
        is within its limit."""
        if summary["completed"] < num_requests - summary.get("refused", 0):
            return False
        if not summary.get("keeps_up", True):
            return False
        if self.ttft_p99_s is not None and summary["p99_ttft_ms"] > self.ttft_p99_s * 1e3:
            return False
        return self.itl_p99_s is None or summary["p99_itl_ms"] <= self.itl_p99_s * 1e3

    def overshoot(self, summary: dict) -> float:
        """The largest p99 / limit over the limits set (1.0 = at the limit), infinite when
        the engine does not keep up: how far a setting is from meeting the SLO."""
        if not summary.get("keeps_up", True):
            return math.inf
        ratios = [0.0]
        if self.ttft_p99_s is not None:
            ratios.append(summary["p99_ttft_ms"] / (self.ttft_p99_s * 1e3))
        if self.itl_p99_s is not None:
            ratios.append(summary["p99_itl_ms"] / (self.itl_p99_s * 1e3))
        return max(ratios)

    def describe(self) -> str:
        parts = []
        if self.ttft_p99_s is not None:
            parts.append(f"TTFT p99 <= {format_seconds(self.ttft_p99_s)}")
        if self.itl_p99_s is not None:
            parts.append(f"ITL p99 <= {format_seconds(self.itl_p99_s)}")
        return " and ".join(parts) or "keeping up"


@dataclass
class Evaluation:
    """What the search found for one setting."""

    setting: Setting
    summary: dict
    """The simulation at the requested rate."""
    meets: bool
    max_rate: float | None = None
    """Highest sustainable rate (req/s). When the SLO fails at the requested rate it is None,
    or below the requested rate after a downward search (step 3 of the module docstring)."""
    capped: bool = False
    """The SLO still held at MAX_MULTIPLIER times the requested rate."""
    curve: list[dict] = field(default_factory=list)
    """Every simulated rate: {"rate", "meets", and the `_CURVE_KEYS` of its summary}."""

    def at_max(self) -> dict | None:
        points = [p for p in self.curve if p["rate"] == self.max_rate]
        return points[0] if points else None


def settings_grid(max_num_seqs: Iterable[int], max_num_batched_tokens: Iterable[int],
                  kv: Iterable[tuple[int, int | None]], chunked: Iterable[bool],
                  policies: Iterable[str], base: EngineConfig,
                  max_model_len: int) -> list[Setting]:
    """Every combination the engine accepts (`kv` holds (blocks, bytes or None) pairs)."""
    settings = []
    for seqs, tokens, (blocks, kv_bytes), on, policy in itertools.product(
            max_num_seqs, max_num_batched_tokens, kv, chunked, policies):
        setting = Setting(seqs, tokens, blocks, on, policy, kv_bytes)
        try:
            check_lengths(setting.engine_config(base), max_model_len)
        except ValueError:
            continue
        if tokens < seqs or (blocks - 1) * base.cache.block_size < max_model_len:
            continue
        settings.append(setting)
    return settings


class _Runner:
    """Simulates one setting at any rate multiplier (picklable, for worker processes)."""

    def __init__(self, base: EngineConfig, max_model_len: int, cost_model: StepCostModel,
                 trace: Trace, base_rate: float, slo: SLO) -> None:
        self.base = base
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.trace = trace
        self.base_rate = base_rate
        self.slo = slo

    def point(self, setting: Setting, multiplier: float) -> tuple[dict, bool]:
        trace = self.trace if multiplier == 1.0 else self.trace.scaled(multiplier)
        result = simulate(setting.engine_config(self.base), setting.num_kv_blocks,
                          self.max_model_len, self.cost_model, trace)
        summary = result.summary()
        return summary, self.slo.met(summary, len(trace.requests))

    def evaluate(self, setting: Setting) -> Evaluation:
        summary, meets = self.point(setting, 1.0)
        evaluation = Evaluation(setting, summary, meets)
        self._note(evaluation, 1.0, summary, meets)
        if meets:
            self._search_rate(evaluation)
        return evaluation

    def _note(self, evaluation: Evaluation, multiplier: float, summary: dict,
              meets: bool) -> None:
        point = {"rate": self.base_rate * multiplier, "meets": meets}
        point.update({k: summary[k] for k in _CURVE_KEYS})
        evaluation.curve.append(point)

    def _search_rate(self, evaluation: Evaluation) -> None:
        lo, hi = 1.0, None
        m = 2.0
        while m <= MAX_MULTIPLIER:
            summary, meets = self.point(evaluation.setting, m)
            self._note(evaluation, m, summary, meets)
            if not meets:
                hi = m
                break
            lo, m = m, m * 2
        if hi is None:
            evaluation.capped = True
        else:
            self._bisect(evaluation, lo, hi)
            return
        evaluation.max_rate = self.base_rate * lo
        evaluation.curve.sort(key=lambda p: p["rate"])

    def search_below(self, evaluation: Evaluation) -> Evaluation:
        """The highest rate below the requested one at which a missing setting meets the SLO
        (`max_rate` stays None when even 1/`MAX_MULTIPLIER` of it misses)."""
        hi, m = 1.0, 0.5
        while m >= 1 / MAX_MULTIPLIER:
            summary, meets = self.point(evaluation.setting, m)
            self._note(evaluation, m, summary, meets)
            if meets:
                self._bisect(evaluation, m, hi)
                return evaluation
            hi, m = m, m / 2
        evaluation.curve.sort(key=lambda p: p["rate"])
        return evaluation

    def _bisect(self, evaluation: Evaluation, lo: float, hi: float) -> None:
        """Narrow [lo, hi] (meets at lo, misses at hi) to `RATE_PRECISION`."""
        while hi / lo > RATE_PRECISION:
            mid = math.sqrt(lo * hi)
            summary, meets = self.point(evaluation.setting, mid)
            self._note(evaluation, mid, summary, meets)
            if meets:
                lo = mid
            else:
                hi = mid
        evaluation.max_rate = self.base_rate * lo
        evaluation.curve.sort(key=lambda p: p["rate"])


def search(base: EngineConfig, max_model_len: int, cost_model: StepCostModel, trace: Trace,
           base_rate: float, slo: SLO, settings: list[Setting], jobs: int = 1,
           progress: Callable[[int, int], None] | None = None) -> list[Evaluation]:
    """Evaluate every setting; the best first (see the module docstring for the order)."""
    runner = _Runner(base, max_model_len, cost_model, trace, base_rate, slo)
    evaluations = []
    with ProcessPoolExecutor(jobs) if jobs > 1 else _Inline() as pool:
        for i, evaluation in enumerate(pool.map(runner.evaluate, settings), 1):
            evaluations.append(evaluation)
            if progress:
                progress(i, len(settings))
        evaluations = rank(evaluations, slo)
        if evaluations and not any(e.meets for e in evaluations):
            closest = list(pool.map(runner.search_below, evaluations[:BELOW_TOP]))
            evaluations = rank(closest, slo) + evaluations[BELOW_TOP:]
    return evaluations


class _Inline:
    """`ProcessPoolExecutor`'s `map` in this process (jobs=1)."""

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def map(self, fn, items):
        return map(fn, items)


def rank(evaluations: list[Evaluation], slo: SLO | None = None) -> list[Evaluation]:
    """Meeting the SLO first, by sustainable rate, then output throughput at that rate, then
    p99 TTFT at the requested rate, then the leaner setting (less KV memory, fewer
    sequences, a smaller budget); the rest by the rate they sustain below the requested one
    (when searched), then by how far they miss `slo` (`SLO.overshoot`), then by p99 TTFT at
    the requested rate."""
    def key(e: Evaluation):
        s = e.setting
        lean = (s.num_kv_blocks, s.max_num_seqs, s.max_num_batched_tokens,
                not s.enable_chunked_prefill)
        if e.meets:
            at_max = e.at_max() or {}
            return (0, -e.max_rate, -round(at_max.get("output_throughput", 0.0), 6),
                    round(e.summary["p99_ttft_ms"], 6), *lean)
        miss = slo.overshoot(e.summary) if slo is not None else 0.0
        below = -(e.max_rate or 0.0)
        return (1, below, miss, e.summary["p99_ttft_ms"], e.summary["p99_itl_ms"], *lean)

    return sorted(evaluations, key=key)


# -- reports ------------------------------------------------------------------------------------


def format_table(evaluations: list[Evaluation], base_rate: float, slo: SLO,
                 top: int = 10) -> str:
    """The ranked table of settings that meet the SLO (and a count of those that miss)."""
    meeting = [e for e in evaluations if e.meets]
    lines = [f"{len(meeting)} of {len(evaluations)} settings meet {slo.describe()} at "
             f"{base_rate:g} req/s (simulated)."]
    if not meeting:
        best = evaluations[0] if evaluations else None
        if best is not None:
            lines.append(f"Closest: {best.setting.flags()} (TTFT p99 "
                         f"{best.summary['p99_ttft_ms']:.0f} ms, ITL p99 "
                         f"{best.summary['p99_itl_ms']:.0f} ms"
                         f"{'' if best.summary.get('keeps_up', True) else ', falls behind'})")
        below = [e for e in evaluations if e.max_rate]
        if below:
            lines += ["", f"At lower rates (the {len(below)} closest, searched below "
                      f"{base_rate:g} req/s):"]
            lines += [f"  {e.max_rate:.3g} req/s  {e.setting.flags()}" for e in below[:top]]
        elif best is not None:
            lines.append(f"None of the closest meets it even at {base_rate / MAX_MULTIPLIER:.3g}"
                         " req/s: is the step cost model from a busy machine, or the SLO "
                         "below one step?")
        return "\n".join(lines)
    header = (f"{'#':>2} {'max-num-seqs':>12} {'batched-tokens':>14} {'KV cache':>12} "
              f"{'chunked':>7} {'policy':>8} | {'TTFT p99':>9} {'ITL p99':>8} {'preempt':>7} "
              f"| {'max rate':>9} {'out tok/s':>10}")
    lines += ["", f"{'':>70}at {base_rate:g} req/s{'':>11}at the max rate", header,
              "-" * len(header)]
    for i, e in enumerate(meeting[:top], 1):
        s, at_max = e.setting, e.at_max() or {}
        rate = f"{e.max_rate:.3g}" + ("+" if e.capped else "")
        lines.append(
            f"{i:>2} {s.max_num_seqs:>12} {s.max_num_batched_tokens:>14} {s.kv_label():>12} "
            f"{'on' if s.enable_chunked_prefill else 'off':>7} {s.scheduling_policy:>8} | "
            f"{e.summary['p99_ttft_ms']:>7.0f}ms {e.summary['p99_itl_ms']:>6.0f}ms "
            f"{e.summary['num_preemptions']:>7} | {rate:>9} "
            f"{at_max.get('output_throughput', 0.0):>10.0f}")
    if any(e.capped for e in meeting[:top]):
        lines.append(f"+: still within the SLO at {MAX_MULTIPLIER:g}x the requested rate "
                     "(the search stops there)")
    lines += _by_kv_cache(evaluations)
    lines += ["", f"Best: tidal serve MODEL {meeting[0].setting.flags()}"]
    return "\n".join(lines)


def _by_kv_cache(evaluations: list[Evaluation]) -> list[str]:
    """One line per KV cache size searched (when more than one): how many settings meet the
    SLO and the best of them."""
    sizes = sorted({e.setting.num_kv_blocks for e in evaluations})
    if len(sizes) < 2:
        return []
    lines = ["", f"{'KV cache':>12} {'meet':>7}  best sustainable rate"]
    for blocks in sizes:
        group = [e for e in evaluations if e.setting.num_kv_blocks == blocks]
        meeting = [e for e in group if e.meets]
        best = (f"{meeting[0].max_rate:.3g} req/s ({meeting[0].setting.flags()})"
                if meeting else "-")
        worst_preempt = max(e.summary["num_preemptions"] for e in group)
        note = f"; up to {worst_preempt} preemptions" if not meeting and worst_preempt else ""
        lines.append(f"{group[0].setting.kv_label():>12} {len(meeting):>3}/{len(group):<3}  "
                     f"{best}{note}")
    return lines


def evaluations_to_json(evaluations: list[Evaluation]) -> list[dict]:
    return [{"setting": dataclasses.asdict(e.setting), "flags": e.setting.flags(),
             "meets": e.meets, "max_rate": e.max_rate, "capped": e.capped,
             "summary": {k: v for k, v in e.summary.items() if k != "timeline"},
             "curve": e.curve} for e in evaluations]


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % (size // 16) == 0:
            value = n / size
            return f"{value:g}{unit}"
    return str(n)


def format_seconds(s: float) -> str:
    return f"{s * 1e3:g}ms" if s < 1 else f"{s:g}s"


def parse_seconds(text: str) -> float:
    """'1s', '200ms', '0.5' (seconds) -> seconds; ValueError on anything else."""
    t = text.strip().lower()
    try:
        if t.endswith("ms"):
            value = float(t[:-2]) / 1e3
        elif t.endswith("s"):
            value = float(t[:-1])
        else:
            value = float(t)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (e.g. 1s, 200ms)") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"a duration must be positive and finite, got {text!r}")
    return value
