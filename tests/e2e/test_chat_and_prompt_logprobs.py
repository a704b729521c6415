"""Issue 16 items 4, 6 and 7 through the whole process tree (frontend → engine-core daemon →
worker), on the tiny llama (float32) whose tokenizer has a chat template:

4. `LLM.chat` gives what `generate` gives on the templated prompt (one conversation, a list
   of them, a template of one's own, continue_final_message, template variables); a
   tokenizer without a template is a ValueError.
6. Prompt logprobs equal transformers' log-softmax (1e-4 absolute) at every position after
   the first, with a prompt chunked over three steps (max_num_batched_tokens=32), also when
   the same prompt is in the prefix cache (requests asking for them skip it); the HTTP
   completions API answers echo + logprobs with the same values.
7. `LLM.generate(priority=...)` under fcfs is a ValueError, before anything is sent; the
   daemon's EngineInfo carries its policy and --max-num-queued-tokens.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tidal.frontend.async_llm import AsyncLLM
from tidal.engine_core.launcher import DaemonProcess
from tidal.frontend.llm import LLM, engine_config_from_kwargs
from tidal.frontend.server.app import build_app
from tidal.ipc.messages import SamplingParams

STARTUP_TIMEOUT_S = 120.0
TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
CONVERSATION = [{"role": "user", "content": "Hello world! How are you today?"},
                {"role": "assistant", "content": "I am fine, thank you."},
                {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    config = engine_config_from_kwargs(tiny_llama, max_num_batched_tokens=32, max_num_seqs=8,
                                       kv_cache_memory="16MiB", max_num_queued_tokens="32k")
    d = DaemonProcess(config, echo=False)
    yield d
    assert d.stop(timeout=20) == 0, d.failure_message("daemon did not stop cleanly")


@pytest.fixture(scope="module")
def llm(daemon):
    with LLM(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S) as frontend:
        yield frontend


def _generate_ids(llm, ids, params=GREEDY):
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]


# ---------------------------------------------------------------------------------------------
# item 4: LLM.chat


@pytest.mark.timeout(180)
def test_chat_equals_generate_on_the_templated_prompt(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert out.prompt == text and text.endswith("<|assistant|>\n")
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == _generate_ids(llm, ids).outputs[0].token_ids

    second = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"},
                                           {"type": "text", "text": " return"}]}]
    both = llm.chat([second, CONVERSATION], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both][1] == out.outputs[0].token_ids
    assert both[0].prompt == "<|user|>\ndef add(a, b): return\n<|assistant|>\n"


@pytest.mark.timeout(180)
def test_chat_template_options(llm):
    tok = llm.get_tokenizer()
    own = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}[assistant] {{ greeting }}{% endif %}")
    (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=own,
                      chat_template_kwargs={"greeting": "Sure:"})
    assert out.prompt.endswith("[user] Once upon a time\n[assistant] Sure:")
    assert out.outputs[0].token_ids == _generate_ids(
        llm, tok.encode(out.prompt, add_special_tokens=False)).outputs[0].token_ids

    (cont,) = llm.chat(CONVERSATION[:2], GREEDY, use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)
    assert cont.prompt.endswith("<|assistant|>\nI am fine, thank you.")
    (plain,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert plain.prompt.endswith("Once upon a time\n")

    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(CONVERSATION, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function must be an object"):
        llm.chat(CONVERSATION, tools=[{"type": "function"}])
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        llm.chat(CONVERSATION, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\] must be a dict"):
        llm.chat([CONVERSATION, ["hi"]])


@pytest.mark.timeout(180)
def test_chat_with_tools_and_a_template_file(llm, tmp_path):
    """LLM.chat(tools=...) hands the tools to the template, an assistant's tool_calls reach
    it with their arguments as objects, and chat_template may be a file (--chat-template's
    habit)."""
    path = tmp_path / "tools.jinja"
    path.write_text("{% for t in tools %}[tool {{ t.function.name }}]\n{% endfor %}"
                    "{% for m in messages %}{% if m.tool_calls %}[call "
                    "{{ m.tool_calls[0].function.arguments.a }}]{% else %}[{{ m.role }}] "
                    "{{ m.content }}{% endif %}\n{% endfor %}[assistant]")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    history = [{"role": "user", "content": "Add one"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "add", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    (out,) = llm.chat(history, GREEDY, use_tqdm=False, chat_template=str(path), tools=tools)
    assert out.prompt == "[tool add]\n[user] Add one[call 1][tool] 2[assistant]"  # trim_blocks


@pytest.mark.timeout(120)
def test_chat_without_a_template_is_a_value_error(llm):
    tok = llm.get_tokenizer()
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="^chat_template is required: this model's "
                                             "tokenizer has no chat template"):
            llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
        (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False,
                          chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        assert out.prompt == "".join(m["content"] for m in CONVERSATION)
    finally:
        tok.chat_template = saved


# ---------------------------------------------------------------------------------------------
# item 6: prompt logprobs


@pytest.fixture(scope="module")
def long_prompt():
    """70 tokens: three prefill chunks at max_num_batched_tokens=32."""
    return torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(16)).tolist()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama, long_prompt):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([long_prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_transformers(prompt_logprobs, prompt, ref, num_top):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[pos], ref[pos - 1], prompt[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL), pos
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(num_top).values.tolist(),
                                                           abs=TOL)


@pytest.mark.timeout(180)
def test_prompt_logprobs_match_transformers_chunked_and_past_the_prefix_cache(
        llm, long_prompt, hf_logprobs):
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    first = _generate_ids(llm, long_prompt, params)
    assert_matches_transformers(first.prompt_logprobs, long_prompt, hf_logprobs, 2)
    # the prompt's 4 full blocks are cached now: a request without prompt logprobs hits
    # them, one with them computes its whole prompt again and gets every position
    plain = _generate_ids(llm, long_prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert plain.metrics.num_cached_tokens == 64 and plain.prompt_logprobs is None
    again = _generate_ids(llm, long_prompt, params)
    assert again.metrics.num_cached_tokens == 0
    assert_matches_transformers(again.prompt_logprobs, long_prompt, hf_logprobs, 2)
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.timeout(180)
def test_echo_with_logprobs_over_http(daemon, llm, long_prompt):
    """/v1/completions with echo and logprobs=1 (an in-process app on a real AsyncLLM):
    the prompt's tokens and logprobs lead, equal to LLM's prompt_logprobs."""
    expected = _generate_ids(llm, long_prompt, SamplingParams(
        temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=1))

    async def factory():
        return await AsyncLLM.create(engine=daemon.address, client_kind="http")

    async def body():
        app = build_app(factory)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.post("/v1/completions", json={
                    "prompt": long_prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                    "logprobs": 1})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    lp = asyncio.run(body())
    want = [None] + [e[t].logprob for e, t in zip(expected.prompt_logprobs[1:],
                                                  long_prompt[1:])]
    want += [e[t].logprob for e, t in zip(expected.outputs[0].logprobs,
                                          expected.outputs[0].token_ids)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-6)
    assert len(lp["tokens"]) == len(long_prompt) + 2


# ---------------------------------------------------------------------------------------------
# item 7: priority under fcfs


@pytest.mark.timeout(60)
def test_priority_under_fcfs_is_a_value_error(llm):
    """(The daemon tells frontends its policy and its --max-num-queued-tokens.)"""
    assert llm.engine_info.scheduling_policy == "fcfs"
    assert llm.engine_info.max_num_queued_tokens == 32_000
    before = llm.get_stats()
    with pytest.raises(ValueError, match="^priority 1 needs --scheduling-policy priority"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1])
    assert llm.get_stats().num_steps == before.num_steps  # nothing was sent
    assert len(llm.generate(["a"], GREEDY, use_tqdm=False, priority=[0])) == 1
