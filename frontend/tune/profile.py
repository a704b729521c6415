"""`tidal tune profile MODEL [engine flags]`: measure worker steps, fit the step cost model.

    parent (no torch)                          child: python -m tidal.frontend.tune.profile (rank 0)
    engine flags -> WorkerConfig  ── spawn ──► Worker(config): load, KV cache, then for about
    (the environment a serving worker gets:    --duration seconds run random step shapes fed
    OMP threads, wait policy, core mask)       as BatchPlans and time each `execute`
    fit the formulas (least squares) ◄─ JSON ── (features, seconds) per shape
    save the best to the cache folder

A shape is (D decode requests of C context tokens each, M prefill chunks of P tokens after S
tokens already cached). A visit brings the D decodes into the worker's persistent batch in an
unmeasured step (claimed as cached, so they cost no prefill), then `REPEATS` measured steps run
them as cached requests (one token each) together with M fresh P-token prefill requests. Up to
`MAX_SHAPES` shapes are drawn in the first half of the time and all are visited again in turn
until it is up; a shape's time is the median of all its measured steps. Load from other
processes comes in bursts longer than a visit, so visits spread over the whole run see the
machine as it is, neither one lucky moment nor one burst (the least and the median differed
by up to 2x on the shared machine this was written on; the file keeps both). Step time is
the worker's `execute` in-process: inputs, forward, LM head, sampling (greedy).

Candidate formulas, each least squares on relative residuals (a 5 ms step counts as much as a
500 ms one) with coefficients kept non-negative (a term that would fit negative is dropped):

    tokens        a + b*(prefill_tokens + decode_reqs)
    by kind       a + b*prefill_tokens + c*decode_reqs
    + context     ... + d*decode_context_tokens
    + attention   ... + e*prefill_attention_pairs

The one with the lowest 5-fold cross-validated RMS relative error is kept (a smaller one within
1% of it wins the tie); the file records every candidate's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ...engine_core.config import EngineConfig, resolve_max_model_len
from ...engine_core.cpu_threads import worker_env
from ...engine_core.step_cost import (
    FEATURES, StepCostModel, config_profile_key, plan_features, profile_path,
)

logger = logging.getLogger("tidal.frontend.tune")

REPEATS = 2
"""Measured steps per visit of a shape."""
MIN_SHAPES, MAX_SHAPES = 12, 60
"""Shapes measured (at least, at most)."""
CANDIDATES = {
    "tokens": ("prefill_tokens+decode_reqs",),
    "by kind": ("prefill_tokens", "decode_reqs"),
    "+ context": ("prefill_tokens", "decode_reqs", "decode_context_tokens"),
    "+ attention": FEATURES,
}
_TIE = 0.01  # a smaller formula within this much CV error of the best is preferred


# -- the parent: spawn, fit, save -----------------------------------------------------------


def profile(config: EngineConfig, duration_s: float = 60.0, seed: int = 0,
            output: str | None = None, max_decode_reqs: int | None = None,
            max_prefill_tokens: int | None = None,
            serving: bool = True) -> tuple[StepCostModel, str]:
    """Measure, fit and save; returns the model and where it was written. `serving`: then
    measure the serving terms through a real `tidal serve` with `config` too
    (`serving_profile.py`)."""
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: tidal tune profile measures one rank; TP > 1 "
                         "is not supported yet")
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    max_model_len = resolve_max_model_len(config)
    served_config, sched = config, config.scheduler
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        sched, max_num_seqs=max_decode_reqs or sched.max_num_seqs,
        max_num_batched_tokens=max(max_prefill_tokens or sched.max_num_batched_tokens,
                                   max_decode_reqs or sched.max_num_seqs)))
    worker_config = config.worker_config(0, max_model_len, "")
    samples, facts = _run_child(worker_config, duration_s, seed)
    model = fit_cost_model(samples, info={
        **facts, "key": config_profile_key(config), "max_model_len": max_model_len,
        "max_decode_reqs": config.scheduler.max_num_seqs,
        "max_prefill_tokens": config.scheduler.max_num_batched_tokens,
        "duration_s": duration_s, "created": time.time()})
    if serving:
        from .serving_profile import measure_serving_terms

        terms = measure_serving_terms(served_config, model)
        model = dataclasses.replace(
            model, request_latency_s=terms.request_latency_s,
            per_prompt_token_latency_s=terms.per_prompt_token_latency_s,
            per_step_overhead_s=terms.per_step_overhead_s,
            per_streamed_token_s=terms.per_streamed_token_s,
            per_arrival_s=terms.per_arrival_s,
            per_arrival_prompt_token_s=terms.per_prompt_token_latency_s,
            info={**model.info, "serving": terms.info})
    path = output or profile_path(config_profile_key(config))
    model.save(path)
    return model, path


def _run_child(worker_config, duration_s: float, seed: int) -> tuple[list[dict], dict]:
    from ...ipc.transport import encode_worker_config

    env = (worker_env(dict(os.environ), worker_config.cpu_threads)
           if worker_config.cpu_threads else dict(os.environ))
    with tempfile.TemporaryDirectory(prefix="tidal-profile-") as tmp:
        out = os.path.join(tmp, "samples.json")
        cmd = [sys.executable, "-m", "tidal.frontend.tune.profile", "--config",
               encode_worker_config(worker_config), "--duration", str(duration_s),
               "--seed", str(seed), "--output", out]
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the profiling worker failed (exit status {done.returncode})")
        with open(out, encoding="utf-8") as f:
            data = json.load(f)
    return data["samples"], data["facts"]


# -- fitting ----------------------------------------------------------------------------------


def _design(samples: list[dict], columns: tuple[str, ...]) -> np.ndarray:
    rows = []
    for s in samples:
        row = [1.0]
        for col in columns:
            row.append(sum(s[name] for name in col.split("+")))
        rows.append(row)
    return np.array(rows, dtype=np.float64)


def _nonneg_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise sum(((x @ c) - y) / y)^2 with c >= 0: drop any column that fits negative and
    refit (a small active-set loop; the columns are few)."""
    active = list(range(x.shape[1]))
    w = 1.0 / y
    while True:
        coef_active, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef_active >= 0).all() or len(active) == 1:
            coef = np.zeros(x.shape[1])
            coef[active] = np.maximum(coef_active, 0.0)
            return coef
        active.pop(int(np.argmin(coef_active)))


def _relative_rms(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((x @ coef) - y) ** 2 / y ** 2)))


def _cross_validated(x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0) -> float:
    order = np.random.default_rng(seed).permutation(len(y))
    errors = []
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        coef = _nonneg_relative_lstsq(x[train], y[train])
        errors.append(((x[test] @ coef) - y[test]) ** 2 / y[test] ** 2)
    return float(np.sqrt(np.mean(np.concatenate(errors))))


def fit_cost_model(samples: list[dict], info: dict | None = None) -> StepCostModel:
    """The best candidate formula fitted to `samples` (dicts of the four features and
    `seconds`); `info` is kept in the model with every candidate's errors."""
    if len(samples) < 10:
        raise ValueError(f"only {len(samples)} step shapes were measured; profile longer "
                         "(--duration)")
    y = np.array([s["seconds"] for s in samples], dtype=np.float64)
    table, fits = [], {}
    for name, columns in CANDIDATES.items():
        x = _design(samples, columns)
        coef = _nonneg_relative_lstsq(x, y)
        cv = _cross_validated(x, y)
        fits[name] = (columns, coef, cv)
        table.append({"formula": name, "terms": ["1", *columns],
                      "cv_rms_relative_error": round(cv, 4),
                      "fit_rms_relative_error": round(_relative_rms(x, y, coef), 4),
                      "median_abs_relative_error": round(float(np.median(
                          np.abs(x @ coef - y) / y)), 4)})
    best_cv = min(cv for _, _, cv in fits.values())
    chosen = next(name for name, (_, _, cv) in fits.items() if cv <= best_cv * (1 + _TIE))
    columns, coef, _ = fits[chosen]
    values = dict.fromkeys(FEATURES, 0.0)
    for col, c in zip(columns, coef[1:]):
        for name in col.split("+"):
            values[name] = float(c)
    info = dict(info or {})
    info.update(formula=chosen, candidates=table, num_shapes=len(samples),
                samples=[{k: round(v, 7) if isinstance(v, float) else v for k, v in s.items()}
                         for s in samples])
    return StepCostModel(float(coef[0]), values["prefill_tokens"], values["decode_reqs"],
                         values["decode_context_tokens"], values["prefill_attention_pairs"],
                         info=info)


def format_fit(model: StepCostModel) -> str:
    """The candidates' residuals and the chosen formula, for the terminal."""
    rows = model.info.get("candidates", [])
    width = max([len(" + ".join(r["terms"])) for r in rows] + [5]) + 2
    lines = [f"{'formula':<13}{'terms':<{width}}{'CV rms rel. error':>18}{'median':>8}"]
    for row in rows:
        mark = "  <- chosen" if row["formula"] == model.info.get("formula") else ""
        lines.append(f"{row['formula']:<13}{' + '.join(row['terms']):<{width}}"
                     f"{row['cv_rms_relative_error']:>18.1%}"
                     f"{row['median_abs_relative_error']:>8.1%}{mark}")
    lines.append(model.formula())
    return "\n".join(lines)


# -- the child: a Worker in this process ------------------------------------------------------


class _Shapes:
    """Random step shapes within the worker's limits and its KV cache."""

    DECODES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    PREFILLS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    CHUNKS = (1, 1, 2, 4, 8)
    """Prefill chunks (requests) in one step: several reach budgets past max_model_len."""

    def __init__(self, config, num_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.block_size = config.block_size
        self.max_len = config.max_model_len
        self.max_tokens = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.decodes = [d for d in self.DECODES if d <= config.max_num_seqs]
        self.num_blocks = num_blocks - 1  # block 0 is the null block

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def draw(self) -> tuple[int, int, int, int, int]:
        """(decodes, their context, prefill tokens per chunk, prefill offset, prefill chunks)
        that fit the step budget, max_num_seqs, the context length and the KV cache."""
        while True:
            d = self.rng.choice(self.decodes)
            m = self.rng.choice(self.CHUNKS)
            p = self.rng.choice([p for p in self.PREFILLS if p < self.max_len])
            if p == 0:
                m = 0
            if (d == 0 and p == 0) or d + m > self.max_seqs or d + m * p > self.max_tokens:
                continue
            c = int(round(2 ** self.rng.uniform(4, np.log2(max(self.max_len - REPEATS - 2,
                                                                  17)))))
            s = 0 if p == 0 or self.rng.random() < 0.5 else self.rng.randrange(
                0, max(1, self.max_len - p))
            need = d * self.blocks_for(c + REPEATS + 2) + m * self.blocks_for(s + p)
            if need <= self.num_blocks:
                return d, c, p, s, m


class _ShapeRunner:
    """Runs one visit of a shape on the worker: an unmeasured step that brings its decodes
    into the persistent batch (and drops the previous visit's requests), then `REPEATS`
    measured steps."""

    def __init__(self, worker, shapes: _Shapes, seed: int) -> None:
        from ...ipc.messages import SamplingParams

        self.worker = worker
        self.shapes = shapes
        self.vocab = min(worker.args.vocab_size, 1000)
        self.rng = random.Random(seed + 1)
        self.sampling = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
        self.step_id = 0
        self.visit = 0
        self.pending_finished: list[str] = []

    def _tokens(self, n: int) -> bytes:
        from ...ipc.messages import pack_token_ids

        return pack_token_ids([self.rng.randrange(3, self.vocab) for _ in range(n)])

    def _execute(self, plan) -> float:
        start = time.perf_counter()
        self.worker.execute(plan)
        return time.perf_counter() - start

    def run(self, shape: tuple[int, int, int, int, int]) -> tuple[list[float], tuple]:
        """(seconds of each measured step, the step's features)."""
        from ...ipc.messages import BatchPlan, CachedRequestData, NewRequestData

        d, c, p, s, m = shape
        self.visit += 1
        tag = f"v{self.visit}"
        blocks_each = self.shapes.blocks_for(c + REPEATS + 2)
        decodes = [NewRequestData(f"{tag}d{i}", self._tokens(c + 1), c + 1,
                                  list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
                                  c, 1, self.sampling) for i in range(d)]
        first, prefill_each = 1 + d * blocks_each, self.shapes.blocks_for(s + p)
        prefill_blocks = [list(range(first + j * prefill_each, first + (j + 1) * prefill_each))
                          for j in range(m)]
        self.step_id += 1
        self.worker.execute(BatchPlan(self.step_id, new_requests=decodes,
                                      finished_req_ids=self.pending_finished,
                                      total_num_scheduled_tokens=d))
        self.pending_finished = [r.req_id for r in decodes]
        times, features, previous = [], None, []
        for rep in range(REPEATS):
            new = [NewRequestData(f"{tag}p{rep}.{j}", self._tokens(s + p), s + p,
                                  prefill_blocks[j], s, p, self.sampling) for j in range(m)]
            cached = [CachedRequestData(r.req_id, [], c + 1 + rep, 1) for r in decodes]
            self.step_id += 1
            plan = BatchPlan(self.step_id, new_requests=new, cached_requests=cached,
                             finished_req_ids=previous, total_num_scheduled_tokens=d + m * p)
            times.append(self._execute(plan))
            features = features or plan_features(plan)
            previous = [r.req_id for r in new]
        self.pending_finished += previous
        return times, features

    def finish(self) -> None:
        from ...ipc.messages import BatchPlan

        self.step_id += 1
        self.worker.execute(BatchPlan(self.step_id, finished_req_ids=self.pending_finished))


def measure(worker, duration_s: float, seed: int) -> list[dict]:
    """Time step shapes for about `duration_s` seconds; one sample per shape.

    Shapes are drawn during the first half of the time (at most `MAX_SHAPES`), then visited
    again in turn until the time is up; a shape's time is the median of all its measured
    steps (see the module docstring)."""
    runner = _ShapeRunner(worker, _Shapes(worker.config, worker.num_kv_blocks, seed), seed)
    for _ in range(3):  # warm-up: first runs of each code path
        runner.run(runner.shapes.draw())
    shapes: list[tuple] = []
    times: list[list[float]] = []
    features: list[tuple] = []
    start = time.perf_counter()
    turn = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= duration_s and len(shapes) >= MIN_SHAPES:
            break
        if len(shapes) < MAX_SHAPES and (elapsed < duration_s / 2 or len(shapes) < MIN_SHAPES):
            shapes.append(runner.shapes.draw())
            times.append([])
            features.append(())
            i = len(shapes) - 1
        else:
            i = turn % len(shapes)
            turn += 1
        step_times, features[i] = runner.run(shapes[i])
        times[i] += step_times
    runner.finish()
    return [dict(zip(FEATURES, f), seconds=statistics.median(t), min_seconds=min(t),
                 num_steps=len(t), shape=list(shape))
            for shape, t, f in zip(shapes, times, features)]


def _child_main(argv: list[str] | None = None) -> int:
    from ...ipc.transport import decode_worker_config

    ap = argparse.ArgumentParser(description="tidal tune profile: the measuring worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    config = decode_worker_config(args.config)
    if config.cpu_cores:
        os.sched_setaffinity(0, config.cpu_cores)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s [tidal tune profile] %(message)s")
    import torch

    from ...workers.worker import Worker

    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    worker = Worker(config)
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    print(f"profiling {config.model} on {worker.device} ({worker.dtype}, "
          f"{torch.get_num_threads()} threads) for {args.duration:g} s ...", flush=True)
    samples = measure(worker, args.duration, args.seed)
    facts = {"model": config.model, "device": str(worker.device),
             "dtype": str(worker.dtype).replace("torch.", ""),
             "threads": torch.get_num_threads(),
             "kv_block_bytes": worker.runner.kv_block_bytes,
             "num_kv_blocks": worker.num_kv_blocks, "block_size": config.block_size,
             "attention_backend": worker.runner.attention_backend.name}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"samples": samples, "facts": facts}, f)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
