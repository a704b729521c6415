"""Issue 3, item 2: greedy generation through Worker.execute with scripted plans equals
transformers' generate() token for token, 8 prompts of mixed length in one batch."""

import msgspec
import pytest
import torch
import transformers

from tidal.ipc.messages import SamplingParams
from tidal.workers.worker import Worker
from worker_test_utils import AsyncPlanScript, PlanScript, worker_config

NUM_NEW = 10
EOS = 0  # the tiny models' <|endoftext|>
LENGTHS = (1, 3, 9, 16, 17, 31, 50, 75)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    results = []
    for prompt in _prompts():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, do_sample=False)
        results.append(out[0, len(prompt):].tolist())
    return results


@pytest.fixture(scope="module")
def llama_worker(tiny_llama):
    worker = Worker(worker_config(tiny_llama))
    worker.load()
    worker.init_kv_cache(worker.determine_num_kv_blocks())
    return worker


def _greedy() -> SamplingParams:
    # min_tokens masks EOS like generate(min_new_tokens=...)
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)


@pytest.mark.parametrize("chunk", [10**9, 16])
def test_batched_greedy_equals_generate(hf_greedy, llama_worker, chunk):
    """All 8 prompts in one batch; with chunk=16 long prompts prefill in chunks while the
    short ones already decode (mixed prefill/decode steps)."""
    script = PlanScript()
    for i, prompt in enumerate(_prompts()):
        script.add(f"r{i}", prompt, _greedy(), eos_token_id=EOS)
    outputs = script.run(llama_worker, chunk=chunk)
    for i, prompt in enumerate(_prompts()):
        assert outputs[f"r{i}"] == hf_greedy[i], f"prompt {i}"


@pytest.mark.parametrize("sampling", [
    _greedy(),
    SamplingParams(temperature=0.9, top_k=50, seed=77, max_tokens=NUM_NEW),
], ids=["greedy", "seeded"])
def test_preempted_request_resumes_identically(llama_worker, sampling):
    """A request preempted after 4 tokens comes back as a new request carrying prompt +
    generated tokens (num_computed 0): the continuation equals the uninterrupted run
    (for a seeded request too: its draws depend only on (seed, position))."""
    prompt = _prompts()[5]
    script = PlanScript()
    script.add("x", prompt, sampling, eos_token_id=EOS)
    reference = script.run(llama_worker)["x"]

    script = PlanScript(first_block=40)
    req = script.add("y", prompt, sampling, eos_token_id=EOS)
    while len(req.output_ids) < 4:
        script.record(llama_worker.execute(script.plan()))
    resumed = script.add("y", req.token_ids, sampling, eos_token_id=EOS)
    resumed.prompt_len = len(prompt)
    plan = script.plan()
    plan.preempted_req_ids.append("y")
    script.record(llama_worker.execute(plan))
    outputs = script.run(llama_worker)
    assert outputs["y"] == reference


def test_step_with_only_mid_prompt_chunks_samples_nothing(llama_worker):
    script = PlanScript(first_block=60)
    script.add("p", _prompts()[7], _greedy())
    sampled = llama_worker.execute(script.plan(chunk=16))
    assert sampled.req_ids == [] and sampled.token_ids == b""


@pytest.mark.parametrize("chunk", [10**9, 16])
def test_async_scheduling_equals_sync(hf_greedy, llama_worker, chunk):
    """Plans built one step ahead with placeholder tokens give the same tokens."""
    script = AsyncPlanScript()
    for i, prompt in enumerate(_prompts()):
        script.add(f"a{i}", prompt, _greedy(), eos_token_id=EOS)
    outputs = script.run(llama_worker, chunk=chunk)
    assert [outputs[f"a{i}"] for i in range(len(LENGTHS))] == hf_greedy


def test_resumed_tokens_count_as_output_for_penalties(llama_worker):
    """A resubmitted request (prompt = the original prompt + what a lost engine core had
    generated, `num_resumed_tokens` saying how many) goes on exactly as the original did:
    presence and frequency penalties see the resumed tokens as output, not prompt."""
    prompt = _prompts()[5]
    # seeded sampling draws by (seed, position), so the continuation is reproducible, and at
    # temperature 1 the penalties move the draws (greedy on this peaked tiny model they do not)
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=12, frequency_penalty=2.0,
                              presence_penalty=2.0)
    script = PlanScript()
    script.add("whole", prompt, sampling)
    whole = script.run(llama_worker)["whole"]

    rest = msgspec.structs.replace(sampling, max_tokens=6)
    script = PlanScript(first_block=40)
    script.add("resumed", prompt + whole[:6], rest, num_resumed_tokens=6)
    script.add("as_prompt", prompt + whole[:6], rest)
    out = script.run(llama_worker)
    assert out["resumed"] == whole[6:]
    assert out["as_prompt"] != whole[6:]  # the penalties matter here: as prompt, they differ
