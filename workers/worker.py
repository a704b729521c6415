"""One worker: a tensor-parallel rank of one pipeline stage. Device and process groups,
model shard (the stage's layers, this rank's slice of them), KV cache, steps.

Start-up, driven by the worker process (workers/proc.py):

    Worker(config) -> load() -> determine_num_kv_blocks() -> ready_message()
    ... engine core takes the minimum over ranks ... -> init_kv_cache(num_blocks)
    execute(plan) every step (TP rank 0 of the last stage returns SampledTokens) -> shutdown()
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..ipc.messages import pack_token_ids
from ..ipc.worker_messages import BatchPlan, SampledTokens, WorkerConfig, WorkerReady
from ..kernels.attention import select_attention_backend
from ..kernels.cpu.ops import log_cpu_ops, select_cpu_ops
from .attention import uniform_sliding_window
from .distributed import destroy_distributed, init_distributed
from .drafter import Drafter
from .layers import kv_heads_per_rank
from .loader import load_weights, read_config, resolve_model_path
from .lora import LoRAModel
from .model_runner import ModelRunner
from .models import CausalLM, ModelConfig, build_model, parse_model_args
from .pooling import drop_lm_head, embedding_checkpoint_name, embedding_config

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
"""The most KV cache per rank the CPU default takes when `kv_cache_memory` is not given:
4 GiB (vLLM's default VLLM_CPU_KVCACHE_SPACE). Below it the default is what the model can
use (`default_cpu_kv_blocks`)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def default_cpu_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """KV blocks the CPU default wants: every one of max_num_seqs requests at max_model_len
    tokens (rounded up to whole blocks), plus the null block 0. Speculative drafts need no
    more (the scheduler keeps a request's tokens and drafts within max_model_len) and a draft
    model's K/V is part of each block's bytes (`ModelRunner.kv_block_bytes`)."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


class Worker:
    """The model shard of one rank and everything needed to run steps on it."""

    def __init__(self, config: WorkerConfig) -> None:
        _validate(config)
        self.config = config
        self.rank = config.worker_index  # among every worker (stage-major), for logs
        self.device = _pick_device(config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.tp, self.pp = init_distributed(config.rank, config.tensor_parallel_size,
                                            config.dist_init_method, self.device,
                                            stage=config.stage,
                                            num_stages=config.pipeline_parallel_size)
        self.model_path = resolve_model_path(config.model)
        self.hf_config = read_config(self.model_path)
        self.pooling = config.runner == "pooling"  # an embedding model: no LM head
        self.args = parse_model_args(embedding_config(self.hf_config) if self.pooling
                                     else self.hf_config)
        self.args.check_max_model_len(config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        if config.dtype == "auto" and DTYPES.get(checkpoint_dtype(self.hf_config)) != self.dtype:
            logger.info("rank %d: the checkpoint is %s; computing in %s on %s (--dtype "
                        "overrides)", self.rank, checkpoint_dtype(self.hf_config), self.dtype,
                        self.device)
        self.runner: ModelRunner | None = None
        self.num_kv_blocks = 0
        self.load_seconds = 0.0
        self.num_params = 0  # on this rank, counted at load (before any packing)
        self.weight_bytes = 0
        self.deferred: list = []
        """The CPU GEMMs whose oneDNN copy is made later (`SmallBatchGemm.prepare`): by
        `idle_chore` while the process waits for plans, else at the first product that
        needs it."""

    # -- start-up ------------------------------------------------------------------------

    def load(self) -> None:
        """Build the model on the device and load this rank's shard of the weights."""
        start = time.perf_counter()
        # the CPU ops first: their choice says which CPU the C kernels, attention's too, are for
        ops = select_cpu_ops(self.config.cpu_kernels) if self.device.type == "cpu" else None
        backend = select_attention_backend(self.config.attention_backend, self.device.type,
                                           self.dtype, self.config.kv_cache_dtype)
        model = self._build_and_load(self.args, self.model_path, backend,
                                     pooling=self.pooling)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if ops is not None:
            log_cpu_ops(ops, logger, f"rank {self.rank}: ", taken=model.use_cpu_ops(ops))
            ops.warm_up(self.dtype)  # numba's RMSNorm and rotary where they are called
            self.deferred = [m.cpu_gemm for m in model.modules()
                             if getattr(m, "cpu_gemm", None) is not None
                             and not m.cpu_gemm.prepared]
        self.runner = ModelRunner(self.config, model, self.args, self.device, self.dtype,
                                  backend, self.pp)
        if self.config.max_loras:
            self.runner.lora = LoRAModel(model, self.config.max_loras,
                                         self.config.max_lora_rank, self.config.max_cpu_loras,
                                         self.dtype, self.device)
        if self.config.draft_model is not None:
            self.runner.drafter = self._load_drafter(backend, ops)
        warm_up_s = backend.warm_up(self.dtype)  # e.g. numba: compiled once, then disk-cached
        logger.debug("rank %d: %s attention backend warmed up in %.2f s", self.rank,
                     backend.name, warm_up_s)
        self.load_seconds = time.perf_counter() - start
        layers = self.pp.layers(self.args.num_hidden_layers)
        stage = (f"; stage {self.pp.stage} of {self.pp.size}: layers {layers.start}-"
                 f"{layers.stop - 1}" if self.pp.size > 1 else "")
        logger.info("rank %d: loaded %s (%s, %.1fM parameters on this rank%s, %s attention) "
                    "from %s in %.2f s", self.rank, self.args.architecture, self.dtype,
                    self.num_params / 1e6, stage, backend.name, self.model_path,
                    self.load_seconds)

    def _build_and_load(self, args: ModelConfig, path: str, backend, *,
                        pooling: bool = False) -> CausalLM:
        """`args`'s model built on this rank's device in the compute dtype (this rank's
        tensor-parallel shard of this stage's layers), its weights loaded from `path`, in
        eval mode; a pooling model without its LM head. The target and the draft model both
        load this way."""
        with _default_dtype(self.dtype), torch.device(self.device):
            model = build_model(args, self.tp, backend, self.config.max_model_len, self.pp)
        if pooling:
            drop_lm_head(model)
        load_weights(model, path, rename=embedding_checkpoint_name if pooling else None)
        model.eval()
        return model

    def _load_drafter(self, backend, ops) -> Drafter:
        """The draft model (speculative_config.model), built and loaded as the target (same
        dtype, attention backend, tensor-parallel shards); ValueError naming the key when it
        cannot draft for this target."""
        path, args = self._draft_model_args()
        model = self._build_and_load(args, path, backend)
        if ops is not None:
            model.use_cpu_ops(ops)
        num_params = sum(p.numel() for p in model.parameters())
        logger.info("rank %d: draft model %s (%.1fM parameters on this rank, %d layers) from "
                    "%s", self.rank, args.architecture, num_params / 1e6, model.num_layers,
                    path)
        return Drafter(model, args, backend, self.config.block_size,
                       kv_heads_per_rank(args.num_key_value_heads,
                                         self.config.tensor_parallel_size),
                       self.config.max_num_seqs, self.device, self.dtype)

    def _draft_model_args(self) -> tuple[str, ModelConfig]:
        """The draft model's folder and args; ValueError naming speculative_config.model
        when it cannot draft for this target (a pooling or pipeline-parallel target, another
        vocabulary, a shorter context than max_model_len, no such model)."""
        key = f"speculative_config.model {self.config.draft_model!r}"
        if self.pooling or self.pp.size > 1:
            raise ValueError(f"{key}: a draft model needs a generating model and "
                             "pipeline_parallel_size 1")
        try:
            path = resolve_model_path(self.config.draft_model)
            args = parse_model_args(read_config(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: {e}") from None
        if args.vocab_size != self.args.vocab_size:
            raise ValueError(f"{key} has vocab_size {args.vocab_size}; the draft model needs "
                             f"the target's ({self.args.vocab_size})")
        try:
            args.check_max_model_len(self.config.max_model_len)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        return path, args

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit on this rank (num_kv_blocks_override wins).

        CUDA: a profiling forward at max_num_batched_tokens; the blocks fill
        gpu_memory_utilization × device memory minus weights, peak activations and memory
        outside torch. CPU: kv_cache_memory bytes / bytes per block; without it, room for
        max_num_seqs requests of max_model_len tokens, at most 4 GiB.
        """
        runner = self._runner()
        if self.config.num_kv_blocks_override is not None:
            num_blocks = self.config.num_kv_blocks_override
            logger.info("rank %d: num_kv_blocks_override=%d", self.rank, num_blocks)
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks(runner)
        elif self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
            num_blocks = budget // runner.kv_block_bytes
            logger.info("rank %d: CPU KV cache %.2f GiB (--kv-cache-memory) / %d bytes per "
                        "block = %d blocks (%d tokens)", self.rank, budget / 2**30,
                        runner.kv_block_bytes, num_blocks, num_blocks * self.config.block_size)
        else:
            num_blocks = self._default_cpu_blocks(runner.kv_block_bytes)
        if num_blocks < 2:
            raise ValueError(f"only {num_blocks} KV blocks fit on rank {self.rank}; raise "
                             "kv_cache_memory / gpu_memory_utilization or lower max_num_seqs")
        self.num_kv_blocks = int(num_blocks)
        self._log_capacity()
        return self.num_kv_blocks

    def _default_cpu_blocks(self, block_bytes: int) -> int:
        """The CPU default without --kv-cache-memory: room for max_num_seqs requests of
        max_model_len tokens, at most DEFAULT_CPU_KV_CACHE_BYTES."""
        cfg = self.config
        wanted = default_cpu_kv_blocks(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
        cap = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
        num_blocks = min(wanted, cap)
        room = "room for" if wanted <= cap else "short of"
        logger.info("rank %d: CPU KV cache %.2f GiB = %d blocks of %d bytes (%d tokens): %s "
                    "%d sequences x %d tokens (--max-num-seqs x --max-model-len; the default "
                    "is capped at %.0f GiB; --kv-cache-memory sets it)", self.rank,
                    num_blocks * block_bytes / 2**30, num_blocks, block_bytes,
                    num_blocks * cfg.block_size, room, cfg.max_num_seqs, cfg.max_model_len,
                    DEFAULT_CPU_KV_CACHE_BYTES / 2**30)
        return num_blocks

    def _log_capacity(self) -> None:
        max_len, bs = self.config.max_model_len, self.config.block_size
        blocks_per_req = -(-max_len // bs)
        usable = self.num_kv_blocks - 1  # block 0 is the null block
        level = logging.INFO if usable >= blocks_per_req else logging.WARNING
        logger.log(level, "rank %d: KV cache holds %d tokens; maximum concurrency for "
                   "%d-token requests: %.2fx", self.rank, usable * bs, max_len,
                   usable / blocks_per_req)

    def _profile_cuda_blocks(self, runner: ModelRunner) -> int:
        start = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        runner.profile_run(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        outside_torch = (total - free) - torch.cuda.memory_reserved()  # context, NCCL, others
        torch.cuda.empty_cache()
        budget = int(total * self.config.gpu_memory_utilization)
        available = budget - peak - outside_torch
        num_blocks = max(available, 0) // runner.kv_block_bytes
        logger.info(
            "rank %d: profiling took %.2f s; device %.2f GiB × gpu_memory_utilization %.2f = "
            "%.2f GiB; weights %.2f GiB, peak with activations %.2f GiB, outside torch "
            "%.2f GiB -> KV cache %.2f GiB = %d blocks (%d tokens)", self.rank,
            time.perf_counter() - start, total / 2**30, self.config.gpu_memory_utilization,
            budget / 2**30, weights / 2**30, peak / 2**30, outside_torch / 2**30,
            max(available, 0) / 2**30, num_blocks, num_blocks * self.config.block_size)
        return num_blocks

    def ready_message(self) -> WorkerReady:
        return WorkerReady(rank=self.rank, num_kv_blocks=self.num_kv_blocks,
                           sliding_window=uniform_sliding_window(self.runner.model) or 0,
                           max_model_len=self.config.max_model_len, device=str(self.device),
                           load_seconds=self.load_seconds, vocab_size=self.args.vocab_size)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks (the minimum over ranks) and capture CUDA graphs."""
        start = time.perf_counter()
        self._runner().init_kv_cache(num_blocks)
        logger.info("rank %d: KV cache of %d blocks × %d tokens ready in %.2f s", self.rank,
                    num_blocks, self.config.block_size, time.perf_counter() - start)

    # -- steps ---------------------------------------------------------------------------

    def idle_chore(self) -> bool:
        """Do one piece of work deferred from load (one weight's oneDNN copy, a few ms);
        whether any is left. The worker process calls it while no plan waits."""
        while self.deferred:
            gemm = self.deferred.pop()
            if not gemm.prepared:
                gemm.prepare()
                break
        return bool(self.deferred)

    def set_idle(self, idle: bool) -> None:
        """The process waits for its next plan (True) or has one to run (False)."""
        if self.runner is not None:
            self.runner.set_idle(idle)

    def execute(self, plan: BatchPlan) -> SampledTokens | None:
        """Run one step; TP rank 0 of the last stage returns the sampled tokens, the other
        workers None."""
        result = self._runner().execute(plan)
        if not self.config.reports_tokens:
            return None
        return SampledTokens(step_id=plan.step_id, req_ids=result.req_ids,
                             token_ids=pack_token_ids(result.token_ids),
                             logprobs=result.logprobs, failed=result.failed,
                             prompt_logprobs=result.prompt_logprobs,
                             grammars_ready=result.grammars_ready, pooled=result.pooled,
                             num_tokens=(b"" if result.num_tokens is None
                                         else pack_token_ids(result.num_tokens)))

    def shutdown(self) -> None:
        """Release the KV cache and leave the process group."""
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        destroy_distributed()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("Worker.load() must run first")
        return self.runner


def _validate(config: WorkerConfig) -> None:
    if config.dtype != "auto" and config.dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {config.device!r}")
    if not 0 <= config.rank < config.tensor_parallel_size:
        raise ValueError(f"rank {config.rank} is outside tensor_parallel_size="
                         f"{config.tensor_parallel_size}")
    if not 0 <= config.stage < config.pipeline_parallel_size:
        raise ValueError(f"stage {config.stage} is outside pipeline_parallel_size="
                         f"{config.pipeline_parallel_size}")
    if config.block_size < 1 or config.max_model_len < 1 or config.max_num_seqs < 1:
        raise ValueError("block_size, max_model_len and max_num_seqs must be positive")
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{config.gpu_memory_utilization}")


def _pick_device(config: WorkerConfig) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available")
    local = config.worker_index % torch.cuda.device_count()
    return torch.device("cuda", local)


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """The named dtype; `auto` takes the checkpoint's, except on the CPU:

    - float16 computes in float32: x86 CPUs have no float16 matrix units torch uses (no
      AMX-FP16 here; torch's float16 GEMM measured no faster than float32), and float16
      weights convert to float32 exactly, so the results are float32's;
    - bfloat16 stays bfloat16 where the CPU multiplies it natively (AVX512_BF16 or AMX:
      GEMMs of 16 rows and more 2.3-7x faster than float32 on AMX, prefill 3-4x;
      docs/tuning.md, "Data types on the CPU"), else float32, since emulated bfloat16 is
      slower than float32.
    """
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype(hf_config), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return torch.float32
    return dtype


def checkpoint_dtype(hf_config: dict) -> str:
    """The dtype config.json names (`torch_dtype`, or transformers 5's `dtype`), float32 if none."""
    ckpt = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return str(ckpt).replace("torch.", "")


def cpu_has_native_bf16() -> bool:
    """Whether torch finds bfloat16 instructions on this CPU (AVX512_BF16 or AMX tiles)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu, x86 only
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
