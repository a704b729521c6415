"""`AsyncLLM` through the whole process tree, on uvloop: streaming deltas, stream interval,
abort (explicit, and by leaving the loop), stop strings while streaming, n > 1 streaming,
concurrent requests, and engine death (every pending request ends with "error"; attached to
a daemon it does not own, the AsyncLLM then waits for a core to come back).

One daemon serves the module; each test attaches its own AsyncLLM inside `run()` (uvloop).
The last test kills the daemon. Every test has a pytest timeout and its waits are bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tidal.frontend.async_llm import AsyncLLM, EngineUnavailable, run
from tidal.engine_core.launcher import DaemonProcess
from tidal.frontend.llm import engine_config_from_kwargs
from tidal.ipc.messages import SamplingParams, StructuredOutputsParams

STARTUP_TIMEOUT_S = 120.0
PROMPT = [11, 22, 33, 44, 55]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    # a CPU KV cache is made resident at start-up: keep it small (the default is up to 4 GiB)
    d = DaemonProcess(engine_config_from_kwargs(tiny_llama, kv_cache_memory="64MiB"), echo=False)
    yield d
    d.stop(timeout=20)


def attach_and(daemon, body, timeout: float = 60.0, **llm_args):
    """Run `body(llm)` on uvloop with a fresh AsyncLLM attached to the daemon."""

    async def main():
        llm = await AsyncLLM.create(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S,
                                    **llm_args)
        try:
            return await asyncio.wait_for(body(llm), timeout)
        finally:
            await llm.close()

    return run(main())


async def collect(gen) -> list:
    return [out async for out in gen]


async def wait_idle(llm, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = await llm.get_stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the engine still runs requests after the abort")


@pytest.mark.timeout(180)
def test_streaming_deltas_add_up_and_stream_interval_groups(daemon):
    async def body(llm):
        assert asyncio.get_running_loop().__class__.__module__.startswith("uvloop")
        final = await llm.generate_final(PROMPT, GREEDY)
        every = await collect(llm.generate(PROMPT, GREEDY, "every"))
        grouped = await collect(llm.generate(PROMPT, GREEDY, "grouped", stream_interval=4))
        return final, every, grouped

    final, every, grouped = attach_and(daemon, body)
    want = final.outputs[0]
    for updates in (every, grouped):
        assert updates[-1].finished and not any(u.finished for u in updates[:-1])
        assert "".join(u.outputs[0].delta_text for u in updates) == want.text
        assert sum((u.outputs[0].delta_token_ids for u in updates), []) == want.token_ids
        assert updates[-1].outputs[0].token_ids == want.token_ids
        assert updates[0].metrics.first_token_time is not None
    # 12 tokens: interval 1 reports (nearly) every token; interval 4 reports 1 + 4 + 4 + 3
    assert len(every) > 4
    assert len(grouped) <= 4
    assert len(grouped[0].outputs[0].delta_token_ids) == 1


@pytest.mark.timeout(120)
def test_leaving_the_loop_and_abort_stop_the_request_in_the_engine(daemon):
    async def body(llm):
        async for out in llm.generate(PROMPT, LONG, "left"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # the generator's cleanup aborts the request
        await wait_idle(llm)
        updates = []

        async def consume():
            async for out in llm.generate(PROMPT, LONG, "aborted"):
                updates.append(out)
                if len(updates) == 1:
                    await llm.abort("aborted")

        await consume()
        await wait_idle(llm)
        return updates, llm.num_unfinished_requests()

    updates, unfinished = attach_and(daemon, body)
    assert updates[-1].finished and updates[-1].outputs[0].finish_reason == "abort"
    assert len(updates[-1].outputs[0].token_ids) < LONG.max_tokens
    assert unfinished == 0


@pytest.mark.timeout(120)
def test_stop_string_while_streaming(daemon):
    async def body(llm):
        base = await llm.generate_final(PROMPT, SamplingParams(temperature=0.0, max_tokens=24,
                                                               ignore_eos=True))
        text = base.outputs[0].text
        # a stop string straddling tokens: the middle 4 characters of a clean stretch
        start = next(i for i in range(4, len(text) - 4)
                     if "\ufffd" not in text[i:i + 4] and text[i:i + 4].strip())
        stop = text[start:start + 4]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
        return text, stop, await collect(llm.generate(PROMPT, params))

    text, stop, updates = attach_and(daemon, body)
    expected = text[:text.find(stop)]
    assert "".join(u.outputs[0].delta_text for u in updates) == expected
    for u in updates[:-1]:  # no update ever shows more than the final text
        assert expected.startswith(u.outputs[0].text)
    last = updates[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop and last.text == expected


@pytest.mark.timeout(120)
def test_n_streaming_and_concurrent_requests(daemon):
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(8)]

    async def body(llm):
        sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
        updates = await collect(llm.generate(PROMPT, sampled))
        final = await llm.generate_final(PROMPT, sampled)
        streams = await asyncio.gather(*(collect(llm.generate(p, GREEDY, f"c{i}"))
                                         for i, p in enumerate(prompts)))
        finals = await asyncio.gather(*(llm.generate_final(p, GREEDY) for p in prompts))
        with pytest.raises(ValueError, match="request_id"):
            gen = llm.generate(PROMPT, LONG, "dup")
            first = await gen.__anext__()
            await collect(llm.generate(PROMPT, GREEDY, "dup"))
        await gen.aclose()
        assert first.request_id == "dup"
        return updates, final, streams, finals

    updates, final, streams, finals = attach_and(daemon, body)
    assert updates[-1].finished
    by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for u in updates:
        for c in u.outputs:
            by_index[c.index] += c.delta_token_ids
    assert [by_index[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    for i, (stream, fin) in enumerate(zip(streams, finals)):
        assert {u.request_id for u in stream} == {f"c{i}"}
        assert stream[-1].outputs[0].token_ids == fin.outputs[0].token_ids


@pytest.mark.timeout(120)
def test_prompt_checks(daemon):
    async def body(llm):
        max_len = llm.engine_info.max_model_len
        with pytest.raises(ValueError, match=rf"{max_len + 3} tokens.*is {max_len}"):
            llm.encode_prompt([5] * (max_len + 3))
        with pytest.raises(ValueError, match="empty"):
            await collect(llm.generate([], GREEDY))
        return llm.model_name, llm.encode_prompt("Hello world")

    name, ids = attach_and(daemon, body)
    assert name and ids


@pytest.mark.timeout(120)
def test_a_request_the_engine_refuses_raises_value_error_naming_the_field(daemon):
    """Issue 13: a prompt of token ids outside the model's vocabulary (512 ids; the daemon
    says so in EngineInfo) is refused by encode_prompt; sent all the same (generate_final
    does not re-check), the engine core refuses it: ValueError naming the field, for n = 1
    and n = 2, while a request beside it runs to the end, and no KV block stays in use."""
    async def body(llm):
        assert llm.engine_info.vocab_size == 512
        with pytest.raises(ValueError, match=r"must be in \[0, 512\), got \[600\]"):
            llm.encode_prompt([5, 600])
        neighbour = asyncio.ensure_future(collect(llm.generate(PROMPT, GREEDY)))
        for params in (GREEDY, SamplingParams(n=2, max_tokens=4)):
            with pytest.raises(ValueError, match="^prompt_token_ids contains token id 600"):
                await llm.generate_final(None, params, prompt_token_ids=[5, 600, 7])
        outs = await neighbour
        assert len(outs[-1].outputs[0].token_ids) == 12 and outs[-1].finished
        assert llm.num_unfinished_requests() == 0
        await wait_idle(llm)
        return await llm.get_stats()

    stats = attach_and(daemon, body)
    assert stats.kv_cache_usage == 0.0


SLOW_SCHEMA = {  # 18 KB, shallow; 1-2 s to compile for the tiny model's 512-token vocabulary
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,30}"} for i in range(300)},
    "required": [f"p{i}" for i in range(300)],
}


@pytest.mark.timeout(240)
def test_a_slow_grammar_compiles_while_other_streams_go_on(daemon):
    """Issue 39: a schema that takes seconds to compile must not stall the batch. The
    frontend checks it on a thread and the workers compile it on a thread of their own while
    the request waits in the engine core; meanwhile another stream's largest gap between two
    tokens stays under a second (it was the whole compile: 16.9 s in the probe)."""

    async def body(llm):
        constrained = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=(
            StructuredOutputsParams(json=SLOW_SCHEMA)))
        gaps, done = [], asyncio.Event()

        async def stream_until_done():
            while not done.is_set():
                last = None
                async for _ in llm.generate(PROMPT, LONG):
                    now = time.monotonic()
                    if last is not None and not done.is_set():
                        gaps.append(now - last)
                    last = now
                    if done.is_set():
                        break

        streaming = asyncio.ensure_future(stream_until_done())
        try:
            while not gaps:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            final = await llm.generate_final(PROMPT, constrained)
            took = time.monotonic() - start
        finally:
            done.set()
            await streaming
        return final, took, max(gaps)

    final, took, largest_gap = attach_and(daemon, body, timeout=200)
    print(f"constrained request took {took:.2f} s; largest gap {largest_gap:.3f} s")
    assert final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text.startswith('{')
    assert took > 1.0, f"the schema compiled in {took:.2f} s: too fast to show anything"
    assert largest_gap < 1.0, (f"another stream waited {largest_gap:.2f} s for a token while "
                               f"the grammar compiled ({took:.1f} s)")


@pytest.mark.timeout(120)
def test_engine_death_ends_every_pending_request_with_error(daemon):
    """Runs last: SIGKILL the daemon mid-generation. No core comes back within the 2 s
    engine_restart_timeout: every pending generate() ends with finish_reason "error" within
    a bounded time, and new requests are refused with EngineUnavailable (the daemon was not
    ours: a core may come back at its address)."""

    async def body(llm):
        streams = [llm.generate([5 + i, 6, 7], LONG).__aiter__() for i in range(3)]
        for s in streams:
            await s.__anext__()
        os.kill(daemon.pid, signal.SIGKILL)
        killed = time.monotonic()
        lasts = []
        for s in streams:
            last = None
            async for out in s:
                last = out
            lasts.append(last)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineUnavailable, match="no engine core is attached"):
            await collect(llm.generate(PROMPT, GREEDY))
        return lasts, elapsed, llm.attached, llm.dead

    lasts, elapsed, attached, dead = attach_and(daemon, body, timeout=30,
                                                engine_restart_timeout=2.0)
    assert not attached and not dead and elapsed < 10
    for last in lasts:
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert "within 2 s" in last.outputs[0].error
