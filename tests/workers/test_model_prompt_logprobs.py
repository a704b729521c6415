"""Prompt logprobs in the worker equal transformers' log-softmax of its logits on the same
folder (float32, tolerance 1e-4 absolute on log-probabilities: the logits agree to ~1e-6
relative, see test_model_logits.py), whole or chunked, and only the requests that ask get
them."""

from array import array

import pytest
import torch
import transformers

from tidal.ipc.messages import SamplingParams, unpack_token_ids
from tidal.workers import model_runner
from tidal.workers.worker import Worker
from worker_test_utils import PlanScript, worker_config

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def worker(tiny_llama):
    w = Worker(worker_config(tiny_llama, dtype="float32"))
    w.load()
    w.init_kv_cache(w.determine_num_kv_blocks())
    return w


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def reference(tiny_llama, prompt):
    """transformers' log-softmax at every position: row q is the distribution of token q+1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _rows(part):
    """[(position, [ids], [values], rank)] of one PromptLogprobs."""
    width = 1 + part.num_logprobs
    ids = unpack_token_ids(part.token_ids).tolist()
    values = array("f")
    values.frombytes(part.logprobs)
    ranks = unpack_token_ids(part.ranks).tolist()
    return [(part.start + i, ids[i * width:(i + 1) * width],
             list(values[i * width:(i + 1) * width]), ranks[i])
            for i in range(part.num_positions)]


def _run(worker, script, chunk):
    """Step to the end; every step's prompt logprobs, in order, per request."""
    parts = {}
    while script.requests:
        sampled = worker.execute(script.plan(chunk))
        for part in sampled.prompt_logprobs:
            parts.setdefault(part.req_id, []).append(part)
        script.record(sampled)
    return parts


@pytest.mark.parametrize("chunk,min_rows", [(1000, 64), (1000, 8), (10, 64), (1, 64)])
def test_prompt_logprobs_match_transformers(worker, prompt, reference, chunk, min_rows,
                                            monkeypatch):
    """Positions 1..36 each come once (chunked: one piece per chunk, in order); each row is
    the prompt token's logprob and rank, then the top 3, all as transformers computes them.
    With min_rows 8 the logits come in slices of max_num_seqs = 16 rows (three for the 36
    positions of the whole prompt). A request without prompt_logprobs gets none."""
    monkeypatch.setattr(model_runner, "MIN_PROMPT_LOGITS_ROWS", min_rows)
    script = PlanScript()
    script.add(f"want{chunk}", prompt, SamplingParams(temperature=0, max_tokens=2,
                                                      prompt_logprobs=TOP))
    script.add(f"plain{chunk}", prompt[:20], SamplingParams(temperature=0, max_tokens=2))
    parts = _run(worker, script, chunk)
    assert set(parts) == {f"want{chunk}"}
    rows = [row for part in parts[f"want{chunk}"] for row in _rows(part)]
    assert [pos for pos, *_ in rows] == list(range(1, len(prompt)))
    for pos, ids, values, rank in rows:
        ref = reference[pos - 1]
        token = prompt[pos]
        assert ids[0] == token
        assert values[0] == pytest.approx(ref[token].item(), abs=TOL)
        assert rank == int((ref > ref[token]).sum()) + 1
        top_values, top_ids = ref.topk(TOP)
        assert values[1:] == pytest.approx(top_values.tolist(), abs=TOL)
        gaps = (top_values[:-1] - top_values[1:]).tolist()
        if min(gaps) > TOL:  # no near-tie that may legitimately swap two alternatives
            assert ids[1:] == top_ids.tolist()


def test_zero_alternatives_and_the_tokens_sampled_are_unchanged(worker, prompt):
    """prompt_logprobs=0 gives the prompt token alone; asking for prompt logprobs does not
    change the tokens sampled."""
    script = PlanScript()
    script.add("zero", prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0))
    parts = _run(worker, script, 16)
    rows = [row for part in parts["zero"] for row in _rows(part)]
    assert all(len(ids) == 1 and len(values) == 1 for _, ids, values, _ in rows)
    plain = PlanScript()
    plain.add("same", prompt, SamplingParams(temperature=0, max_tokens=4))
    plain.run(worker, 16)
    assert script.done["zero"].output_ids == plain.done["same"].output_ids
