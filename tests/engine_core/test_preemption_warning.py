"""The preemption warning: the text users know, advice from the current numbers, a rate limit
that never loses count."""

import logging

from sched_utils import FakeWorker, make_request, make_scheduler, step

LOGGER = "tidal.engine_core.scheduler"


def _pressured_scheduler():
    """11 blocks (10 usable, 160 tokens), budget 512 tokens, max_num_seqs 256. Three 50-token
    prompts of 4 blocks each: two are admitted (8 blocks), the third waits; once the first
    two pass 64 tokens each needs a 5th block and only 2 are free: preemptions follow."""
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(make_request(i, 50, max_tokens=60))
    return sched


def test_warning_text_and_advice(caplog):
    """The first preemption logs the familiar sentence, the pool's numbers (10 blocks of 16 =
    160 tokens; how many were running) and which flags to change in which direction."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sched = _pressured_scheduler()
    worker = FakeWorker(16)
    while sched.num_preemptions == 0:
        step(sched, worker)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    msg = record.getMessage()
    assert record.levelno == logging.WARNING
    assert msg.startswith("Request 1 is preempted by PreemptionMode.RECOMPUTE mode because "
                          "there is not enough KV cache space.")
    assert "10 blocks of 16 tokens (160 tokens, 100% in use) for 2 running requests" in msg
    assert "increase --gpu-memory-utilization (now 0.92, e.g. to 0.96)" in msg
    assert "decrease --max-num-seqs (now 256, 2 were running; e.g. to 1)" in msg
    assert "decrease --max-num-batched-tokens (now 512, e.g. to 256)" in msg
    assert "increase --tensor-parallel-size (now 1, e.g. to 2) or --pipeline-parallel-size " \
        "(now 1, e.g. to 2)" in msg
    assert "`tidal tune` picks these settings for your traffic" in msg
    assert "Preemptions so far: 1" in msg


def test_warning_rate_limit_keeps_exact_count(caplog):
    """A storm of preemptions within one interval logs one warning; the counter stays exact;
    the next warning after the interval says how many were left out."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sched = _pressured_scheduler()
    now = [100.0]
    sched.clock = lambda: now[0]
    worker = FakeWorker(16)
    while sched.has_unfinished_requests():
        step(sched, worker)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert sched.num_preemptions >= 2
    assert len(records) == 1
    assert sched.preemption_log.num_suppressed == sched.num_preemptions - 1
    assert sched.stats().num_preemptions == sched.num_preemptions

    suppressed = sched.preemption_log.num_suppressed
    before = sched.num_preemptions
    now[0] += sched.preemption_log.interval_s
    for i in range(3, 6):
        sched.add(make_request(i, 50, max_tokens=60))
    while sched.num_preemptions == before:
        step(sched, worker)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 2
    assert f"({suppressed} not logged in the last 10 s)" in records[1].getMessage()
