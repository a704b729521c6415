"""Frontend parts that need no running engine: update merging (back-pressure), engine flags
as keyword arguments, the CLI dispatcher, and the launcher's failure report."""

import asyncio
import io

import pytest

from tidal.frontend.async_llm import AsyncLLM, RequestOutputCollector, merge_outputs
from tidal.frontend.cli import build_parser
from tidal.frontend.llm import _Progress, engine_config_from_kwargs
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.engine_core.config import EngineConfig, ModelConfig


def comp(index, text, delta, ids, delta_ids, finish=None):
    return CompletionOutput(index, text, ids, delta, delta_ids, None, None, None, finish, None)


def test_merge_joins_deltas_and_keeps_latest_cumulative_fields():
    a = RequestOutput("r", "p", [1], [comp(0, "ab", "ab", [1, 2], [1, 2]),
                                      comp(1, "x", "x", [9], [9])], False)
    b = RequestOutput("r", "p", [1], [comp(0, "abc", "c", [1, 2, 3], [3], "length")], True)
    m = merge_outputs(a, b)
    assert m.finished and [c.index for c in m.outputs] == [0, 1]
    assert m.outputs[0].text == "abc" and m.outputs[0].delta_text == "abc"
    assert m.outputs[0].delta_token_ids == [1, 2, 3] and m.outputs[0].finish_reason == "length"
    assert m.outputs[1].delta_text == "x"


def test_collector_merges_when_the_consumer_lags():
    async def go():
        c = RequestOutputCollector()
        c.put(RequestOutput("r", None, [1], [comp(0, "a", "a", [1], [1])], False))
        c.put(RequestOutput("r", None, [1], [comp(0, "ab", "b", [1, 2], [2])], False))
        first = await c.get()
        waiter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        c.put(RequestOutput("r", None, [1], [comp(0, "abc", "c", [1, 2, 3], [3])], True))
        return first, await waiter

    first, second = asyncio.run(go())
    assert first.outputs[0].delta_text == "ab" and first.outputs[0].delta_token_ids == [1, 2]
    assert second.finished and second.outputs[0].delta_text == "c"


def test_engine_flags_as_keyword_arguments(tmp_path):
    cfg = engine_config_from_kwargs(
        str(tmp_path), max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False,
        num_gpu_blocks_override=40, kv_cache_memory="64MiB", dtype="float",
        scheduling_policy="priority", async_scheduling=False, tensor_parallel_size=2)
    assert cfg.model.model == str(tmp_path) and cfg.model.dtype == "float32"
    assert cfg.scheduler.max_num_batched_tokens == 32 and cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.enable_prefix_caching is False and cfg.cache.num_kv_blocks_override == 40
    assert cfg.cache.kv_cache_memory == 64 * 2**20
    assert cfg.scheduler.scheduling_policy == "priority" and not cfg.scheduler.async_scheduling
    assert cfg.parallel.tensor_parallel_size == 2
    assert engine_config_from_kwargs(str(tmp_path), num_kv_blocks_override=9) \
        .cache.num_kv_blocks_override == 9


def test_unknown_or_bad_engine_flags_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="max_num_batched_token is not an engine flag"):
        engine_config_from_kwargs(str(tmp_path), max_num_batched_token=32)
    with pytest.raises(ValueError, match="block_size"):
        engine_config_from_kwargs(str(tmp_path), block_size=3)


def test_cli_parses_each_subcommand_without_importing_the_others():
    ns = build_parser("core").parse_args(["core", "m", "--max-num-seqs", "4", "--listen",
                                          "ipc:///tmp/x.sock"])
    assert (ns.command, ns.model_tag, ns.max_num_seqs, ns.listen) == \
        ("core", "m", 4, "ipc:///tmp/x.sock")
    ns = build_parser("generate").parse_args(["generate", "Hello there", "--model", "m",
                                              "--max-tokens", "5", "--stop", "x"])
    assert (ns.prompt, ns.model, ns.max_tokens, ns.stop) == ("Hello there", "m", 5, ["x"])
    with pytest.raises(SystemExit):
        build_parser(None).parse_args(["nope"])


def test_a_model_that_cannot_start_is_refused_before_any_daemon(tmp_path):
    """A folder without config.json is refused by AsyncLLM.create with a ValueError naming
    the file before any daemon starts (issue 38: checked once, up front, never restarted)."""
    (tmp_path / "empty").mkdir()
    config = EngineConfig(ModelConfig(str(tmp_path / "empty")))

    async def go():
        await AsyncLLM.create(config, startup_timeout=60, echo_daemon_output=False)

    with pytest.raises(ValueError, match="cannot read config.json"):
        asyncio.run(go())
    with pytest.raises(ValueError, match="no such file or folder"):
        asyncio.run(AsyncLLM.create(EngineConfig(ModelConfig(str(tmp_path / "missing")))))


def test_chat_template_rendering_and_its_errors(tiny_llama):
    """The shared renderer of LLM.chat and the HTTP server: text parts are joined, the text
    is tokenized without special tokens, a tokenizer without a template needs one given,
    and every malformed message or failing template is a ValueError naming the field."""
    from transformers import AutoTokenizer

    from tidal.frontend.chat_template import normalize_conversation, render_chat

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    conv = normalize_conversation([{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]}])
    assert conv == [{"role": "user", "content": "Hello world"}]
    text, ids = render_chat(tok, conv)
    assert text == "<|user|>\nHello world\n<|assistant|>\n"
    assert ids == tok.encode(text, add_special_tokens=False)
    assert render_chat(tok, conv, add_generation_prompt=False)[0] == "<|user|>\nHello world\n"
    for bad, where in [([], "messages must"), ([{"content": "x"}], "messages[0] must"),
                       ([{"role": "user", "content": 3}], "messages[0].content must"),
                       ([{"role": "user", "content": [{"type": "text"}]}],
                        "messages[0].content must")]:
        with pytest.raises(ValueError) as info:
            normalize_conversation(bad)
        assert str(info.value).startswith(where)
    with pytest.raises(ValueError, match="^messages: the chat template failed"):
        render_chat(tok, conv, chat_template="{{ raise_exception('no system role') }}")
    tok.chat_template = None
    with pytest.raises(ValueError, match="^chat_template is required"):
        render_chat(tok, conv)
    assert render_chat(tok, conv, chat_template="{{ messages[0]['content'] }}")[0] == \
        "Hello world"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive_progress(stream) -> str:
    progress = _Progress(3, True, stream)
    progress.start(0)
    for tokens in (10, 20, 30):
        progress.one_done(None)
        progress.refresh(tokens)
    progress.close(30)
    return stream.getvalue()


def test_generate_progress_is_a_bar_on_a_terminal_and_one_line_in_a_log():
    """LLM.generate's progress: a terminal gets the tqdm bar redrawn in place; a file or
    pipe (a log) gets no bar, only one line at the end."""
    terminal = _drive_progress(_Terminal())
    assert terminal.count("\r") >= 3 and "3/3" in terminal and "tok/s" in terminal
    log = _drive_progress(io.StringIO())
    assert "\r" not in log and log.count("\n") == 1, repr(log)
    assert log.startswith("Processed prompts: 3/3 in ") and "output: " in log
    quiet = io.StringIO()
    _Progress(3, False, quiet).close(30)
    assert quiet.getvalue() == ""
