"""CPU cost of the scheduler: one schedule() + update() per step, no model.

    python benchmarks/scheduler.py [--steps 200] [--sizes 64 256 1024]

Cases:
- decode N: N requests all decoding (one token each per step), the steady state of a busy
  server; reports microseconds per step and per request.
- chunked admission: 256 requests with distinct 2048-token prompts arrive at once; the default
  2048-token budget admits them in chunks while admitted ones decode; prefix caching on (every
  full block is hashed and published). Timed from the first step until all are decoding.

Times are CPU time of this process (time.process_time), so other load on the machine does not
inflate them. The fabricated worker result (SampledTokens) is built outside the timed region.
"""

from __future__ import annotations

import argparse
import random
import time

from tidal.engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import BatchPlan, SampledTokens


_clock = time.process_time  # CPU time of this process: robust to other load on the machine


def _scheduler(max_num_seqs: int, num_blocks: int, max_model_len: int,
               budget: int) -> Scheduler:
    config = EngineConfig(
        model=ModelConfig("bench"),
        cache=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))
    return Scheduler(config, num_blocks, max_model_len)


def _fake_result(plan: BatchPlan, sched: Scheduler) -> SampledTokens:
    """Every request whose scheduled range reached its end sampled token 7."""
    req_ids = [n.req_id for n in plan.new_requests
               if n.num_computed_tokens + n.num_scheduled_tokens >= len(n.token_ids) // 4]
    req_ids += [c.req_id for c in plan.cached_requests
                if sched.requests.get(c.req_id) is None
                or c.num_computed_tokens + c.num_scheduled_tokens
                >= sched.requests[c.req_id].num_prompt_tokens]
    return SampledTokens(plan.step_id, req_ids, pack_token_ids([7] * len(req_ids)))


def _add_requests(sched: Scheduler, num: int, prompt_len: int, rng: random.Random) -> None:
    sampling = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num):
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        sched.add(Request(f"req-{i}", prompt, sampling, client_id="bench"))


def _timed_steps(sched: Scheduler, num_steps: int) -> tuple[float, int]:
    """Run steps; returns (seconds inside schedule+update, scheduled requests total)."""
    elapsed, num_scheduled = 0.0, 0
    for _ in range(num_steps):
        t0 = _clock()
        plan = sched.schedule()
        t1 = _clock()
        sampled = _fake_result(plan, sched)
        t2 = _clock()
        sched.update(plan, sampled)
        t3 = _clock()
        elapsed += (t1 - t0) + (t3 - t2)
        num_scheduled += len(plan.new_requests) + len(plan.cached_requests)
    return elapsed, num_scheduled


def bench_decode(num_requests: int, num_steps: int) -> str:
    sched = _scheduler(num_requests, num_blocks=num_requests * 40 + 1, max_model_len=4096,
                       budget=max(2048, num_requests))
    _add_requests(sched, num_requests, 128, random.Random(0))
    while len(sched.running) < num_requests or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        _timed_steps(sched, 1)  # prefill, untimed
    _timed_steps(sched, 5)  # warm-up
    elapsed, num_scheduled = _timed_steps(sched, num_steps)
    per_step = elapsed / num_steps * 1e6
    return (f"decode {num_requests:>5} running: {per_step:9.1f} us/step  "
            f"{elapsed / num_scheduled * 1e6:6.2f} us/request")


def bench_chunked_admission(num_requests: int = 256, prompt_len: int = 2048) -> str:
    sched = _scheduler(256, num_blocks=num_requests * (prompt_len // 16 + 32) + 1,
                       max_model_len=4096, budget=2048)
    _add_requests(sched, num_requests, prompt_len, random.Random(1))
    elapsed, num_scheduled, num_steps = 0.0, 0, 0
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
        e, n = _timed_steps(sched, 1)
        elapsed, num_scheduled, num_steps = elapsed + e, num_scheduled + n, num_steps + 1
    return (f"chunked admission {num_requests}x{prompt_len} tokens, prefix caching on: "
            f"{num_steps} steps, {elapsed / num_steps * 1e6:9.1f} us/step  "
            f"{elapsed / num_scheduled * 1e6:6.2f} us/scheduled request  "
            f"{elapsed / num_requests * 1e3:6.2f} ms/admitted request")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args(argv)
    for size in args.sizes:
        print(bench_decode(size, args.steps), flush=True)
    print(bench_chunked_admission(), flush=True)


if __name__ == "__main__":
    main()
