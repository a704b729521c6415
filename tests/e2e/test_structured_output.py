"""Structured output (issue 16, item 5) through the whole process tree: one `tidal core` of
the tiny random Llama with 8 KV blocks (requests are preempted and recomputed), a 32-token
step budget (prompts are chunked) and async scheduling on; `LLM(engine=...)` and one
`tidal serve --engine ...` attached to it.

A random model rambles, so the constraints used where an output must finish leave it few
choices (enums, bounded integers, no free whitespace); where a request may be cut by
max_tokens, its text must still be a prefix the grammar accepts.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import msgspec
import openai
import pytest

from live_server import LiveServer, Proc
from tidal.frontend.llm import LLM
from tidal.ipc.messages import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # live server subprocesses (still run by CI)

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe"]
MAX_TOKENS = 48
WORDS = ("The quick brown fox jumps over the lazy dog. A continuous batching engine admits "
         "requests as soon as there is room. Hello world! How are you today?")


@pytest.fixture(scope="module")
def engine_address(tiny_llama, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('core')}/engine.sock"
    core = Proc(["core", tiny_llama, "--num-gpu-blocks-override", "8", "--max-model-len",
                 "112", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                 "--async-scheduling", "--listen", address])
    yield address
    core.stop()


@pytest.fixture(scope="module")
def llm(engine_address):
    engine = LLM(engine=engine_address, startup_timeout=150)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine_address):
    srv = LiveServer(["--engine", engine_address, "--served-model-name", "tiny"])
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer,
                                                                            vocab_size=512))


def constrained(**spec) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(**spec))


def hf_constrained_greedy(model, compiler, prompt: list[int], spec, max_new: int):
    """transformers' greedy tokens with xgrammar's own logits processor (None: unconstrained)."""
    import torch
    from xgrammar.contrib.hf import LogitsProcessor

    processors = [] if spec is None else [LogitsProcessor(spec.compile_with(compiler))]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, logits_processor=processors)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(0) + 1] if 0 in tokens else tokens  # up to EOS (id 0)


def assert_prefix_of_grammar(compiler, spec: StructuredOutputsParams, text: str) -> None:
    """`text` (an output cut by max_tokens) is a prefix of a string the grammar accepts."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(spec.compile_with(compiler))
    assert matcher.accept_string(text), f"{text!r} leaves the {spec.kind} grammar"


def test_mixed_batch_under_preemption_equals_transformers_and_validates(llm, hf_model,
                                                                         compiler):
    """Constrained (schema, regex, choice, sampled choice) and free requests in one batch on
    a cache too small for them all (preemptions happen): greedy tokens equal transformers'
    with xgrammar's logits processor; each constrained output finishes with "stop" and is
    valid (parses and validates / fully matches / is a choice)."""
    rng = random.Random(16)
    words = WORDS.split()
    texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (30, 6, 25, 15, 9, 33, 5)]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = [constrained(json=SCHEMA, disable_any_whitespace=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
              constrained(regex=REGEX),
              constrained(choice=CHOICES),
              constrained(json=SCHEMA, disable_any_whitespace=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    # each constraint compiled once first (the frontend's check and the workers' masks are
    # cached after), so the seven requests reach the core together: a first compile on a busy
    # machine can hold the constrained ones back until the free ones have finished, and then
    # the batch never fills the cache (no preemption: seen once in a full run beside a benchmark)
    llm.generate([prompts[1]] * len(params),
                 [msgspec.structs.replace(p, max_tokens=1) for p in params], use_tqdm=False)
    before = llm.get_stats().num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > before

    for prompt, p, out in zip(prompts, params, outputs):
        got = out.outputs[0]
        spec = p.structured_outputs
        if p.temperature == 0.0:
            assert got.token_ids == hf_constrained_greedy(hf_model, compiler, prompt, spec,
                                                          MAX_TOKENS)
        if spec is None:
            continue
        assert got.finish_reason == "stop", got.text
        if spec.json is not None:
            jsonschema.validate(json.loads(got.text), SCHEMA)
        elif spec.regex is not None:
            assert re.fullmatch(REGEX, got.text)
        else:
            assert got.text in CHOICES
    assert llm.get_stats().kv_cache_usage == 0.0


def test_any_json_object_is_a_valid_prefix_or_parses(llm, compiler):
    """json_object with free whitespace (a random model may fill it): the output parses as an
    object when it stopped, and is a prefix the grammar accepts when max_tokens cut it."""
    spec = StructuredOutputsParams(json_object=True)
    out = llm.generate(["Hello world! How are you"],
                       SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert_prefix_of_grammar(compiler, spec, out.text)


def test_llm_bad_schema_raises_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json does not compile"):
        llm.generate(["x"], constrained(json={"type": "no-such-type"}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs must set exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex=REGEX)
    with pytest.raises(ValueError, match=r"^min_tokens cannot be set with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex=REGEX))
    with pytest.raises(ValueError, match=r"^ignore_eos cannot be set with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex=REGEX))
    assert llm.generate(["x"], constrained(choice=CHOICES), use_tqdm=False)[0].outputs[0] \
        .text in CHOICES  # the engine serves on


def test_openai_chat_response_format_json_schema(server, compiler):
    """The openai client's `response_format` json_schema: valid JSON when it stops, a prefix
    the schema's grammar accepts when max_tokens cut it (free whitespace is allowed here, as
    in vLLM, and a random model may fill it)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A color, please."}],
        max_tokens=24, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    else:
        assert choice.finish_reason == "length"
        assert_prefix_of_grammar(compiler, StructuredOutputsParams(json=SCHEMA),
                                 choice.message.content)


def test_http_guided_fields_on_completions(server):
    """vLLM's guided_choice / guided_regex / structured_outputs on /v1/completions, a batch
    of two prompts, streamed and not."""
    with server.client(timeout=60) as http:
        body = {"model": "tiny", "prompt": ["The quick brown fox", "Hello"], "max_tokens": 20,
                "temperature": 0}
        r = http.post("/v1/completions", json={**body, "guided_choice": CHOICES})
        assert r.status_code == 200, r.text
        assert [c["text"] in CHOICES for c in r.json()["choices"]] == [True, True]
        r = http.post("/v1/completions", json={**body, "guided_regex": REGEX})
        assert all(re.fullmatch(REGEX, c["text"]) for c in r.json()["choices"]), r.text
        r = http.post("/v1/completions", json={
            **body, "stream": True, "max_tokens": MAX_TOKENS,
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        texts = {0: "", 1: ""}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
        for text in texts.values():
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_http_bad_constraint_is_a_400_naming_the_field(server, fields, param):
    with server.client(timeout=60) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "stream": stream, **fields})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(param), error
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                  "max_tokens": 2}).status_code == 200
