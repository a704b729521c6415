"""How long one worker step takes, as a function of its shape: the step cost model.

    t = intercept
        + per_prefill_token           x prefill_tokens
        + per_decode_req              x decode_reqs
        + per_decode_context_token    x decode_context_tokens
        + per_prefill_attention_pair  x prefill_attention_pairs

Features of a `BatchPlan` (`plan_features`): an entry scheduling one token is a decode (it
reads `num_computed_tokens + 1` keys); an entry scheduling n > 1 tokens from position s is a
prefill chunk, whose tokens attend s + 1, ..., s + n keys: n*s + n(n+1)/2 attention pairs.
The linear layers cost per token (prefill tokens and decode requests both), the LM head per
sampled row (mostly decodes), attention per key read: hence these four terms. A fit may leave a
term at 0 when the measurements do not support it (`tidal tune profile` chooses the formula
by cross-validated residuals; the file records each candidate's error).

A served step costs more than the worker's `execute`: the serving terms (measured through a
real `tidal serve` by `frontend/tune/serving_profile.py`, 0 when not measured) add
`per_step_overhead + per_streamed_token x tokens sampled` to every step with tokens
(`served_step_time`), `request_latency + per_prompt_token_latency x prompt tokens` to
each request's way in (`request_latency`), and `per_arrival + per_arrival_prompt_token x
prompt tokens` to the step a request arrives during (`arrival_charge`: its handling takes CPU
from that step where the server shares the workers' cores).

The coefficients are measured by `tidal tune profile` on the user's machine and model and kept
as JSON in a cache folder keyed by what changes step times (`profile_path`). The engine core
reads the file (plain JSON: no torch, no numpy) for `--max-queue-delay`; `tidal tune` reads it
for the simulator.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace

from ..config import EngineConfig
from ..cpu_threads import parse_cpu_affinity, worker_threads
from ...ipc.paths import cache_dir
from ...ipc.worker_messages import BatchPlan

FEATURES = ("prefill_tokens", "decode_reqs", "decode_context_tokens", "prefill_attention_pairs")
"""The features of a step, in coefficient order (after the intercept)."""

FORMAT_VERSION = 1
_COEFFICIENTS = ("intercept_s", "per_prefill_token_s", "per_decode_req_s",
                 "per_decode_context_token_s", "per_prefill_attention_pair_s")
_SERVING_TERMS = ("request_latency_s", "per_prompt_token_latency_s", "per_step_overhead_s",
                  "per_streamed_token_s", "per_arrival_s", "per_arrival_prompt_token_s")
"""Optional (0 in a file written before they were measured)."""
_REQUEST_TERMS = ("request_latency_s", "per_prompt_token_latency_s")
"""A request's way in, not a step's time."""


def chunk_features(num_computed: int, num_scheduled: int) -> tuple[int, int, int, float]:
    """The features one plan entry adds: (prefill tokens, decode requests, decode context
    tokens, prefill attention pairs)."""
    if num_scheduled == 1:
        return 0, 1, num_computed + 1, 0.0
    return num_scheduled, 0, 0, num_scheduled * (num_computed + (num_scheduled + 1) / 2)


def plan_features(plan: BatchPlan) -> tuple[int, int, int, float]:
    """The four features of a whole step (see the module docstring)."""
    prefill = decodes = context = 0
    pairs = 0.0
    for entries in (plan.new_requests, plan.cached_requests):
        for e in entries:
            n = e.num_scheduled_tokens
            if n == 1:
                decodes += 1
                context += e.num_computed_tokens + 1
            elif n > 1:
                prefill += n
                pairs += n * (e.num_computed_tokens + (n + 1) / 2)
    return prefill, decodes, context, pairs


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step from the step's features (coefficients in seconds per unit)."""

    intercept_s: float
    per_prefill_token_s: float = 0.0
    per_decode_req_s: float = 0.0
    per_decode_context_token_s: float = 0.0
    per_prefill_attention_pair_s: float = 0.0
    request_latency_s: float = 0.0
    """Serving: seconds a served request spends outside the steps before its first token
    (HTTP, tokenizing, messages, the first event); `frontend/tune/serving_profile.py`."""
    per_prompt_token_latency_s: float = 0.0
    """Serving: seconds each prompt token adds to `request_latency_s` (tokenizing it, the
    request's bytes)."""
    per_step_overhead_s: float = 0.0
    """Serving: seconds a served step takes beyond the worker's `execute` (engine core,
    messages, and whatever else shares the machine's cores)."""
    per_streamed_token_s: float = 0.0
    """Serving: seconds each token sampled in a step adds to it (detokenizing and streaming
    it where the HTTP server and its clients share the workers' cores)."""
    per_arrival_s: float = 0.0
    """Serving: seconds a request arriving while a step runs adds to that step (the HTTP
    server parsing it, setting up its stream, on the workers' cores), beyond its prompt's
    share below."""
    per_arrival_prompt_token_s: float = 0.0
    """Serving: seconds each prompt token of a request arriving while a step runs adds to
    that step (tokenizing it: `tidal tune profile` sets it to `per_prompt_token_latency_s`,
    the same CPU seen from the request's side)."""
    info: dict = field(default_factory=dict, compare=False)
    """Where it was measured and how well it fits (model, dtype, device, threads,
    kv_block_bytes, num_kv_blocks, residuals per candidate formula, ...)."""

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS + _SERVING_TERMS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0.0 and value < float("inf")):
                raise ValueError(f"step cost model: {name} must be a finite number >= 0, "
                                 f"got {value!r}")

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.intercept_s, self.per_prefill_token_s, self.per_decode_req_s,
                self.per_decode_context_token_s, self.per_prefill_attention_pair_s)

    def predict(self, prefill_tokens: float, decode_reqs: float, decode_context_tokens: float,
                prefill_attention_pairs: float) -> float:
        """Seconds of a step with these features (0 for a step with no tokens)."""
        if prefill_tokens == 0 and decode_reqs == 0:
            return 0.0
        return (self.intercept_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_req_s * decode_reqs
                + self.per_decode_context_token_s * decode_context_tokens
                + self.per_prefill_attention_pair_s * prefill_attention_pairs)

    def prefill_cost(self, tokens: float, attention_pairs: float) -> float:
        """The part of a step's time that `tokens` prompt tokens with `attention_pairs`
        (query, key) pairs add to it."""
        return (self.per_prefill_token_s * tokens
                + self.per_prefill_attention_pair_s * attention_pairs)

    def with_steps_scaled(self, factor: float) -> StepCostModel:
        """This model with every term of a step's time (not a request's way in) times
        `factor`: steps that run `factor` times slower than profiled."""
        return replace(self, **{name: getattr(self, name) * factor
                                for name in _COEFFICIENTS + _SERVING_TERMS
                                if name not in _REQUEST_TERMS})

    def kv_block_bytes(self, block_size: int) -> int | None:
        """Bytes of one KV block of `block_size` tokens on the profiled workers (scaled from
        the profiled block size), or None when the profile did not record it."""
        block_bytes = self.info.get("kv_block_bytes")
        if not block_bytes:
            return None
        if self.info.get("block_size") not in (None, block_size):
            block_bytes = block_bytes * block_size // self.info["block_size"]
        return block_bytes

    def step_time(self, plan: BatchPlan) -> float:
        """Seconds the workers take for `plan`."""
        return self.predict(*plan_features(plan))

    def served_step_time(self, plan: BatchPlan, num_sampled: int) -> float:
        """Seconds `plan` takes in a serving engine, `num_sampled` tokens streamed from it
        (0 for a step with no tokens)."""
        return self.served_predict(*plan_features(plan), num_sampled)

    def served_predict(self, prefill_tokens: float, decode_reqs: float,
                       decode_context_tokens: float, prefill_attention_pairs: float,
                       num_sampled: float) -> float:
        """`predict` plus the serving terms of a step that streams `num_sampled` tokens (0
        for a step with no tokens)."""
        t = self.predict(prefill_tokens, decode_reqs, decode_context_tokens,
                         prefill_attention_pairs)
        return t + self.per_step_overhead_s + self.per_streamed_token_s * num_sampled if t else t

    def arrival_charge(self, prompt_len: int) -> float:
        """Seconds a request of `prompt_len` tokens arriving during a step adds to it."""
        return self.per_arrival_s + self.per_arrival_prompt_token_s * prompt_len

    def request_latency(self, prompt_len: int) -> float:
        """Seconds a served request of `prompt_len` tokens takes to reach the scheduler (and
        its first token to come back), beyond the steps."""
        return self.request_latency_s + self.per_prompt_token_latency_s * prompt_len

    def formula(self) -> str:
        """The fitted formula, human-readable (microseconds)."""
        terms = [f"{self.intercept_s * 1e6:.1f}"]
        for coef, name in zip(self.coefficients[1:], FEATURES):
            if coef:
                terms.append(f"{coef * 1e6:.4g}*{name}")
        return "t_us = " + " + ".join(terms)

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": "tidal-step-cost", "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> StepCostModel:
        """ValueError when `data` is not a step cost model this version reads."""
        if not isinstance(data, dict) or data.get("format") != "tidal-step-cost":
            raise ValueError("not a tidal step cost model (format != 'tidal-step-cost')")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"step cost model version {data.get('version')} is not "
                             f"{FORMAT_VERSION}; run `tidal tune profile` again")
        fields = {k: data[k] for k in _COEFFICIENTS + _SERVING_TERMS if k in data}
        return cls(**fields, info=dict(data.get("info") or {}))

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> StepCostModel:
        """ValueError naming the file when it cannot be read as a step cost model."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return cls.from_json(data)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"step cost model {path!r}: {e}") from e


# -- where profiles live -----------------------------------------------------------------------


def profile_key(model: str, dtype: str, device: str, tensor_parallel_size: int,
                threads: int, attention_backend: str, cpu_kernels: str = "auto") -> dict:
    """What a step's time depends on besides its shape: the profile's cache key. The CPU
    ops (`--cpu-kernels`) change a float32 step's time by 1.2-2x at batch 1-8, so a profile
    taken with torch's ops is not the one for the C kernels."""
    return {"model": os.path.realpath(model), "dtype": dtype, "device": device,
            "tensor_parallel_size": tensor_parallel_size, "threads": threads,
            "attention_backend": attention_backend, "cpu_kernels": cpu_kernels}


def profile_path(key: dict, directory: str | None = None) -> str:
    """`<cache>/step-cost/<model folder name>-<dtype>-<threads>t-<digest>.json`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = os.path.basename(key["model"].rstrip(os.sep)) or "model"
    filename = f"{name}-{key['dtype']}-{key['threads']}t-{digest}.json"
    return os.path.join(directory or os.path.join(cache_dir(), "step-cost"), filename)


def config_profile_key(config: EngineConfig) -> dict:
    """`profile_key` of the workers this config starts (rank 0's thread count)."""
    p = config.parallel
    affinity = parse_cpu_affinity(p.cpu_affinity, p.tensor_parallel_size)
    threads = worker_threads(p.cpu_threads, affinity[0] if affinity else None,
                             p.tensor_parallel_size, dict(os.environ))
    return profile_key(config.model.model, config.model.dtype, p.device, p.tensor_parallel_size,
                       threads, p.attention_backend, p.cpu_kernels)


def find_profile(config: EngineConfig) -> str | None:
    """The step cost model for this config: `--step-cost-model` if given, else the cached
    profile `tidal tune profile` wrote for the same model, dtype, device, TP, threads,
    attention backend and CPU ops, else None."""
    if config.scheduler.step_cost_model:
        return config.scheduler.step_cost_model
    path = profile_path(config_profile_key(config))
    return path if os.path.exists(path) else None


def required_profile(config: EngineConfig) -> str:
    """`find_profile`, or ValueError saying how to make one (for --max-queue-delay)."""
    path = find_profile(config)
    if path is None:
        raise ValueError(
            "max_queue_delay needs a step cost model for this model and machine settings: run "
            f"`tidal tune profile {config.model.model}` with the same engine flags first "
            "(about a minute), or pass --step-cost-model FILE")
    return path
