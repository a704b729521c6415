"""Issue 13: a request that is bad in itself is refused, alone, before it reaches a worker;
one the workers refuse anyway (defence in depth) fails alone and frees its blocks."""

import pytest
from sched_utils import FakeWorker, make_request, make_scheduler

from tidal.engine_core.request import Request, check_request
from tidal.ipc.frontend_messages import AddRequest, FinishReason
from tidal.ipc.messages import SamplingParams, StructuredOutputsParams, pack_token_ids

VOCAB = 512


def _request(prompt=(5, 6, 7), eos=None, arrival_time=0.0, num_resumed_tokens=0,
             **sampling) -> Request:
    return Request("r", list(prompt), SamplingParams(**sampling), eos_token_id=eos,
                   arrival_time=arrival_time, num_resumed_tokens=num_resumed_tokens)


@pytest.mark.parametrize("request_kwargs,field,words", [
    (dict(prompt=[5, -7, 6]), "prompt_token_ids", "-7"),
    (dict(prompt=[5, 10**6]), "prompt_token_ids", "1000000"),
    (dict(prompt=[VOCAB]), "prompt_token_ids", f"[0, {VOCAB})"),
    (dict(eos=2**40), "eos_token_id", str(2**40)),
    (dict(eos=-1), "eos_token_id", "-1"),
    (dict(n=3), "n", "got 3"),
    (dict(arrival_time=float("nan")), "arrival_time", "nan"),
    (dict(num_resumed_tokens=3), "num_resumed_tokens", "[0, 3)"),  # no prompt of its own
    (dict(num_resumed_tokens=-1), "num_resumed_tokens", "-1"),
])
def test_check_request_names_the_field(request_kwargs, field, words):
    with pytest.raises(ValueError) as info:
        check_request(_request(**request_kwargs), VOCAB)
    message = str(info.value)
    assert message.startswith(field + " ") and words in message, message


def test_check_request_accepts_the_edges():
    check_request(_request(prompt=[0, VOCAB - 1], eos=VOCAB + 7, stop_token_ids=[2**31 - 1],
                           logprobs=20, top_k=2**31 - 1), VOCAB)
    check_request(_request(eos=2**40, ignore_eos=True), VOCAB)  # EOS ignored: never sent on
    with pytest.raises(ValueError, match="^logprobs "):
        check_request(_request(logprobs=20), 10)
    with pytest.raises(ValueError, match="^prompt_logprobs "):
        check_request(_request(prompt_logprobs=20), 10)
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_priority_needs_the_priority_policy():
    """As vLLM: under fcfs a priority other than 0 is refused (it would be ignored)."""
    request = Request("r", [5, 6], SamplingParams(), priority=-2)
    with pytest.raises(ValueError, match=r"^priority -2 needs --scheduling-policy priority"):
        check_request(request, VOCAB)
    check_request(request, VOCAB, "priority")
    check_request(Request("r", [5, 6], SamplingParams(), priority=0), VOCAB, "fcfs")


def test_prompt_bytes_that_are_not_int32():
    msg = AddRequest("r", b"\x01\x00\x00\x00\x02", SamplingParams())
    with pytest.raises(ValueError, match="^prompt_token_ids must be packed int32"):
        Request.from_add(msg, "c")
    assert Request.from_add(AddRequest("r", pack_token_ids([1, 2]), SamplingParams()),
                            "c").prompt_token_ids == [1, 2]


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_k=2**31), "top_k"),
    (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
    (dict(stop_token_ids=[2**63 + 5]), "stop_token_ids"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop=["\ud800"]), "stop"),
])
def test_sampling_params_refuse_what_a_worker_cannot_hold(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_the_worker_refuses_fails_alone_and_frees_its_blocks(async_scheduling):
    """The worker refuses "bad" in the step that brings it: its only output is an error,
    refused, to its own client; "good" runs to the end; no block stays allocated. With async
    scheduling the next plan, made before the refusal is known, still lists "bad" (the
    worker skips it); a later plan tells the worker it finished."""
    sched = make_scheduler(num_blocks=64, max_model_len=256, async_scheduling=async_scheduling)
    worker = FakeWorker(16)
    worker.refuse.add("bad")
    sched.add(make_request("good", 20, client_id="x", max_tokens=8))
    sched.add(make_request("bad", 40, client_id="y"))
    outputs: dict[str, list] = {"x": [], "y": []}
    saw_bad_after_refusal = False
    inflight = []
    while sched.has_unfinished_requests() or inflight:
        if sched.has_unfinished_requests():
            plan = sched.schedule()
            inflight.append((plan, worker.execute(plan)))
            saw_bad_after_refusal |= "bad" in worker.refused and any(
                c.req_id == "bad" for c in plan.cached_requests)
        if not async_scheduling or len(inflight) > 1 or not sched.has_unfinished_requests():
            for client_id, outs in sched.update(*inflight.pop(0)).items():
                outputs[client_id] += outs
        sched.check_invariants()
    plan = sched.schedule()  # tells the worker that "bad" finished
    sched.update(plan, worker.execute(plan))
    (refusal,) = outputs["y"]
    assert refusal.finish_reason == FinishReason.ERROR and refusal.refused
    assert refusal.error.startswith("token_ids")
    assert not any(o.refused for o in outputs["x"])
    assert outputs["x"][-1].finish_reason == FinishReason.LENGTH
    assert saw_bad_after_refusal == async_scheduling
    assert not worker.refused  # the worker was told that "bad" finished
    assert sched.kv_cache_manager.usage() == 0.0
    assert not sched.kv_cache_manager.req_blocks


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("request_kwargs,words", [
    # issue 39: no token to stop on crashed the worker (xgrammar refuses a stopless matcher)
    (dict(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), "no EOS token"),
    (dict(eos=2, structured_outputs=StructuredOutputsParams(regex="a" * 200_000)),
     "200000 bytes, over the limit of 131072 (--structured-outputs-max-bytes)"),
    (dict(eos=2, structured_outputs=StructuredOutputsParams(json=_deep_schema(70))),
     "nests deeper than 128 levels"),
])
def test_structured_outputs_the_engine_must_not_take(request_kwargs, words):
    with pytest.raises(ValueError) as info:
        check_request(_request(**request_kwargs), VOCAB)
    assert str(info.value).startswith("structured_outputs") and words in str(info.value)


def test_structured_outputs_with_a_stop_token_id_and_within_limits_are_taken():
    check_request(_request(stop_token_ids=[3],
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                  VOCAB)
    check_request(_request(eos=2, structured_outputs=StructuredOutputsParams(
        json=_deep_schema(60))), VOCAB)


def test_a_schema_too_deep_for_json_itself_is_a_value_error():
    with pytest.raises(ValueError, match="nests deeper than 128 levels"):
        StructuredOutputsParams(json=_deep_schema(2000))
