"""Resubmission after a lost engine core (OutputProcessor.resubmit_all), with fabricated
engine outputs: the new AddRequest continues where the delivered tokens end (prompt +
delivered, max_tokens / min_tokens reduced, same seed and stops, a new engine id), text keeps
flowing through the same detokenizer, and a completion whose final output was lost with the
core is finished here with the reason the core would have given."""

import pytest

from tidal.frontend.output_processor import OutputProcessor
from tidal.ipc.frontend_messages import FinishReason
from tidal.ipc.frontend_messages import EngineCoreOutput as EngineOut
from tidal.ipc.messages import (
    SamplingParams,
    StructuredOutputsParams,
    pack_token_ids,
    unpack_token_ids,
)
from tidal.ipc.resume import lost_finish, resume_params

MAX_LEN = 256
PROMPT = [5, 6, 7]
EOS = 2


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def out(req_id, ids, finish=None, stop_reason=None):
    return EngineOut(req_id, pack_token_ids(ids), finish, stop_reason)


def test_resume_params_reduce_lengths_and_keep_the_rest():
    params = SamplingParams(max_tokens=10, min_tokens=4, seed=7, temperature=0.8,
                            stop=["x"], stop_token_ids=[9])
    resumed = resume_params(params, [11, 12, 13])
    assert (resumed.max_tokens, resumed.min_tokens) == (7, 1)
    assert (resumed.seed, resumed.temperature, resumed.stop, resumed.stop_token_ids) == \
        (7, 0.8, ["x"], [9])
    assert resume_params(params, [1] * 6).min_tokens == 0  # min_tokens met already
    assert resume_params(params, [1] * 10) is None  # nothing left to generate
    unbounded = resume_params(SamplingParams(max_tokens=None, min_tokens=4), [1, 2])
    assert (unbounded.max_tokens, unbounded.min_tokens) == (None, 2)  # up to the context


def test_resumed_structured_output_keeps_its_constraint():
    """The delivered tokens become prompt (the AddRequest's num_resumed_tokens tells the
    worker to replay the grammar over them); the constraint itself travels unchanged."""
    params = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    once = resume_params(params, [11, 12])
    assert once.structured_outputs == params.structured_outputs


def test_lost_finish_reasons():
    params = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert lost_finish(params, [4, 5, 6], EOS) == ("length", None)
    assert lost_finish(params, [4, 5, 9], EOS) == ("stop", 9)
    assert lost_finish(params, [4, 5, EOS], EOS) == ("stop", None)
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert lost_finish(ignoring, [4, 5, EOS], EOS) == ("length", None)
    # min_tokens not passed yet: a stop token does not end it (the core's rule: > min_tokens)
    assert lost_finish(SamplingParams(max_tokens=3, min_tokens=3, stop_token_ids=[9]),
                       [4, 5, 9], EOS) == ("length", None)


def test_resubmission_continues_prompt_seed_and_text(tok):
    proc = OutputProcessor(tok, EOS)
    ids = tok.encode("one two three four five", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), min_tokens=3, seed=42, temperature=1.0)
    (sent,) = proc.add_request("r", "eng-r", None, PROMPT, params, MAX_LEN, priority=5)
    proc.process_outputs([out("eng-r", ids[:2])])

    messages, finished = proc.resubmit_all()
    assert finished == []
    (msg,) = messages
    assert msg.req_id != "eng-r"
    assert unpack_token_ids(msg.prompt_token_ids).tolist() == PROMPT + ids[:2]
    assert msg.num_resumed_tokens == 2  # penalties count them as output, as before
    assert (msg.sampling.max_tokens, msg.sampling.min_tokens) == (len(ids) - 2, 1)
    assert msg.sampling.seed == sent.sampling.seed == 42
    assert (msg.priority, msg.arrival_time, msg.eos_token_id) == \
        (5, sent.arrival_time, EOS)
    assert proc.engine_req_ids() == [msg.req_id]

    # a late output of the old engine id is ignored; the new id continues the text
    proc.process_outputs([out("eng-r", [ids[2]])])
    result = proc.process_outputs([out(msg.req_id, ids[2:], FinishReason.LENGTH)])
    (final,) = result.request_outputs
    assert final.finished and final.outputs[0].token_ids == ids
    assert final.outputs[0].text == tok.decode(ids)
    assert final.outputs[0].finish_reason == "length"

    # a second resubmission of another request gets yet another engine id
    proc.add_request("s", "eng-s", None, PROMPT, params, MAX_LEN)
    first = proc.resubmit_all()[0][0].req_id
    second = proc.resubmit_all()[0][0].req_id
    assert len({"eng-s", first, second}) == 3


def test_resubmitted_ids_stay_unique_whatever_the_request_ids_hold(tok):
    proc = OutputProcessor(tok, EOS)
    for rid in ("a~b", "a~c"):
        proc.add_request(rid, "eng-" + rid, None, PROMPT, SamplingParams(max_tokens=4), MAX_LEN)
    messages, _ = proc.resubmit_all()
    assert len({m.req_id for m in messages}) == 2


def test_n_completions_resubmit_only_the_unfinished_ones(tok):
    proc = OutputProcessor(tok, EOS)
    params = SamplingParams(n=2, max_tokens=5, seed=10)
    proc.add_request("r", "eng-r", None, PROMPT, params, MAX_LEN, final_only=True)
    proc.process_outputs([out("0_eng-r", [20, 21], FinishReason.STOP, 21)])
    proc.process_outputs([out("1_eng-r", [30])])
    messages, finished = proc.resubmit_all()
    assert finished == []
    (msg,) = messages
    assert msg.req_id.startswith("1_eng-r")
    assert msg.sampling.seed == 11  # seed + index, as first sent
    assert unpack_token_ids(msg.prompt_token_ids).tolist() == PROMPT + [30]
    assert msg.sampling.max_tokens == 4


def test_final_output_lost_in_flight_is_finished_here(tok):
    """All max_tokens tokens were delivered but the finish was lost with the core: nothing
    is resubmitted (max_tokens would be 0) and the request ends with "length"."""
    proc = OutputProcessor(tok, EOS)
    proc.add_request("r", "eng-r", None, PROMPT, SamplingParams(max_tokens=3), MAX_LEN)
    proc.add_request("s", "eng-s", None, PROMPT,
                     SamplingParams(max_tokens=8, stop_token_ids=[9]), MAX_LEN)
    proc.process_outputs([out("eng-r", [11, 12, 13])])
    proc.process_outputs([out("eng-s", [11, 12])])  # still running: resubmitted
    messages, finished = proc.resubmit_all()
    assert [m.req_id.split("~")[0] for m in messages] == ["eng-s"]
    (final,) = finished
    assert final.request_id == "r" and final.finished
    assert final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == [11, 12, 13]
    assert not proc.has_request("r")
