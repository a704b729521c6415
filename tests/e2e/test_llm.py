"""`LLM` through the whole process tree (frontend → engine-core daemon → worker processes).

Issue 4, items 1, 2, 3 and 6:

1. Greedy outputs equal transformers' `generate()` (float32, the same folder) for 16 prompts of
   mixed length, 4 of them sharing a 40-token prefix, under three daemons that together cover
   every configuration: the defaults (TP=1, async off as on any CPU, prefix caching: a second
   pass hits);
   `max_num_batched_tokens=32` (every prompt chunked) with the priority policy and async off;
   a 7-block KV cache (preemptions, the counter must move) at TP=2 with async on.
   Near-ties: where transformers' top-2 logit gap is below 1e-4 a rounding difference may
   flip the argmax legitimately, so (as vLLM's tests do) a sequence is compared up to its first
   such position only.
2. Two frontends attached to one daemon at once each get exactly their own outputs; a third
   attaches later and is served.
3. A frontend SIGKILLed mid-generation: within the daemon's frontend timeout its requests are
   aborted and the block pool is all free again, while another frontend's requests complete.
6. Stop strings (also across token boundaries), n > 1, per-request seeds, min_tokens.

Every test has a pytest timeout, and every daemon start a start-up timeout, so a broken engine
fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tidal.engine_core.launcher import DaemonProcess
from tidal.frontend.llm import LLM, engine_config_from_kwargs
from tidal.ipc.messages import SamplingParams

MAX_TOKENS = 10
FRONTEND_TIMEOUT_S = 3.0
STARTUP_TIMEOUT_S = 120.0
SMALL_KV = "64MiB"  # a CPU KV cache is made resident at start-up; the default is up to 4 GiB
TIE_GAP = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


# ---------------------------------------------------------------------------------------------
# prompts and the transformers oracle


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 token-id prompts: 12 of mixed length, then 4 sharing a 40-token prefix."""
    rng = random.Random(4)
    lens = [3, 5, 7, 9, 12, 17, 20, 25, 33, 40, 50, 61]
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in lens]
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    out += [prefix + [rng.randrange(3, 512) for _ in range(k)] for k in (1, 3, 6, 9)]
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """transformers' greedy tokens and, per generated position, the top-2 logit gap."""
    return hf_greedy(tiny_llama, prompts, MAX_TOKENS)


def hf_greedy(model_dir: str, prompts, max_new_tokens: int):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(p):].tolist()
            gaps = []
            for logits in gen.logits:
                top2 = torch.topk(logits[0].float(), 2).values
                gaps.append(float(top2[0] - top2[1]))
            result.append((tokens, gaps))
    return result


def assert_greedy_equal(outputs, reference) -> None:
    """Each output's tokens equal the oracle's, up to the oracle's first near-tie (if any)."""
    for i, (out, (ref_tokens, gaps)) in enumerate(zip(outputs, reference)):
        got = out.outputs[0].token_ids
        tie = next((k for k, g in enumerate(gaps) if g < TIE_GAP), None)
        if tie is None:
            assert got == ref_tokens, f"prompt {i}: {got} != {ref_tokens}"
        else:
            assert got[:tie] == ref_tokens[:tie], f"prompt {i} (tie at {tie})"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# ---------------------------------------------------------------------------------------------
# one shared daemon (defaults, short frontend timeout) for the tests that do not kill it


@pytest.fixture(scope="module")
def daemon(tiny_llama, reference):
    config = engine_config_from_kwargs(tiny_llama, kv_cache_memory=SMALL_KV)
    d = DaemonProcess(config, echo=False,
                      extra_args=["--frontend-timeout", str(FRONTEND_TIMEOUT_S)])
    yield d
    code = d.stop(timeout=20)
    assert code == 0, d.failure_message("daemon did not stop cleanly")


@pytest.fixture(scope="module")
def llm(daemon):
    with LLM(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S) as frontend:
        yield frontend


# ---------------------------------------------------------------------------------------------
# item 1: greedy == transformers under every configuration


@pytest.mark.timeout(240)
def test_greedy_defaults_and_prefix_cache_hits(llm, prompts, reference):
    """Defaults (TP=1, async scheduling off on the CPU, prefix caching). A second pass over
    the same prompts hits the prefix cache (the shared 40-token prefix holds 2 full blocks of
    16) and gives the same tokens."""
    before = llm.get_stats()
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in first] == prompts  # input order
    assert_greedy_equal(first, reference)
    mid = llm.get_stats()
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    after = llm.get_stats()
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert after.prefix_cache_hits > mid.prefix_cache_hits >= before.prefix_cache_hits
    assert any(o.metrics.num_cached_tokens >= 32 for o in second[-4:])
    assert after.num_running == 0 and after.num_waiting == 0


@pytest.mark.timeout(240)
def test_greedy_chunked_prefill_priority_sync(tiny_llama, prompts, reference):
    """max_num_batched_tokens=32 (every prompt but the shortest is chunked), priority policy
    with mixed priorities, async scheduling off, prefix caching off; then the daemon's faults
    (a stop and a kill) are healed."""
    with LLM(tiny_llama, kv_cache_memory=SMALL_KV, max_num_batched_tokens=32, max_num_seqs=16,
             scheduling_policy="priority", async_scheduling=False, enable_prefix_caching=False,
             frontend_timeout=FRONTEND_TIMEOUT_S, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                               priority=[i % 3 for i in range(len(prompts))])
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.prefix_cache_hits == 0
        assert stats.prompt_tokens >= sum(len(p) for p in prompts)
        assert_daemon_faults_are_healed_then_final(llm)


def generate_signalling_the_daemon(llm: LLM, prompts, params, sig: int) -> list:
    """llm.generate(prompts, params), sending `sig` to the private daemon (alone: its workers
    exit with it, or stall on it) once the first tokens have arrived; the outputs."""
    result = {}
    num_tokens_before = llm._llm.num_generated_tokens
    worker = threading.Thread(
        target=lambda: result.setdefault("out", llm.generate(prompts, params, use_tqdm=False)))
    worker.start()
    wait_until(lambda: llm._llm.num_generated_tokens > num_tokens_before, 30,
               "the first tokens")
    assert worker.is_alive(), "generate() ended before the fault: give it longer requests"
    os.kill(llm.daemon_pid, sig)
    worker.join(timeout=150)
    assert not worker.is_alive(), "generate() did not return after the engine died"
    return result["out"]


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_daemon_faults_are_healed_then_final(llm: LLM) -> None:
    """SIGSTOP the private daemon during generate() (silent past its frontend timeout, the LLM
    kills it), then SIGKILL it during another: each time it is started again, the unfinished
    requests are resubmitted, and generate() returns what a fault-free run returns (greedy,
    and seeded sampling: the same seed and positions draw the same numbers); the old
    daemon's workers are gone. With its restarts used up, a third fault is final: every
    request ends with "error", later calls raise, close() leaves no process behind."""
    # 480 tokens (the model's max_model_len is 512): long enough that each fault lands
    # mid-generation on a busy machine (150 ended first once steps took ~0.5 ms)
    long = [SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True, stop=["zzzz"]),
            SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=480,
                           ignore_eos=True)]
    prompts = [[5, 6, 7], [9, 10, 11, 12], [5, 6, 7]]
    expected = llm.generate(prompts, long, use_tqdm=False)
    for num_restarts, sig in enumerate((signal.SIGSTOP, signal.SIGKILL), start=1):
        faulty_pid = llm.daemon_pid
        healed = generate_signalling_the_daemon(llm, prompts, long, sig)
        assert llm._llm.num_engine_restarts == num_restarts and llm.daemon_pid != faulty_pid
        assert llm._llm.num_resubmitted >= num_restarts
        for got, want in zip(healed, expected):
            assert got.outputs[0].finish_reason == "length"
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].text == want.outputs[0].text
        wait_until(lambda: group_gone(faulty_pid), 10, "the faulty daemon's workers to exit")

    llm._llm.supervisor.budget.limit = 2  # used up: the next death is final
    pgid = llm.daemon_pid
    lost = generate_signalling_the_daemon(llm, prompts, long, signal.SIGKILL)
    assert [o.outputs[0].finish_reason for o in lost] == ["error"] * 3
    with pytest.raises(RuntimeError, match="dead"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    llm.close()
    wait_until(lambda: group_gone(pgid), 10, "the daemon's workers to exit")


@pytest.mark.timeout(300)
def test_greedy_tiny_kv_cache_preempts_tp2(tiny_llama, prompts, reference):
    """7 usable KV blocks of 16 tokens for 16 requests of up to 71 tokens: requests are
    preempted (recomputed) and still give the same tokens; TP=2, async scheduling on."""
    with LLM(tiny_llama, num_gpu_blocks_override=8, max_model_len=112, tensor_parallel_size=2,
             async_scheduling=True, startup_timeout=STARTUP_TIMEOUT_S) as llm:
        assert llm.engine_info.num_kv_blocks == 8
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0


INT8_KV_EXACT_PROMPTS = 11
"""Issue 36: of these 16 prompts, how many must give exactly transformers' (float32) 10
greedy tokens with an int8 KV cache. Not token-exact by nature: measured 12 of 16, the other
4 leaving at positions where float32's top-2 logit gap is 0.004-0.10 (a random tiny model's
logits lie close together; SmolLM2's agreement and |delta logprob|: docs/kv-cache-dtype.md)."""


@pytest.mark.timeout(300)
def test_int8_kv_cache_tiny_pool_agrees_and_frees_every_block(tiny_llama, prompts, reference):
    """--kv-cache-dtype int8 with 7 usable blocks for 16 requests: preemptions happen, at
    least INT8_KV_EXACT_PROMPTS prompts' greedy tokens equal float32 transformers', and every
    block is free at the end."""
    with LLM(tiny_llama, kv_cache_dtype="int8", num_gpu_blocks_override=8, max_model_len=112,
             startup_timeout=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        exact = sum(out.outputs[0].token_ids == ref_tokens
                    for out, (ref_tokens, _) in zip(outputs, reference))
        assert exact >= INT8_KV_EXACT_PROMPTS, f"{exact} of {len(prompts)} prompts exact"
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        assert stats.kv_cache_usage == 0.0


# ---------------------------------------------------------------------------------------------
# item 2: several frontends on one daemon


@pytest.mark.timeout(180)
def test_frontends_get_their_own_outputs_and_a_late_one_is_served(daemon, prompts, reference):
    """Two LLMs attached at once generate different halves concurrently (same request ids on
    purpose: "0", "1", ...); each gets exactly its own results. A third attaches later."""
    a = LLM(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S)
    b = LLM(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S)
    try:
        results = {}

        def run(name, frontend, idx):
            results[name] = frontend.generate([prompts[i] for i in idx], GREEDY, use_tqdm=False)

        halves = {"a": list(range(0, 16, 2)), "b": list(range(1, 16, 2))}
        threads = [threading.Thread(target=run, args=(n, f, halves[n]))
                   for n, f in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for name, frontend in (("a", a), ("b", b)):
            idx = halves[name]
            assert [o.prompt_token_ids for o in results[name]] == [prompts[i] for i in idx]
            assert_greedy_equal(results[name], [reference[i] for i in idx])
            assert frontend._llm._processor.num_unknown_outputs == 0
        with LLM(engine=daemon.address, startup_timeout=STARTUP_TIMEOUT_S) as c:
            late = c.generate(prompts[:3], GREEDY, use_tqdm=False)
            assert_greedy_equal(late, reference[:3])
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------------------
# item 3: a frontend killed mid-generation

_DOOMED_FRONTEND = """
import asyncio, sys
from tidal.frontend.async_llm import AsyncLLM, run
from tidal.ipc.messages import SamplingParams

async def main():
    llm = await AsyncLLM.create(engine=sys.argv[1])
    params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    streams = [llm.generate([5 + i, 6, 7, 8], params).__aiter__() for i in range(4)]
    for s in streams:
        await s.__anext__()  # every request is running in the engine
    print("GENERATING", flush=True)
    await asyncio.sleep(3600)

run(main())
"""


@pytest.mark.timeout(180)
def test_killed_frontend_requests_are_aborted_and_blocks_freed(daemon, llm, prompts,
                                                                reference, tmp_path):
    script = tmp_path / "doomed.py"
    script.write_text(_DOOMED_FRONTEND)
    doomed = subprocess.Popen([sys.executable, str(script), daemon.address],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = doomed.stdout.readline()
        assert line.strip() == "GENERATING", "the doomed frontend did not start generating"
        assert llm.get_stats().num_running >= 4
        os.kill(doomed.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # the other frontend keeps being served meanwhile
        outputs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, reference[:6])

        def pool_free():
            s = llm.get_stats()
            return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0

        wait_until(pool_free, FRONTEND_TIMEOUT_S + 10, "the killed frontend's blocks")
        assert time.monotonic() - killed_at < FRONTEND_TIMEOUT_S + 10
        wait_until(lambda: "silent for" in daemon.stderr_tail(200), 5,
                   "the daemon's log line about the silent frontend")
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# item 6: stop strings, n > 1, seeds, min_tokens


def _clean_boundary_stop(tokenizer, prompt, token_ids) -> str | None:
    """A stop string made of the end of one generated token and the start of the next."""
    from tidal.frontend.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, prompt, True)
    pieces = [detok.step(t) for t in token_ids]
    for k in range(1, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            return a[-2:] + b[:2]
    return None


@pytest.mark.timeout(120)
def test_stop_strings_across_token_boundaries(llm, prompts):
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = llm.generate(prompts, long, use_tqdm=False)
    cases = []
    for p, out in zip(prompts, base):
        stop = _clean_boundary_stop(llm.tokenizer, p, out.outputs[0].token_ids)
        if stop is not None:
            cases.append((p, out.outputs[0].text, stop))
    assert len(cases) >= 3, "too few prompts with a clean token boundary to test"
    cases = cases[:6]
    for include in (False, True):
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s],
                                 include_stop_str_in_output=include) for _, _, s in cases]
        outs = llm.generate([p for p, _, _ in cases], params, use_tqdm=False)
        for (p, full_text, stop), out in zip(cases, outs):
            comp = out.outputs[0]
            end = full_text.find(stop) + (len(stop) if include else 0)
            assert comp.text == full_text[:end]
            assert comp.finish_reason == "stop" and comp.stop_reason == stop
    stats = llm.get_stats()  # the frontend aborted them in the core: nothing left running
    assert stats.num_running == 0


@pytest.mark.timeout(120)
def test_n_and_per_request_seeds(llm, prompts):
    """n=3 gives 3 indexed completions, reproducible with a seed and independent of what else
    is in the batch; a seeded request alone and inside a batch of others gives the same."""
    sampled = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate([prompts[4]], sampled, use_tqdm=False)
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in alone.outputs)
    texts = [tuple(c.token_ids) for c in alone.outputs]
    assert len(set(texts)) > 1, "the n completions should differ (seeds seed+i)"
    others = [SamplingParams(temperature=0.9, max_tokens=8, seed=i) for i in range(6)]
    batch = llm.generate(prompts[:6] + [prompts[4]], others + [sampled], use_tqdm=False)
    assert [tuple(c.token_ids) for c in batch[-1].outputs] == texts
    single = SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)
    a = llm.generate([prompts[2]], single, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(prompts[:5], [single if i == 2 else others[i] for i in range(5)],
                     use_tqdm=False)[2].outputs[0].token_ids
    assert a == b


@pytest.mark.timeout(120)
def test_min_tokens_defers_eos(llm, reference, prompts):
    """A prompt whose greedy continuation hits EOS early: with min_tokens past that point the
    engine does not stop at EOS before min_tokens tokens exist."""
    eos = llm.tokenizer.eos_token_id
    candidates = [i for i, (toks, _) in enumerate(reference) if eos in toks[:-1] or
                  (toks and toks[-1] == eos and len(toks) < MAX_TOKENS)]
    if not candidates:  # search short prompts for one that ends early
        extra = [[t, 6, 7] for t in range(3, 60)]
        ref = llm.generate(extra, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
        candidates_p = [extra[i] for i, o in enumerate(ref)
                        if o.outputs[0].finish_reason == "stop" and
                        len(o.outputs[0].token_ids) < 10]
        assert candidates_p, "no prompt found whose greedy output ends with EOS early"
        prompt = candidates_p[0]
    else:
        prompt = prompts[candidates[0]]
    early = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.token_ids[-1] == eos
    k = len(early.token_ids)
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k + 6,
                                                 min_tokens=k + 3), use_tqdm=False)
    comp = held[0].outputs[0]
    assert len(comp.token_ids) >= k + 3
    assert eos not in comp.token_ids[:k + 3 - 1]
    assert comp.token_ids[:k - 1] == early.token_ids[:k - 1]


@pytest.mark.timeout(60)
def test_prompt_longer_than_context_is_refused_before_sending(llm):
    max_len = llm.engine_info.max_model_len
    with pytest.raises(ValueError, match=rf"{max_len} tokens.*is {max_len}"):
        llm.generate([[5] * max_len], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)


@pytest.mark.timeout(60)
def test_prompt_outside_the_vocabulary_is_refused_before_sending(llm):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        llm.generate([[5, 6], [5, 600]], GREEDY, use_tqdm=False)


@pytest.mark.timeout(120)
def test_a_request_the_engine_refuses_stops_the_batch_with_value_error(llm, monkeypatch):
    """Should a prompt get past the frontend's checks (here they are switched off), the
    engine core refuses it: generate() raises ValueError naming the field, the rest of the
    batch is aborted, the engine is idle after, and the same LLM goes on working."""
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    generated_before = llm.get_stats().generation_tokens
    monkeypatch.setattr(llm._llm, "encode_prompt", lambda prompt: list(prompt))
    with pytest.raises(ValueError, match="^prompt_token_ids contains token id 600"):
        llm.generate([[5, 6, 7], [5, 600], [8, 9]], long, use_tqdm=False)
    monkeypatch.undo()
    wait_until(lambda: llm.get_stats().num_running == 0 and llm.get_stats().num_waiting == 0,
               20, "the rest of the batch to be aborted")
    stats = llm.get_stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.generation_tokens - generated_before < 480  # two were cut short, not run out
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0


@pytest.mark.timeout(120)
def test_tidal_generate_cli_attached(daemon, llm):
    """`tidal generate PROMPT --engine ADDRESS` prints the same greedy completion."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].text
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.frontend.cli", "generate", "Hello world", "--engine",
         daemon.address, "--max-tokens", "8"],
        capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    # the CLI uses greedy with EOS honoured: its text is a prefix of the ignore_eos text
    assert proc.stdout.endswith("\n") and want.startswith(proc.stdout[:-1])


@pytest.mark.timeout(60)
def test_logprobs_through_the_engine(llm, prompts, reference):
    """Greedy with logprobs=2: one entry per token, the sampled token ranked first (it is the
    argmax), two alternatives, log-probabilities <= 0, cumulative = the sum."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    assert_greedy_equal(outs, reference[:4])
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids)
        total = 0.0
        for token_id, entry in zip(comp.token_ids, comp.logprobs):
            assert entry[token_id].rank == 1 and len(entry) == 2
            assert all(lp.logprob <= 1e-6 for lp in entry.values())
            assert sorted(lp.rank for lp in entry.values()) == [1, 2]
            assert entry[token_id].decoded_token == llm.tokenizer.decode([token_id])
            total += entry[token_id].logprob
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
