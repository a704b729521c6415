"""The preemption warning: the text users know, advice computed from the current numbers, and
a rate limit so a preemption storm cannot flood the log (the scheduler's counter stays exact).
"""

from __future__ import annotations

import logging
import time

from .config import EngineConfig
from .request import Request


class PreemptionLog:
    """Logs the first preemption at once, then at most one warning per `interval_s`; each
    warning says how many were left out since the previous one."""

    def __init__(self, logger: logging.Logger, config: EngineConfig, num_kv_blocks: int,
                 interval_s: float = 10.0) -> None:
        self.logger = logger
        self.config = config
        self.num_kv_blocks = num_kv_blocks
        self.interval_s = interval_s
        """Seconds between two warnings; preemptions in between are only counted."""
        self.num_suppressed = 0
        """Preemptions not logged since the last warning."""
        self._last_time: float | None = None
        self._predicting = False
        """A `PreemptionAdvisor` will simulate the traffic (there is a step cost model)."""
        self._prediction: str | None = None
        """The advisor's latest summary, with the wall-clock time it came."""

    def expect_predictions(self, on: bool) -> None:
        """Whether a `PreemptionAdvisor` watches this engine: warnings then say a prediction
        will come."""
        self._predicting = on

    def set_prediction(self, summary: str, wall_time: float) -> None:
        """The advisor's latest summary; quoted by the warnings from now on."""
        stamp = time.strftime("%H:%M:%S", time.localtime(wall_time))
        self._prediction = f"At {stamp} {summary}"

    def record(self, victim: Request, num_lost_tokens: int, num_running: int, usage: float,
               num_preemptions: int, now: float) -> None:
        """One preemption happened; log it unless a warning went out less than interval_s
        ago. `num_running` counts the victim (running when it was picked)."""
        if self._last_time is not None and now - self._last_time < self.interval_s:
            self.num_suppressed += 1
            return
        suppressed, self.num_suppressed = self.num_suppressed, 0
        self._last_time = now
        self.logger.warning(self.message(victim, num_lost_tokens, num_running, usage,
                                         num_preemptions, suppressed))

    def message(self, victim: Request, num_lost_tokens: int, num_running: int, usage: float,
                num_preemptions: int, num_suppressed: int) -> str:
        """The warning text: what happened, the numbers, and which flags to change."""
        cache = self.config.cache
        num_usable = self.num_kv_blocks - 1
        capacity = num_usable * cache.block_size
        head = (f"Request {victim.req_id} is preempted by PreemptionMode.RECOMPUTE mode because "
                f"there is not enough KV cache space. This can affect the end-to-end "
                f"performance. ")
        numbers = (f"The KV cache has {num_usable} blocks of {cache.block_size} tokens "
                   f"({capacity} tokens, {usage:.0%} in use) for {num_running} running "
                   f"requests; {num_lost_tokens} computed tokens of this request will be "
                   f"recomputed. Preemptions so far: {num_preemptions}")
        if num_suppressed:
            numbers += (f" ({num_suppressed} not logged in the last {self.interval_s:g} s)")
        return head + numbers + ". " + self.advice(num_running) + "."

    def advice(self, num_running: int) -> str:
        """Concrete flag changes, in the direction that relieves KV pressure."""
        cache, sched = self.config.cache, self.config.scheduler
        tp = self.config.parallel.tensor_parallel_size
        tips = []
        util = cache.gpu_memory_utilization
        if util < 0.98:
            tips.append(f"increase --gpu-memory-utilization (now {util:g}, e.g. to "
                        f"{min(0.98, round(util + 0.04, 2)):g})")
        if cache.kv_cache_memory is not None:
            tips.append(f"increase --kv-cache-memory (now {cache.kv_cache_memory} bytes)")
        else:
            tips.append("on CPU, set a larger --kv-cache-memory")
        fewer_seqs = max(1, min(sched.max_num_seqs, num_running) - 1)
        tips.append(f"decrease --max-num-seqs (now {sched.max_num_seqs}, {num_running} were "
                    f"running; e.g. to {fewer_seqs})")
        fewer_tokens = max(sched.max_num_seqs, sched.max_num_batched_tokens // 2)
        if fewer_tokens < sched.max_num_batched_tokens:
            tips.append(f"decrease --max-num-batched-tokens (now "
                        f"{sched.max_num_batched_tokens}, e.g. to {fewer_tokens})")
        pp = self.config.parallel.pipeline_parallel_size
        tips.append(f"increase --tensor-parallel-size (now {tp}, e.g. to {tp * 2}) or "
                    f"--pipeline-parallel-size (now {pp}, e.g. to {pp * 2}) to spread the KV "
                    f"cache over more devices")
        return ("To avoid it: " + "; or ".join(tips) + ". " + self.simulator_note())

    def simulator_note(self) -> str:
        """What the simulator said of this traffic, or when it will, or how to get it."""
        if self._prediction is not None:
            return self._prediction
        if self._predicting:
            return ("The simulator will replay this traffic with each change on the step cost "
                    "model once this spell of preemptions is over, and say which helps")
        return ("`tidal tune` picks these settings for your traffic by simulating this "
                "scheduler on a request trace (record one with `tidal serve --record-trace "
                "FILE`); after `tidal tune profile` with these engine flags, these warnings "
                "say what the simulator predicts for the traffic that preempted")
