"""The step cost model measured: worker steps timed in a child process, the formula fitted.

    parent (no torch)                          child: python -m tidal.workers.step_profile
    engine flags -> WorkerConfig  ── spawn ──► Worker(config) of rank 0: load, KV cache, then
    (the environment a serving worker gets:    for about --duration seconds run random step
    OMP threads, wait policy, core mask)       shapes fed as BatchPlans, time each `execute`
    features of each shape's plan entries ◄─ JSON ── (plan entries, seconds) per shape
    fit the formulas (least squares)

How the shapes are drawn and timed is the child's (`workers/step_profile.py`); what a step's
features are is the step cost model's (`chunk_features`), applied here to the plan entries
the child reports. `tidal tune profile` (`frontend/tune/cli.py`) adds the serving terms it
measures through a real server (`frontend/tune/serving_profile.py`) and saves the model.

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

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..config import EngineConfig, resolve_max_model_len
from ..cpu_threads import worker_env
from .step_cost import FEATURES, StepCostModel, chunk_features, config_profile_key

MEASURING_MODULE = "tidal.workers.step_profile"
"""The child process that builds the Worker and times the shapes."""
CANDIDATES = {
    "tokens": ("prefill_tokens+decode_reqs",),
    "by kind": ("prefill_tokens", "decode_reqs"),
    "+ context": ("prefill_tokens", "decode_reqs", "decode_context_tokens"),
    "+ attention": FEATURES,
}
_TIE = 0.01  # a smaller formula within this much CV error of the best is preferred


# -- the parent: spawn and fit ----------------------------------------------------------------


def profile_steps(config: EngineConfig, duration_s: float = 60.0, seed: int = 0,
                  max_decode_reqs: int | None = None,
                  max_prefill_tokens: int | None = None) -> StepCostModel:
    """Time worker steps of `config` for about `duration_s` seconds (at most
    `max_decode_reqs` decodes and `max_prefill_tokens` prompt tokens a step, else the config's
    limits) and fit the step cost model (no serving terms)."""
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: tidal tune profile measures one rank; TP > 1 "
                         "is not supported yet")
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    max_model_len = resolve_max_model_len(config)
    sched = config.scheduler
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        sched, max_num_seqs=max_decode_reqs or sched.max_num_seqs,
        max_num_batched_tokens=max(max_prefill_tokens or sched.max_num_batched_tokens,
                                   max_decode_reqs or sched.max_num_seqs)))
    worker_config = config.worker_config(0, max_model_len, "")
    samples, facts = _run_child(worker_config, duration_s, seed)
    return fit_cost_model(samples, info={
        **facts, "key": config_profile_key(config), "max_model_len": max_model_len,
        "max_decode_reqs": config.scheduler.max_num_seqs,
        "max_prefill_tokens": config.scheduler.max_num_batched_tokens,
        "duration_s": duration_s, "created": time.time()})


def _run_child(worker_config, duration_s: float, seed: int) -> tuple[list[dict], dict]:
    from ...ipc.transport import encode_worker_config

    env = (worker_env(dict(os.environ), worker_config.cpu_threads)
           if worker_config.cpu_threads else dict(os.environ))
    with tempfile.TemporaryDirectory(prefix="tidal-profile-") as tmp:
        out = os.path.join(tmp, "samples.json")
        cmd = [sys.executable, "-m", MEASURING_MODULE, "--config",
               encode_worker_config(worker_config), "--duration", str(duration_s),
               "--seed", str(seed), "--output", out]
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the profiling worker failed (exit status {done.returncode})")
        with open(out, encoding="utf-8") as f:
            data = json.load(f)
    return [_features(sample) for sample in data["samples"]], data["facts"]


def _features(sample: dict) -> dict:
    """A measured shape as the fit takes it: the step cost model's features of its plan
    entries (`[num_computed, num_scheduled, count]`), its seconds and the rest as measured."""
    totals = [0.0] * len(FEATURES)
    for computed, scheduled, count in sample["entries"]:
        for i, value in enumerate(chunk_features(computed, scheduled)):
            totals[i] += count * value
    features = {name: int(v) if name != "prefill_attention_pairs" else v
                for name, v in zip(FEATURES, totals)}
    return {**features, **{k: v for k, v in sample.items() if k != "entries"}}


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
