"""Worker start-up: KV sizing on CPU, the ready message, config validation, and plans the
worker must refuse."""

import msgspec
import pytest

from tidal.ipc.messages import SamplingParams
from tidal.ipc.worker_messages import BatchPlan, CachedRequestData
from tidal.kernels.attention import cpu_attention
from tidal.workers.layers import kv_heads_per_rank
from tidal.workers.worker import DEFAULT_CPU_KV_CACHE_BYTES, Worker, default_cpu_kv_blocks
from worker_test_utils import PlanScript, worker_config

# tiny Llama: 2 layers × K and V × 16 tokens × 2 KV heads × head_dim 16 × 4 bytes (float32)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _loaded(path, **overrides) -> Worker:
    worker = Worker(worker_config(path, **overrides))
    worker.load()
    return worker


def test_cpu_kv_blocks_from_kv_cache_memory(tiny_llama):
    worker = _loaded(tiny_llama, num_kv_blocks_override=None, kv_cache_memory=1 << 20)
    assert worker.runner.kv_block_bytes == BLOCK_BYTES
    assert worker.determine_num_kv_blocks() == (1 << 20) // BLOCK_BYTES
    ready = worker.ready_message()
    assert (ready.rank, ready.num_kv_blocks, ready.device) == (0, 128, "cpu")
    assert ready.load_seconds > 0


def test_int8_kv_cache_counts_the_smaller_rows(tiny_llama):
    """--kv-cache-dtype int8: a row of head_dim 16 is 16 int8 bytes and a float32 scale, so a
    block is 2 x 2 x 16 x 2 x (16 + 4) bytes and 1 MiB holds 3.2x float32's blocks; each
    layer's cache is (K, V) int8 and their scales [blocks, 16, 2] float32."""
    import torch

    worker = _loaded(tiny_llama, num_kv_blocks_override=None, kv_cache_memory=1 << 20,
                     kv_cache_dtype="int8")
    assert worker.runner.kv_block_bytes == 2 * 2 * 16 * 2 * (16 + 4)
    blocks = worker.determine_num_kv_blocks()
    assert blocks == (1 << 20) // 2560
    worker.init_kv_cache(blocks)
    k, v, k_scale, v_scale = worker.runner.kv_caches[0]
    assert (k.dtype, v.dtype, k_scale.dtype) == (torch.int8, torch.int8, torch.float32)
    assert tuple(k_scale.shape) == (blocks, 16, 2) and (k_scale[0] == 0).all()


def test_cpu_kv_default_and_override(tiny_llama, caplog):
    """Without --kv-cache-memory the CPU cache holds max_num_seqs (16) requests of
    max_model_len (256) tokens, 16 blocks each, plus the null block; the log says why."""
    worker = _loaded(tiny_llama, num_kv_blocks_override=None)
    with caplog.at_level("INFO", logger="tidal.workers.worker"):
        assert worker.determine_num_kv_blocks() == 16 * 16 + 1
    assert "room for 16 sequences x 256 tokens (--max-num-seqs x --max-model-len" in caplog.text
    assert "maximum concurrency for 256-token requests: 16.00x" in caplog.text
    assert _loaded(tiny_llama, num_kv_blocks_override=7).determine_num_kv_blocks() == 7


def test_cpu_kv_default_is_capped(tiny_llama, monkeypatch):
    """A default that would pass DEFAULT_CPU_KV_CACHE_BYTES (4 GiB; 100 blocks here) stops
    there; --kv-cache-memory is taken as given, above the cap too."""
    import tidal.workers.worker as worker_module

    assert default_cpu_kv_blocks(256, 1024, 16) == 256 * 64 + 1
    monkeypatch.setattr(worker_module, "DEFAULT_CPU_KV_CACHE_BYTES", 100 * BLOCK_BYTES)
    assert _loaded(tiny_llama, num_kv_blocks_override=None).determine_num_kv_blocks() == 100
    worker = _loaded(tiny_llama, num_kv_blocks_override=None, kv_cache_memory=300 * BLOCK_BYTES)
    assert worker.determine_num_kv_blocks() == 300


def test_too_little_kv_memory_is_an_error(tiny_llama):
    worker = _loaded(tiny_llama, num_kv_blocks_override=None, kv_cache_memory=BLOCK_BYTES)
    with pytest.raises(ValueError, match="KV blocks fit"):
        worker.determine_num_kv_blocks()


@pytest.mark.parametrize("field, value, message", [
    ("device", "tpu", "device must be"),
    ("rank", 2, "rank 2 is outside"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be"),
    ("attention_backend", "flash", "attention_backend must be"),
])
def test_bad_config_names_the_field(tiny_llama, field, value, message):
    """The worker checks the config it decodes from its command line again (EngineConfig,
    which builds it, refuses these values first)."""
    bad = msgspec.structs.replace(worker_config(tiny_llama), **{field: value})
    with pytest.raises(ValueError, match=message):
        Worker(bad).load()


@pytest.mark.parametrize("dtype, backend", [("float32", "cpu"), ("bfloat16", "torch")])
def test_auto_attention_backend_follows_the_dtype(tiny_llama, dtype, backend):
    """One backend object, chosen at load, serves every layer and the runner's step plans
    (float32: the C decode kernel where it builds here, else numba's)."""
    if backend == "cpu" and not cpu_attention.available():
        backend = "numba"
    worker = _loaded(tiny_llama, dtype=dtype)
    assert worker.runner.attention_backend.name == backend
    for layer in worker.runner.model.model.layers.values():
        assert layer.self_attn.attn.backend is worker.runner.attention_backend
        assert (layer.self_attn.num_kv_heads, layer.self_attn.head_dim) == (
            worker.runner.num_kv_heads, worker.runner.head_dim)


def test_numba_backend_for_bfloat16_is_an_error_naming_the_field(tiny_llama):
    with pytest.raises(ValueError, match="attention_backend 'numba'"):
        _loaded(tiny_llama, dtype="bfloat16", attention_backend="numba")


@pytest.mark.parametrize("total, tp, per_rank", [(4, 1, 4), (4, 2, 2), (2, 2, 1), (1, 2, 1),
                                                 (2, 4, 1)])
def test_kv_heads_per_rank_as_the_qkv_projection_shards_them(total, tp, per_rank):
    """Split evenly over ranks when there are at least as many KV heads as ranks, else one
    (replicated) head per rank."""
    assert kv_heads_per_rank(total, tp) == per_rank


def test_tp_without_init_method_is_an_error(tiny_llama):
    with pytest.raises(ValueError, match="dist_init_method is required"):
        Worker(worker_config(tiny_llama, tensor_parallel_size=2))


def test_plans_the_worker_refuses(tiny_llama):
    worker = _loaded(tiny_llama)
    worker.init_kv_cache(16)
    with pytest.raises(ValueError, match="'ghost' is not in the worker's batch"):
        worker.execute(BatchPlan(0, cached_requests=[CachedRequestData("ghost", [], 0, 1)]))
    script = PlanScript()
    script.add("r", list(range(3, 40)), SamplingParams(temperature=0.0))
    plan = script.plan()
    plan.new_requests[0].block_ids.pop()  # 37 tokens need 3 blocks of 16
    with pytest.raises(ValueError, match="37 tokens need more than its 2 KV blocks"):
        worker.execute(plan)


def test_a_bad_new_request_fails_alone_and_the_worker_goes_on(tiny_llama):
    """Defence in depth (issue 13): a new request whose own data the worker cannot run is
    refused in `failed`, naming the field, and takes no row; a later plan that still lists
    it (async scheduling) runs without it; the others' tokens are those of a run without it."""
    worker = _loaded(tiny_llama)
    worker.init_kv_cache(64)
    script = PlanScript()
    script.add("good", list(range(3, 20)))
    script.add("bad-token", [5, 600, 7])  # the tiny vocabulary has 512 ids
    script.add("bad-eos", [5, 6], eos_token_id=2**40)
    script.add("bad-plp", [5, 6], SamplingParams(max_tokens=2, prompt_logprobs=20))
    plan = script.plan()
    plan.new_requests[-1].sampling.prompt_logprobs = 600  # past the 512-token vocabulary, as
    # only a vocabulary under 20 would let through a decoded plan
    sampled = worker.execute(plan)
    assert sampled.req_ids == ["good"]
    failed = {f.req_id: f.error for f in sampled.failed}
    assert failed["bad-token"].startswith("token_ids") and "600" in failed["bad-token"]
    assert failed["bad-eos"].startswith("eos_token_id")
    assert failed["bad-plp"].startswith("prompt_logprobs") and "600" in failed["bad-plp"]
    assert len(worker.runner.batch) == 1
    for req_id in failed:
        del script.requests[req_id]
    script.record(sampled)
    plan = script.plan()
    plan.cached_requests.append(CachedRequestData("bad-token", [], 3, 1))  # planned meanwhile
    plan.total_num_scheduled_tokens += 1
    script.record(worker.execute(plan))
    script.finished += list(failed)  # the engine core finished them
    tokens = script.run(worker)["good"]
    assert not worker.runner.refused
    alone = PlanScript(first_block=40)
    alone.add("good", list(range(3, 20)))
    assert alone.run(worker)["good"] == tokens


_WITHOUT_TRITON = r"""
import sys
sys.modules["triton"] = None  # `import triton` raises ModuleNotFoundError, as when not installed
import msgspec, torch
import tidal.engine_core.core, tidal.engine_core.daemon, tidal.frontend.llm
from tidal.ipc.worker_messages import WorkerConfig
from tidal.kernels.attention import select_attention_backend
from tidal.workers.worker import Worker

for name in ("auto", "cpu", "numba", "torch", "reference"):
    select_attention_backend(name, "cpu", torch.float32)
worker = Worker(msgspec.json.decode(sys.argv[1].encode(), type=WorkerConfig))
worker.load()
worker.init_kv_cache(worker.determine_num_kv_blocks())
for name, device in (("triton", "cpu"), ("auto", "cuda")):
    try:
        select_attention_backend(name, device, torch.float32)
    except ValueError as e:
        print(e)
"""


def test_cpu_runs_without_triton(tiny_llama):
    """A CPU install leaves triton out (pyproject's `gpu` extra): the engine core, a CPU
    worker and the CPU attention backends work without it, and the Triton backend, asked for
    by name or by auto on CUDA, is a ValueError saying what to install."""
    import subprocess
    import sys

    config = msgspec.json.encode(worker_config(tiny_llama)).decode()
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON, config], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'tidal[gpu]'" in line for line in lines), lines
