"""The decoder layers in one C call (`kernels/cpu/fused_layers.py`, which the CPU op seam gives a
model, `CpuOps.decoder_layers`) compute what the layers' own calls compute, to float32
rounding, on every kind of step it takes, and leave the others to the layers; `cpu_kernels`
with `no-fused` leaves them out."""

import numpy as np
import pytest
import torch

from tidal.ipc.messages import SamplingParams
from tidal.kernels.cpu import fused_layers, small_m_gemm
from worker_test_utils import (
    PlanScript,
    chunked_logits,
    hf_logits,
    loaded_worker,
    prompt_ids,
    rel_err,
)

pytestmark = pytest.mark.skipif(not fused_layers.FusedLayers.available(),
                                reason="the C kernels (a compiler, AVX-512 or AVX2) are not here")


def test_exp_is_within_two_ulp_of_the_exact_value():
    x = torch.linspace(-88.0, 88.0, 400_001, dtype=torch.float32)
    got = fused_layers.exp(x).to(torch.float64)
    exact = torch.exp(x.to(torch.float64))
    ulp = torch.from_numpy(np.spacing(exact.to(torch.float32).numpy())).to(torch.float64)
    assert ((got - exact).abs() / ulp).max().item() <= 2.0


def test_silu_equals_torch_to_float32_rounding():
    g = torch.randn(10_003, generator=torch.Generator().manual_seed(0)) * 6
    g[:3] = torch.tensor([0.0, -90.0, 90.0])
    ours, ref = fused_layers.silu(g), torch.nn.functional.silu(g)
    assert torch.allclose(ours, ref, rtol=2e-6, atol=1e-30)
    assert ours[1].item() == pytest.approx(0.0, abs=1e-30) and ours[2].item() == 90.0


def float_panels_here() -> bool:
    """Whether this build keeps float32 weights as panels for every small batch (AVX-512):
    these tests' steps need them; an AVX2 build's float panels take steps of up to
    AVX2_PANEL_ROWS rows only, and oneDNN larger ones (the layers then run from Python)."""
    library = small_m_gemm.load()
    return library is not None and library.tidal_panel_gemm_vector_floats() >= 16


needs_float_panels = pytest.mark.skipif(not float_panels_here(),
                                        reason="no float panels in this build (AVX2)")


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def fused_worker(path):
    worker = loaded_worker(path, "float32", max_num_batched_tokens=1024, max_model_len=512)
    assert worker.runner.model.model.fused is not None, "the tiny Llama takes the fused call"
    return worker


@needs_float_panels
def test_logits_equal_the_layers_calls_and_transformers_in_every_kind_of_step(llama):
    """Chunks of 1 (decode-like rows), 7 (short chunks: rows), 64 and 200 (the blocked prefill
    kernel) go through the fused call; the same worker with it switched off gives the same
    logits to float32 rounding, and both match transformers as the issue-3 test asks."""
    tokens = prompt_ids(n=200)
    ref = hf_logits(llama, "float32", tokens)
    worker = fused_worker(llama)
    for chunk in (1, 7, 64, 200):
        ours, plain = fused_and_plain_logits(worker, tokens, chunk)
        assert rel_err(ours, plain) < 1e-6, chunk
        assert rel_err(ours, ref) < 1e-5, chunk


def fused_and_plain_logits(worker, tokens, chunk):
    """The prompt's logits fed `chunk` tokens a step, with the fused call and then with the
    same worker's layers calling their kernels one by one."""
    fused = worker.runner.model.model.fused
    ours = chunked_logits(worker, tokens, chunk, req_id=f"f{chunk}")
    worker.runner.batch.remove(f"f{chunk}")
    worker.runner.model.model.fused = None
    try:
        plain = chunked_logits(worker, tokens, chunk, req_id=f"p{chunk}")
        worker.runner.batch.remove(f"p{chunk}")
    finally:
        worker.runner.model.model.fused = fused
    return ours, plain


def run_greedy(worker, prompts, chunk):
    script = PlanScript()
    for i, prompt in enumerate(prompts):
        script.add(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))
    return script.run(worker, chunk=chunk)


@needs_float_panels
@pytest.mark.parametrize("chunk", [16, 150])
def test_mixed_batches_sample_what_the_layers_calls_sample(llama, chunk):
    """Several requests of different lengths decoding while others prefill, in chunks of 16
    (rows) or 150 (blocked kernel; two such chunks make a 300-token step, past the fused
    call's 256: the layers take that one): greedy tokens equal with and without it
    (`cpu_kernels=auto,no-fused`)."""
    prompts = [prompt_ids(seed=s, n=n) for s, n in enumerate((3, 40, 150, 150, 17))]
    with_fused = run_greedy(fused_worker(llama), prompts, chunk)
    plain = loaded_worker(llama, "float32", max_num_batched_tokens=1024, max_model_len=512,
                          cpu_kernels="auto,no-fused")
    assert plain.runner.model.model.fused is None
    assert with_fused == run_greedy(plain, prompts, chunk)


@needs_float_panels
def test_a_slot_past_the_cache_is_an_index_error(llama):
    """As the layers' own K/V write (tidal_write_kv's bound): the step fails loudly."""
    worker = fused_worker(llama)
    runner = worker.runner
    num_blocks = runner.kv_caches[0][0].shape[0]
    script = PlanScript(first_block=num_blocks - 1)  # the 20-token prompt's second block
    script.add("late", prompt_ids(n=20))  # is past the cache's last one
    with pytest.raises(IndexError, match="past the cache"):
        runner.compute_logits_all(script.plan())


def test_a_quantized_models_few_row_steps_read_its_blocks_and_larger_ones_float_panels(
        tiny_gguf_factory, tmp_path):
    """A de-quantized GGUF's layers keep their 4-bit blocks for products of up to the panel
    kernel's block rows and float panels above (AMX tiles, where AMX is here, which the fused
    call leaves to the layers): one fused call for each range of steps, and each gives the
    layers' own calls' logits (decode-like rows, short and long chunks)."""
    from tidal.kernels.cpu import amx_gemm
    from tidal.workers.gguf import gguf_folder

    folder = gguf_folder(tiny_gguf_factory("Q4_1"), str(tmp_path))
    worker = fused_worker(folder)
    fused = worker.runner.model.model.fused
    if amx_gemm.load() is not None:
        assert fused.ranges == [(1, small_m_gemm.AMX_BLOCK_ROWS)]
    elif small_m_gemm.float_panels():
        block_rows = small_m_gemm.block_rows()
        assert fused.ranges == [(1, block_rows), (block_rows + 1, 256)]
    else:  # AVX2: the blocks up to a few rows, oneDNN (no fused call) above
        assert fused.ranges == [(1, small_m_gemm.AVX2_BLOCK_ROWS)]
    tokens = prompt_ids(n=200)
    for chunk in (1, 7, 64, 200):
        ours, plain = fused_and_plain_logits(worker, tokens, chunk)
        assert rel_err(ours, plain) < 1e-6, chunk


def verification_logits(worker, prompts, drafts):
    """Logits of a step where each request has a few query rows: its next token and its
    drafts (speculative decoding's verification), after its prompt's own step."""
    from tidal.ipc.messages import pack_token_ids
    from tidal.ipc.worker_messages import BatchPlan, CachedRequestData, NewRequestData

    sampling = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    new = [NewRequestData(f"v{i}", pack_token_ids(p), len(p), blocks[i], 0, len(p), sampling)
           for i, p in enumerate(prompts)]
    worker.execute(BatchPlan(1, new_requests=new,
                             total_num_scheduled_tokens=sum(map(len, prompts))))
    cached = [CachedRequestData(f"v{i}", [], len(p), 1 + len(d), spec_token_ids=pack_token_ids(d))
              for i, (p, d) in enumerate(zip(prompts, drafts))]
    logits = worker.runner.compute_logits_all(BatchPlan(
        2, cached_requests=cached, total_num_scheduled_tokens=sum(1 + len(d) for d in drafts)))
    for i in range(len(prompts)):
        worker.runner.batch.remove(f"v{i}")
    return logits


def test_a_verification_steps_few_rows_per_request_take_the_fused_call(tiny_gguf_factory,
                                                                      tmp_path):
    """Two requests verifying 2 and 3 drafts (7 rows, 3 and 4 a request: the row attention
    takes each as a short chunk) go through the fused call on a de-quantized GGUF (the
    blocks' kernel, AVX2 included) and give the layers' own calls' logits and argmax."""
    from tidal.workers.gguf import gguf_folder

    folder = gguf_folder(tiny_gguf_factory("Q4_1"), str(tmp_path))
    fused_w = fused_worker(folder)
    fused = fused_w.runner.model.model.fused
    calls = []  # the rows of each step the fused call took
    for_step = fused.for_step

    def recording(hidden, plan):
        call = for_step(hidden, plan)
        if call is not None:
            calls.append(hidden.shape[0])
        return call

    fused.for_step = recording
    prompts = [prompt_ids(seed=1, n=30), prompt_ids(seed=2, n=45)]
    drafts = [[5, 6], [7, 8, 9]]
    ours = verification_logits(fused_w, prompts, drafts)
    assert 7 in calls  # the verification step ran in one fused call
    plain = loaded_worker(folder, "float32", max_num_batched_tokens=1024, max_model_len=512,
                          cpu_kernels="auto,no-fused")
    theirs = verification_logits(plain, prompts, drafts)
    assert ours.shape == theirs.shape == (7, ours.shape[1])
    assert rel_err(ours, theirs) < 1e-6
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
