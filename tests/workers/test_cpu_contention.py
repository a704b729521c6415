"""Issue 38 item 3: a CPU worker notices when other processes take its cores (run-queue wait
from /proc/self/task/*/schedstat), says so in its log, and with `cpu_wait_policy=auto` runs on
fewer threads until the cores are free, its tokens bit for bit the same."""

import logging

import pytest
import torch

from tidal.ipc.messages import SamplingParams
from tidal.workers.cpu_contention import (
    ADAPT_WINDOW_S,
    FIRST_PROBE_S,
    MAX_PROBE_S,
    WINDOW_S,
    CpuContention,
    apply_wait_policy,
    idle_cores_s,
    runqueue_wait_s,
    set_intra_op_threads,
)
from worker_test_utils import PlanScript, loaded_worker, prompt_ids

LOGGER = "tidal.workers.cpu_contention"


def test_this_process_wait_is_readable():
    wait = runqueue_wait_s()
    assert wait is None or wait >= 0.0  # None only where Linux keeps no schedstat


def test_it_warns_once_when_threads_wait_for_cpus(caplog):
    waits = iter([0.0, 2.0, 2.0 + 0.9 * 2 * WINDOW_S, 100.0, 200.0])
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monitor = CpuContention(rank=0, threads=2, read_wait=lambda: next(waits),
                            clock=lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.step(WINDOW_S / 2)
        monitor.step(WINDOW_S / 2)  # window 1: 2 s of waiting over 2 x 10 s: 10%, quiet
        assert monitor.last_share == 0.1 and not caplog.records
        monitor.step(WINDOW_S)  # window 2: 90% of the threads' time spent waiting
        assert monitor.last_share == 0.9
        monitor.step(WINDOW_S)  # again, but within REPEAT_S: no second warning
    (record,) = caplog.records
    assert "steps are slowed by other processes on these cores" in record.getMessage()
    assert "waited for a CPU 90% of their step time" in record.getMessage()
    assert "--cpu-wait-policy auto" in record.getMessage()
    assert monitor.threads == 2  # spin and passive only warn


def test_nothing_where_linux_keeps_no_schedstat():
    monitor = CpuContention(rank=0, threads=2, read_wait=lambda: None,
                            set_threads=lambda n: pytest.fail("changed threads"))
    monitor.step(2 * WINDOW_S)
    assert monitor.last_share is None


WALL_S = 0.25
"""Wall-clock seconds of one scripted window (ADAPT_WINDOW_S of step time, and the gaps
between steps): a binary fraction, so that sums of them are exact."""


class Machine:
    """Scripted run-queue wait and clock: each window, the share of the threads' step time
    they waited, and the seconds of wall clock it took."""

    def __init__(self):
        self.wait = 0.0
        self.idle = 0.0
        self.now = 0.0
        self.counts: list[int] = []

    def monitor(self, threads: int) -> CpuContention:
        self.rank = CpuContention(rank=0, threads=threads, read_wait=lambda: self.wait,
                                  clock=lambda: self.now, set_threads=self.counts.append,
                                  read_idle=lambda: self.idle)
        return self.rank

    def window(self, share: float, idle_cores: float = 0.0, wall_s: float = WALL_S) -> int:
        """One adapting window: the rank's threads waited `share` of their step time and
        `idle_cores` cores were idle on average; the thread count after it."""
        self.wait += share * ADAPT_WINDOW_S * self.rank.threads
        self.idle += idle_cores * wall_s
        self.now += wall_s
        self.rank.step(ADAPT_WINDOW_S)
        return self.rank.threads


def test_auto_halves_its_threads_while_the_cores_are_taken_and_warns_what_to_do(caplog):
    machine = Machine()
    machine.monitor(threads=8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert machine.window(0.05) == 8  # a quiet machine: no change
        assert machine.window(0.6) == 4
        assert machine.window(0.4) == 2
        assert machine.window(0.3) == 1
        assert machine.window(0.9) == 1  # never below one
    assert machine.counts == [4, 2, 1]
    (record,) = caplog.records  # one warning, not one per window
    text = record.getMessage()
    assert "other processes are taking these cores" in text
    assert "--cpu-wait-policy passive" in text and "--cpu-threads" in text


def test_auto_tries_the_full_count_again_once_the_cores_it_gave_up_are_idle():
    machine = Machine()
    machine.monitor(threads=2)
    assert machine.window(0.9) == 1
    for _ in range(40):  # one busy loop on the other core: one thread waits for nobody,
        assert machine.window(0.0, idle_cores=0.0) == 1  # but the core it gave up is taken
    quiet_windows = 1  # the loop ends: from here on, a core is idle
    while machine.window(0.0, idle_cores=1.0) == 1:
        quiet_windows += 1
    # it looks over periods of FIRST_PROBE_S: the first whole one that is idle, it tries
    assert FIRST_PROBE_S <= quiet_windows * WALL_S <= 2 * FIRST_PROBE_S
    assert machine.window(0.0) == 2 and machine.counts == [1, 2]  # and it holds


def test_a_try_that_finds_the_cores_taken_waits_twice_as_long_before_the_next():
    """A neighbour that comes and goes: the rank tries again after 2, 4, 8 ... s of idle
    cores, at most MAX_PROBE_S, not every time they look free."""
    machine = Machine()
    machine.monitor(threads=2)
    machine.window(0.9)
    waits = []
    for _ in range(7):
        quiet_s = 0.0
        while machine.window(0.0, idle_cores=1.0) == 1:
            quiet_s += WALL_S
        waits.append(quiet_s + WALL_S)
        assert machine.window(0.8) == 1  # two threads: taken at once, back to one
    assert waits == [FIRST_PROBE_S * 2 ** k for k in range(5)] + [MAX_PROBE_S] * 2
    while machine.window(0.0, idle_cores=1.0) == 1:  # the neighbour leaves for good:
        pass
    machine.window(0.0)  # the next try holds
    assert machine.rank.probe_after_s == FIRST_PROBE_S and machine.rank.threads == 2


def test_this_machine_idle_time_is_readable():
    idle = idle_cores_s()
    assert idle is None or idle >= 0.0


def test_passive_sets_the_wait_policy_unless_the_user_did():
    env = {}
    apply_wait_policy("passive", env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    apply_wait_policy("passive", env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    for policy in ("auto", "spin"):
        env = {}
        apply_wait_policy(policy, env)
        assert env == {}


def sampled(worker, threads_per_step: list[int]) -> list[tuple]:
    """Three requests (prompts of 3, 40 and 17 tokens) prefilled, then decoded greedily, step
    k on threads_per_step[k] threads; each step's tokens, their top-20 logprobs and the
    prompts' (a float32 log_softmax of every logit row, so a changed bit in a logit shows)."""
    script = PlanScript()
    for i, n in enumerate((3, 40, 17)):
        script.add(f"r{i}", prompt_ids(seed=i, n=n), SamplingParams(
            temperature=0.0, max_tokens=len(threads_per_step), ignore_eos=True, logprobs=20,
            prompt_logprobs=20))
    steps = []
    for threads in threads_per_step:
        set_intra_op_threads(threads)
        result = worker.runner.execute(script.plan())
        script.record(result)
        steps.append((result.req_ids, result.token_ids.tolist(), result.logprobs,
                      result.prompt_logprobs))
    assert not script.requests
    worker.runner.execute(script.plan())  # tells the runner they finished
    return steps


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_changing_the_thread_count_between_steps_keeps_logits_bit_exact(tiny_llama, backend):
    """What `auto` does under contention (2 -> 1 -> 2 threads between steps) samples the same
    tokens with the same logprobs, bit for bit, as a rank that kept two threads: each
    parallel loop of the CPU path splits rows or requests among the threads, never one sum."""
    worker = loaded_worker(tiny_llama, "float32", attention_backend=backend)
    steady = sampled(worker, [2] * 6)
    switching = sampled(worker, [1, 2, 1, 1, 2, 1])
    set_intra_op_threads(1)  # this folder's tests run on one thread (conftest.py)
    assert switching == steady
