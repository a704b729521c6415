"""The frontend's output processing with fabricated engine outputs (no engine, no sockets):
incremental detokenization, stop strings (also across token boundaries, and held back while
streaming), min_tokens, stop tokens, n > 1 fan-out and merge, stream interval, logprobs."""

from array import array

import pytest

from tidal.frontend.detokenizer import IncrementalDetokenizer
from tidal.frontend.engine_client import encode_prompt, read_eos_token_ids
from tidal.frontend.output_processor import OutputProcessor, find_stop_string
from tidal.ipc.frontend_messages import EngineCoreOutput as EngineOut, FinishReason
from tidal.ipc.messages import (
    PromptLogprobs,
    SamplingParams,
    TokenLogprobs,
    pack_token_ids,
    unpack_token_ids,
)

MAX_LEN = 256


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def out(req_id, ids, finish=None, stop_reason=None, **kw):
    return EngineOut(req_id, pack_token_ids(ids), finish, stop_reason, **kw)


def feed(proc, req_id, ids, finish_last=None, stop_reason=None):
    """One engine message per token (the last may carry a finish); returns all updates."""
    updates, aborts = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        r = proc.process_outputs([out(req_id, [t], finish_last if last else None,
                                      stop_reason if last else None)])
        updates += r.request_outputs
        aborts += r.reqs_to_abort
    return updates, aborts


def add(proc, params, prompt_ids=(5, 6, 7), request_id="r", final_only=False, interval=1):
    return proc.add_request(request_id, "eng-" + request_id, None, list(prompt_ids), params,
                            MAX_LEN, final_only=final_only, stream_interval=interval)


# -- detokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Hello world! How are you today?", "é 日本 ok",
                                  "def add(a, b):\n    return a + b"])
def test_incremental_detokenization_matches_full_decode(tok, text):
    prompt = tok.encode("The quick")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]


def test_detokenizer_skips_special_tokens_only_when_asked(tok):
    ids = tok.encode("Hello") + [tok.eos_token_id] + tok.encode(" world")
    skip = IncrementalDetokenizer(tok, [5], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [5], skip_special_tokens=False)
    assert "".join(skip.step(t) for t in ids) == "Hello world"
    assert "".join(keep.step(t) for t in ids) == "Hello<|endoftext|> world"


def test_detokenizer_recovers_when_the_stream_fails(tok):
    """A DecodeStream error (vLLM's "Invalid prefix" case) rebuilds the stream from the ids
    seen so far; the text stays right."""
    ids = tok.encode("one, two, three, four")
    detok = IncrementalDetokenizer(tok, [5], skip_special_tokens=True)
    pieces = [detok.step(t) for t in ids[:3]]

    class Broken:
        def step(self, backend, token_id):
            raise RuntimeError("Invalid prefix encountered")

    detok._stream = Broken()
    pieces += [detok.step(t) for t in ids[3:]]
    assert "".join(pieces) == "one, two, three, four"


def test_slow_path_without_rust_backend(tok):
    class SlowTokenizer:  # a tokenizer without backend_tokenizer: prefix/read offsets
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("é 日本 four, five")
    detok = IncrementalDetokenizer(SlowTokenizer(), [5, 6], skip_special_tokens=True)
    assert "".join(detok.step(t) for t in ids) == "é 日本 four, five"


# -- stop strings -----------------------------------------------------------------------------


def test_find_stop_string_looks_back_across_the_boundary():
    # "fo" arrived before, "ur" is new: "four" is found, truncated before it
    assert find_stop_string("one, four", 7, ["four"], False) == ("four", 5)
    assert find_stop_string("one, four", 7, ["four"], True) == ("four", 9)
    # already searched text is not searched again
    assert find_stop_string("four, five", 9, ["four"], False) is None
    # earliest match wins among several stop strings
    assert find_stop_string("a, five, four", 0, ["four", "five"], False) == ("five", 3)


def test_stop_string_across_token_boundaries_truncates_and_aborts(tok):
    proc = OutputProcessor(tok, eos_token_id=0)
    ids = tok.encode("one, two, three, four, five")
    # tokens: "on" "e" "," " two" "," " three" ...; "o, th" spans " two", "," and " three"
    params = SamplingParams(max_tokens=20, stop=["o, th"])
    add(proc, params, final_only=True)
    updates, aborts = feed(proc, "eng-r", ids)
    assert aborts == ["eng-r"]
    (final,) = updates
    comp = final.outputs[0]
    assert final.finished
    assert comp.text == "one, tw"
    assert comp.finish_reason == "stop" and comp.stop_reason == "o, th"
    # the token that completed the stop string is kept; later ones are dropped
    assert comp.token_ids == ids[:ids.index(tok.encode(" three")[0]) + 1]


def test_stop_string_inside_one_message_drops_surplus_tokens(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("one, two, three, four, five")
    add(proc, SamplingParams(max_tokens=20, stop=["two"]), final_only=True)
    r = proc.process_outputs([out("eng-r", ids)])
    comp = r.request_outputs[0].outputs[0]
    assert comp.text == "one, " and comp.token_ids == ids[:4]
    assert r.reqs_to_abort == ["eng-r"]


def test_include_stop_str_in_output(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(max_tokens=20, stop=["three"], include_stop_str_in_output=True),
        final_only=True)
    updates, _ = feed(proc, "eng-r", tok.encode("one, two, three, four"))
    assert updates[-1].outputs[0].text == "one, two, three"


def test_streaming_holds_back_partial_stop_strings(tok):
    proc = OutputProcessor(tok)
    text = "one, two, three, four, five"
    add(proc, SamplingParams(max_tokens=30, stop=["four"]))
    updates, aborts = feed(proc, "eng-r", tok.encode(text))
    deltas = [u.outputs[0].delta_text for u in updates]
    assert "".join(deltas) == "one, two, three, "
    for u in updates[:-1]:  # never shows the beginning of the stop string
        assert not u.outputs[0].text.endswith(("f", "fo", "fou"))
        assert len(u.outputs[0].text) <= len(text)
    assert updates[-1].finished and aborts == ["eng-r"]


def test_streaming_deltas_add_up_when_finishing_by_length(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("Hello world! How are you")
    add(proc, SamplingParams(max_tokens=len(ids), stop=["xyz"]))
    updates, _ = feed(proc, "eng-r", ids, FinishReason.LENGTH)
    assert "".join(u.outputs[0].delta_text for u in updates) == "Hello world! How are you"
    assert updates[-1].outputs[0].finish_reason == "length"
    assert sum(len(u.outputs[0].delta_token_ids) for u in updates) == len(ids)


def test_min_tokens_suppresses_early_stop_strings(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("one, two, one, two, three")
    # "two" first ends at token 4; with min_tokens=5 only the second "two" (token 7) counts
    add(proc, SamplingParams(max_tokens=20, min_tokens=5, stop=["two"]), final_only=True)
    updates, _ = feed(proc, "eng-r", ids)
    comp = updates[-1].outputs[0]
    assert comp.text == "one, two, one, " and comp.stop_reason == "two"


def test_stop_token_text_left_out_and_reported(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("Hello world")
    add(proc, SamplingParams(max_tokens=20, stop_token_ids=[ids[-1]]), final_only=True)
    updates, aborts = feed(proc, "eng-r", ids, FinishReason.STOP, stop_reason=ids[-1])
    comp = updates[-1].outputs[0]
    assert comp.text == "Hello" and comp.token_ids == ids
    assert comp.finish_reason == "stop" and comp.stop_reason == ids[-1]
    assert aborts == []  # the engine finished it itself


# -- n > 1, stream interval -------------------------------------------------------------------


def test_n_fans_out_into_children_and_merges_back(tok):
    proc = OutputProcessor(tok, eos_token_id=0)
    msgs = add(proc, SamplingParams(n=3, max_tokens=4, seed=7, temperature=0.8),
               final_only=True)
    assert [m.req_id for m in msgs] == ["0_eng-r", "1_eng-r", "2_eng-r"]
    assert [m.sampling.seed for m in msgs] == [7, 8, 9]
    assert all(m.sampling.n == 1 and m.eos_token_id == 0 for m in msgs)
    assert list(unpack_token_ids(msgs[0].prompt_token_ids)) == [5, 6, 7]
    texts = {0: "Hello world", 1: "one, two", 2: "How are"}
    results = []
    for i in (2, 0, 1):  # children finish in any order
        updates, _ = feed(proc, f"{i}_eng-r", tok.encode(texts[i]), FinishReason.LENGTH)
        results += updates
    (final,) = results  # final-only: one update, when the last child finishes
    assert final.finished and final.request_id == "r"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == [texts[0], texts[1], texts[2]]
    assert final.metrics.num_generation_tokens == sum(len(tok.encode(t)) for t in texts.values())
    assert proc.num_unfinished_requests() == 0


def test_n_streaming_reports_changed_children_only(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(n=2, max_tokens=4))
    r = proc.process_outputs([out("1_eng-r", [42])])
    (u,) = r.request_outputs
    assert [c.index for c in u.outputs] == [1] and not u.finished
    r = proc.process_outputs([out("0_eng-r", [42], FinishReason.LENGTH),
                              out("1_eng-r", [437], FinishReason.LENGTH)])
    (u,) = r.request_outputs
    assert [c.index for c in u.outputs] == [0, 1] and u.finished
    assert u.outputs[1].text == "Hello" and u.outputs[1].delta_text == "ello"


def test_stream_interval_groups_tokens(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("one, two, three, four, five")  # 10 tokens
    add(proc, SamplingParams(max_tokens=10), interval=4)
    updates, _ = feed(proc, "eng-r", ids, FinishReason.LENGTH)
    # the first token at once, then every 4, the rest at the end
    assert [len(u.outputs[0].delta_token_ids) for u in updates] == [1, 4, 4, 1]
    assert "".join(u.outputs[0].delta_text for u in updates) == "one, two, three, four, five"


def test_late_outputs_of_aborted_requests_are_ignored(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(n=2, max_tokens=4))
    assert sorted(proc.abort_request("r")) == ["0_eng-r", "1_eng-r"]
    assert proc.process_outputs([out("0_eng-r", [42])]).request_outputs == []
    assert proc.num_unfinished_requests() == 0


def test_fail_all_ends_every_request_with_error(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(max_tokens=4), request_id="a")
    add(proc, SamplingParams(max_tokens=4), request_id="b", final_only=True)
    proc.process_outputs([out("eng-a", [42]), out("eng-b", [42])])
    finals = proc.fail_all("worker 0 died")
    assert {f.request_id for f in finals} == {"a", "b"}
    for f in finals:
        assert f.finished and f.outputs[0].finish_reason == "error"
        assert f.outputs[0].error == "worker 0 died"
    assert proc.num_unfinished_requests() == 0


def test_engine_error_finish_carries_the_message(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(max_tokens=4))
    r = proc.process_outputs([out("eng-r", [], FinishReason.ERROR, error="boom")])
    comp = r.request_outputs[0].outputs[0]
    assert comp.finish_reason == "error" and comp.error == "boom"


def test_a_refused_request_is_forgotten_and_reported_not_delivered(tok):
    """The engine core refused one completion of an n=2 request (bad input): no user
    update, the refusal reported for the caller to raise, the sibling aborted."""
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(n=2, max_tokens=4))
    add(proc, SamplingParams(max_tokens=4), request_id="ok")
    r = proc.process_outputs([
        out("1_eng-r", [42]),
        out("0_eng-r", [], FinishReason.ERROR, error="prompt_token_ids contains 600",
            refused=True),
        out("eng-ok", [42])])
    assert [u.request_id for u in r.request_outputs] == ["ok"]
    assert r.refused == {"r": "prompt_token_ids contains 600"}
    assert r.reqs_to_abort == ["1_eng-r"]
    assert not proc.has_request("r") and proc.has_request("ok")
    late = proc.process_outputs([out("1_eng-r", [], FinishReason.ERROR, refused=True)])
    assert late.refused == {} and late.request_outputs == []


def test_duplicate_request_id_is_refused(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        add(proc, SamplingParams())


# -- lengths, eos, logprobs -------------------------------------------------------------------


def test_max_tokens_capped_by_the_context_length(tok):
    proc = OutputProcessor(tok)
    (msg,) = add(proc, SamplingParams(max_tokens=None, min_tokens=0), prompt_ids=[5] * 250)
    assert msg.sampling.max_tokens == MAX_LEN - 250
    (msg,) = add(proc, SamplingParams(max_tokens=100, min_tokens=50), prompt_ids=[5] * 230,
                 request_id="q")
    assert (msg.sampling.max_tokens, msg.sampling.min_tokens) == (26, 26)


def test_prompt_length_limit_names_both_numbers(tok):
    assert len(encode_prompt(tok, [5] * 255, 256)) == 255
    with pytest.raises(ValueError, match=r"256 tokens.*max_model_len\) is 256"):
        encode_prompt(tok, [5] * 256, 256)
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tok, "", 256)
    with pytest.raises(ValueError, match="token ids"):
        encode_prompt(tok, [5, 100000], 256)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        encode_prompt(tok, [5, 400], 256, model_vocab_size=300)  # the model's is smaller
    with pytest.raises(ValueError, match="^prompt must be valid Unicode"):
        encode_prompt(tok, "a\ud800", 256)


def test_extra_eos_ids_become_stop_token_ids(tok, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 3]}')
    eos = read_eos_token_ids(str(tmp_path), tok)
    assert eos == [0, 3]
    proc = OutputProcessor(tok, eos[0], eos[1:])
    (msg,) = add(proc, SamplingParams(stop_token_ids=[9]))
    assert msg.eos_token_id == 0 and msg.sampling.stop_token_ids == [9, 3]


def test_logprobs_are_converted_with_ranks_and_text(tok):
    proc = OutputProcessor(tok)
    add(proc, SamplingParams(max_tokens=2, logprobs=2), final_only=True)
    ids = tok.encode("Hello world")[:2]

    def tl(sampled, sampled_rank, top):
        toks = [sampled] + [t for t, _ in top]
        lps = [dict(top).get(sampled, -3.0)] + [lp for _, lp in top]
        return TokenLogprobs(pack_token_ids(toks), array("f", lps).tobytes(), sampled_rank)

    entries = [tl(ids[0], 1, [(ids[0], -0.5), (7, -1.5)]), tl(ids[1], 3, [(8, -0.1), (9, -0.2)])]
    r = proc.process_outputs([out("eng-r", ids, FinishReason.LENGTH, new_logprobs=entries)])
    comp = r.request_outputs[0].outputs[0]
    assert len(comp.logprobs) == 2
    first, second = comp.logprobs
    assert set(first) == {ids[0], 7} and first[ids[0]].rank == 1
    assert first[7].rank == 2 and first[7].decoded_token == tok.decode([7])
    assert second[ids[1]].rank == 3 and second[8].rank == 1 and second[9].rank == 2
    assert comp.cumulative_logprob == pytest.approx(-0.5 - 3.0)


def test_prompt_logprobs_come_from_completion_zero_and_stay(tok):
    """n=2 streaming: only completion 0 asks the engine for the prompt's logprobs; they
    arrive with its first token as [None, {prompt token + alternatives}, ...]. Completion 1's
    token, come first, is held back until then, so every update carries them."""
    proc = OutputProcessor(tok)
    msgs = add(proc, SamplingParams(n=2, max_tokens=2, prompt_logprobs=1),
               prompt_ids=(5, 6, 7))
    assert [m.sampling.prompt_logprobs for m in msgs] == [1, None]
    part = PromptLogprobs("0_eng-r", 1, 1, pack_token_ids([6, 9, 7, 7]),
                          array("f", [-2.0, -0.5, -0.25, -0.25]).tobytes(),
                          pack_token_ids([4, 1]))
    assert proc.process_outputs([out("1_eng-r", [11])]).request_outputs == []  # held
    (second,) = proc.process_outputs([out("0_eng-r", [12], prompt_logprobs=part)]
                                     ).request_outputs
    assert [(c.index, c.token_ids) for c in second.outputs] == [(0, [12]), (1, [11])]
    assert second.prompt_logprobs[0] is None and len(second.prompt_logprobs) == 3
    pos1, pos2 = second.prompt_logprobs[1:]
    assert pos1[6].rank == 4 and pos1[6].logprob == -2.0 and pos1[9].rank == 1
    assert pos1[6].decoded_token == tok.decode([6])
    assert list(pos2) == [7] and pos2[7].rank == 1  # the prompt token is the top one
    (third,) = proc.process_outputs([out("1_eng-r", [13], FinishReason.LENGTH)]
                                    ).request_outputs
    assert third.prompt_logprobs is second.prompt_logprobs
