"""Where the advisory wing meets the step loop: its observers of an engine core, built once
from the config by the daemon (`observers_for`) and told what the loop does through the one
interface the core offers (`core.EngineObserver`).

- With `--max-queue-delay`, the queue estimate (`queue_estimate.py`): each request added and
  each plan's time at the workers feed it; each stats snapshot gets its estimate of a new
  request's wait. Without a step cost model the flag is refused (`ValueError`), before the
  engine core binds its socket.
- With a step cost model for this config, the preemption advisor (`preemption_advice.py`): it
  keeps the requests added, counts the preemptions, and on the daemon's ticks decides when a
  spell is over, runs the simulator's child process and collects its answer.
"""

from __future__ import annotations

import logging

from ..config import EngineConfig
from ..core import EngineObserver
from ..request import Request
from ..scheduler import Scheduler
from .preemption_advice import PreemptionAdvisor
from .queue_estimate import QueueDelayEstimator
from .step_cost import StepCostModel, find_profile, required_profile
from ...ipc.frontend_messages import SchedulerStats
from ...ipc.worker_messages import BatchPlan


def observers_for(config: EngineConfig, logger: logging.Logger) -> list[EngineObserver]:
    """The wing's observers of an engine core with `config` (see the module docstring), not
    yet attached to a scheduler. ValueError: --max-queue-delay without a step cost model."""
    observers: list[EngineObserver] = []
    estimator = queue_estimator(config, logger)
    if estimator is not None:
        observers.append(QueueDelayObserver(estimator))
    path = advice_cost_model(config, logger)
    if path is not None:
        observers.append(PreemptionAdviceObserver(config, path, logger))
        if config.scheduler.speculative_config is not None:
            observers.append(SpeculationCostObserver(StepCostModel.load(path), logger))
    return observers


def queue_estimator(config: EngineConfig,
                    logger: logging.Logger) -> QueueDelayEstimator | None:
    """With --max-queue-delay, the estimator over the step cost model; ValueError when there
    is no cost model (the flag is refused rather than guessed: a step time is a property of
    the machine and model that no built-in constant gets right)."""
    if config.scheduler.max_queue_delay is None:
        return None
    path = required_profile(config)
    model = StepCostModel.load(path)
    logger.info("--max-queue-delay %gs: step cost model %s (%s)",
                config.scheduler.max_queue_delay, path, model.formula())
    return QueueDelayEstimator(model)


def advice_cost_model(config: EngineConfig, logger: logging.Logger) -> str | None:
    """The step cost model file the preemption advisor simulates with, or None (the
    preemption warning then says how to get one). A file the simulator could not read is
    said at once, not after the first spell."""
    path = find_profile(config)
    if path is None:
        return None
    try:
        StepCostModel.load(path)
    except ValueError as e:
        logger.warning("no simulation after preemptions: %s", e)
        return None
    return path


class SpeculationCostObserver(EngineObserver):
    """Speculative decoding's adaptive policy prices drafts with the step cost model
    `tidal tune profile` measured for this machine and model (without one it uses
    `spec_decode.CostTerms`' defaults)."""

    def __init__(self, model: StepCostModel, logger: logging.Logger) -> None:
        self.model = model
        self.logger = logger

    def attach(self, scheduler: Scheduler) -> None:
        if scheduler.use_step_cost_model(self.model):
            self.logger.info("speculative decoding: drafts priced by the step cost model (%s)",
                             self.model.formula())


class QueueDelayObserver(EngineObserver):
    """`--max-queue-delay`: the estimate of a new request's wait in every stats snapshot."""

    def __init__(self, estimator: QueueDelayEstimator) -> None:
        self.estimator = estimator
        self.scheduler: Scheduler | None = None

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def request_added(self, request: Request, now: float) -> None:
        # its intake slows the steps meanwhile
        self.estimator.note_arrival(request.num_prompt_tokens, now)

    def step_ran(self, plan: BatchPlan, seconds: float, now: float) -> None:
        self.estimator.note_step(plan, seconds)

    def stats(self, stats: SchedulerStats, now: float) -> None:
        est = self.estimator.estimate(self.scheduler, now)
        stats.est_queue_delay_s = est.queue_delay_s
        stats.est_s_per_prompt_token = est.s_per_prompt_token
        stats.est_s_per_queued_request = est.s_per_queued_request


class PreemptionAdviceObserver(EngineObserver):
    """The preemption advisor over the attached scheduler (its KV blocks, context length and
    preemption log), polled on the daemon's ticks with the preemptions counted so far."""

    def __init__(self, config: EngineConfig, step_cost_model: str,
                 logger: logging.Logger) -> None:
        self.config = config
        self.step_cost_model = step_cost_model
        self.logger = logger
        self.advisor: PreemptionAdvisor | None = None
        self.num_preemptions = 0

    def attach(self, scheduler: Scheduler) -> None:
        self.advisor = PreemptionAdvisor(self.config, scheduler.num_kv_blocks,
                                         scheduler.max_model_len, self.step_cost_model,
                                         scheduler.preemption_log, self.logger)

    def request_added(self, request: Request, now: float) -> None:
        self.advisor.added(request)

    def preempted(self, num_requests: int, now: float) -> None:
        self.num_preemptions += num_requests

    def tick(self, now: float) -> None:
        self.advisor.poll(self.num_preemptions, now)

    def close(self) -> None:
        if self.advisor is not None:
            self.advisor.close()
