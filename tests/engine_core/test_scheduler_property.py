"""Property test: random workloads through schedule()/update() with a fake worker.

Random: arrivals over time, prompt and output lengths, tiny to large block pools, shared
prefixes, both policies, chunked prefill on/off, prefix caching on/off, async scheduling (0-2
plans in flight), random aborts, EOS / stop tokens / min_tokens, prompt logprobs. After every
step: the token budget and max_num_seqs hold, every block is free or owned with the right
reference count, each request is in exactly one queue (`check_invariants()`); the fake worker
checks that every
position's KV holds the right token before it samples, and that no request asking for prompt
logprobs starts from a prefix-cache hit. At the end: every request that was not aborted
produced exactly the tokens of an unconstrained run, every request got exactly one final
output (its last), prompt logprobs came once with the first token and cover the prompt, and
no block leaked.
"""

import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_utils import (
    FakeWorker, fake_model, fake_prompt_logprob, make_request, make_scheduler, reference_tokens,
    unpack_prompt_logprobs,
)

from tidal.ipc.frontend_messages import FinishReason
from tidal.ipc.messages import unpack_token_ids

VOCAB = 40
EOS = 0


def small_model(tokens):
    return fake_model(tokens, VOCAB)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8, 16]))
    max_model_len = draw(st.integers(24, 96))
    num_blocks = -(-max_model_len // block_size) + 1 + draw(
        st.sampled_from([0, 0, 1, 2, 4, 40, 400]))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, max(low, 2 * max_model_len)))
    config = dict(
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        chunked=chunked, caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        threshold=draw(st.sampled_from([0, 0, 3, 16])), max_model_len=max_model_len,
        num_blocks=num_blocks)
    prefixes = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=8, max_size=40))
                for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = prefixes[draw(st.integers(0, 1))] if draw(st.booleans()) else []
        tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=30))
        prompt = (prefix + tail)[:max_model_len - 1]
        max_tokens = draw(st.integers(1, 40))
        requests.append(dict(
            req_id=f"r{i}", prompt=prompt, max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens))),
            eos=EOS, ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=1)),
            priority=draw(st.integers(0, 3)), arrival=draw(st.integers(0, 8)),
            abort_at=draw(st.one_of(st.none(), st.none(), st.integers(0, 40))),
            prompt_logprobs=draw(st.sampled_from([None, None, 0, 2]))))
    depth = draw(st.sampled_from([0, 1, 2]))  # plans in flight beyond the one just made
    return config, requests, depth


def _run(config, requests, depth):
    sched = make_scheduler(async_scheduling=depth > 0, **config)
    worker = FakeWorker(config["block_size"], model=small_model)
    by_step = {}
    for spec in requests:
        by_step.setdefault(spec["arrival"], []).append(spec)
    outputs = {spec["req_id"]: [] for spec in requests}
    aborted = set()
    inflight = []
    t = 0

    def collect(out):
        for client_outputs in out.values():
            for o in client_outputs:
                outputs[o.req_id].append(o)

    while t <= 12 or sched.has_unfinished_requests() or inflight:
        assert t < 4000, "no progress"
        for spec in by_step.get(t, []):
            sched.add(make_request(
                spec["req_id"], spec["prompt"], max_tokens=spec["max_tokens"],
                min_tokens=spec["min_tokens"], eos=spec["eos"], ignore_eos=spec["ignore_eos"],
                stop_token_ids=spec["stop_token_ids"], priority=spec["priority"],
                arrival_time=float(t), prompt_logprobs=spec["prompt_logprobs"]))
        for spec in requests:
            if spec["abort_at"] == t and spec["req_id"] in sched.requests:
                aborted.add(spec["req_id"])
                collect(sched.abort([spec["req_id"]]))
        planned = False
        if sched.has_unfinished_requests():
            plan = sched.schedule()
            _check_plan(plan, sched, config)
            inflight.append((plan, worker.execute(plan)))
            planned = True
        sched.check_invariants()
        if inflight and (len(inflight) > depth or not planned):
            collect(sched.update(*inflight.pop(0)))
            sched.check_invariants()
        t += 1
    return sched, outputs, aborted


def _check_plan(plan, sched, config):
    counts = [n.num_scheduled_tokens for n in plan.new_requests]
    counts += [c.num_scheduled_tokens for c in plan.cached_requests]
    assert all(n > 0 for n in counts)
    assert sum(counts) == plan.total_num_scheduled_tokens <= config["max_num_batched_tokens"]
    assert len(counts) <= config["max_num_seqs"]
    assert len(sched.running) <= config["max_num_seqs"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(workload):
    logging.getLogger("tidal.engine_core.scheduler").setLevel(logging.ERROR)
    config, requests, depth = workload
    sched, outputs, aborted = _run(config, requests, depth)
    for spec in requests:
        outs = outputs[spec["req_id"]]
        finals = [o for o in outs if o.finish_reason is not None]
        assert len(finals) == 1 and outs[-1] is finals[0], spec["req_id"]
        tokens = [t for o in outs for t in unpack_token_ids(o.new_token_ids)]
        _check_prompt_logprobs(spec, outs)
        if finals[0].finish_reason == FinishReason.ABORT:
            assert spec["req_id"] in aborted
            continue
        expected = reference_tokens(
            spec["prompt"], max_tokens=spec["max_tokens"], max_model_len=config["max_model_len"],
            eos=None if spec["ignore_eos"] else EOS, stop_token_ids=spec["stop_token_ids"],
            min_tokens=spec["min_tokens"], model=small_model)
        assert tokens == expected, spec
    pool = sched.block_pool
    assert not sched.requests and not sched.kv_cache_manager.req_blocks
    assert pool.num_free_blocks == config["num_blocks"] - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def _check_prompt_logprobs(spec, outs):
    """Prompt logprobs come once, on the first output with a token, covering positions
    1 .. len(prompt) - 1 in order, whatever chunking, preemption or async scheduling did."""
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    first_token = next((o for o in outs if o.new_token_ids), None)
    if spec["prompt_logprobs"] is None or first_token is None:
        assert not carrying, spec
        return
    assert carrying == [first_token], spec
    part = first_token.prompt_logprobs
    assert part.num_logprobs == spec["prompt_logprobs"]
    prompt = spec["prompt"]
    expected = [(pos, prompt[pos], fake_prompt_logprob(pos, prompt[pos]))
                for pos in range(1, len(prompt))]
    got = unpack_prompt_logprobs(part)
    assert [(p, t) for p, t, _ in got] == [(p, t) for p, t, _ in expected], spec
    assert all(abs(a[2] - b[2]) < 1e-3 for a, b in zip(got, expected))
