"""Model runner: applies a plan's deltas to the persistent batch, builds the step's flat
inputs (token ids, positions, slot mapping, attention metadata) with numpy, has the attention
backend prepare its plan for them (once per step, shared by every layer), runs the model
(eagerly, or by replaying a captured CUDA graph for decode batches), computes logits only
at sampling positions and samples (the sampler's inputs from the batch's rows, and its
logprobs back per row: `workers/sampler_rows.py`).

Flat batch layout of one step (plan order: new requests, then cached ones):

    request        A (prefill chunk, 5 tokens)   B (decode)   C (decode)
    query rows     0 1 2 3 4                     5            6
    positions      p..p+4                        nB           nC
    sampling?      only if p+5 == A's known tokens    yes      yes
    logits rows    [4 if sampling] + [5, 6]

A request that asked for prompt logprobs also gets logits for its rows at prompt positions
q < prompt_len - 1 (each predicts the prompt token at q + 1; the row at prompt_len - 1 is its
sampling row), in slices of max_num_seqs rows so a long chunk never holds a full
[num_tokens, vocab] tensor. Every chunk of a chunked prompt covers the positions it computes,
so the positions 1 .. prompt_len - 1 each come once; the engine core keeps them in order.

Speculative decoding: a request with k draft tokens (`CachedRequestData.spec_token_ids`,
written after its known tokens in the persistent batch) schedules 1 + k tokens and samples at
its last k + 1 rows: the logits there are the target's distributions after the last known
token and after each draft. `Sampler.verify` keeps the longest prefix of drafts the target
accepts plus one token of its own (greedy: argmax; sampled: rejection sampling), every rank
alike; the request's row gets those tokens and the result says how many (`num_tokens`).
With a draft model (`drafter`, `workers/drafter.py`) the plan says only how many drafts
(`num_model_drafts`): the drafter writes them into the batch in `prepare`, before the
inputs are built, so everything after is the same.

Pipeline parallelism: every stage applies the same plan to its own persistent batch and
builds the same inputs; a stage after the first takes the previous stage's hidden states
[num_tokens, hidden] (`PipelineParallel.recv`) instead of embedding the tokens, a stage
before the last sends its output on and is done with the step; only the last stage
computes logits and samples. No stage appends sampled tokens to its batch: they arrive in
the next plan (`CachedRequestData.new_token_ids`), the same on every stage.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ipc.messages import PromptLogprobs, TokenLogprobs
from ..ipc.worker_messages import BatchPlan, NewRequestData, RequestFailure, WorkerConfig
from ..kernels.attention import AttentionBackend
from .attention import AttentionInputs, AttentionMetadata, KVCache, kv_block_bytes
from .cuda_graphs import DecodeGraphs
from .distributed import PipelineParallel
from .host_memory import commit_pages
from .layers import kv_heads_per_rank
from .models import CausalLM, ModelConfig
from .persistent_batch import BadRequestData, PersistentBatch
from .pooling import PoolingRequests
from .sampler import Sampler, token_logprobs
from .sampler_rows import SamplerRows, dummy_sampling, to_device
from .structured_output import POLL_WAIT, StructuredOutputs

logger = logging.getLogger(__name__)

MIN_PROMPT_LOGITS_ROWS = 64
"""Prompt positions whose full-vocabulary logits may exist at once, at least: the slice is
max_num_seqs rows, as many as `profile_run` sends through the LM head and the sampler, so
the CUDA memory profile covers it; small max_num_seqs get 64 rows (40 MB of float32 logits
at a 150k vocabulary) rather than a step per few positions."""


@dataclass
class StepInputs:
    """Everything one forward needs, on the device, plus the host-side bookkeeping."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attention: AttentionInputs  # the batch layout and the backend's plan for it
    logits_indices: torch.Tensor  # [num_sampling] rows of the hidden states that sample
    sample_rows: np.ndarray  # persistent-batch rows that sample, plan order
    sample_req_ids: list[str]
    num_tokens: int
    decode_only: bool  # every request schedules exactly one token
    prompt_logprobs: "PromptLogprobRows | None" = None  # requests that want them, this step
    pooling: list | None = None  # a pooling worker's requests' rows (`PoolingRequests.plan`)
    spec: "SpecRows | None" = None  # requests verifying drafts this step


@dataclass
class SpecRows:
    """The sampling requests that verify drafts this step."""

    sample_index: np.ndarray  # [S] their index among the step's sampling requests
    num_drafts: np.ndarray  # [S] k of each
    draft_ids: np.ndarray  # [sum k] int64 their drafts, concatenated
    draft_hidden_rows: torch.Tensor  # [sum k] rows of the hidden states before each draft's
    # successor: the positions whose logits judge draft j (the last row judges nothing:
    # it gives the bonus token, as `logits_indices`)


@dataclass
class PromptLogprobRows:
    """Which hidden rows give prompt logprobs this step, and for whom."""

    hidden_rows: torch.Tensor  # [M] int64 rows of the step's hidden states
    target_ids: torch.Tensor  # [M] int64: the prompt token each row predicts
    segments: list[tuple[str, int, int, int]]  # (req_id, first position, count, top k)
    max_top: int  # the largest top k among them


@dataclass
class StepResult:
    """What one step sampled (identical on every rank)."""

    req_ids: list[str]
    token_ids: np.ndarray  # [len(req_ids)] int32
    logprobs: list[TokenLogprobs | None] | None
    failed: list[RequestFailure]  # new requests refused for their own data (not run)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # rank 0 only
    grammars_ready: list[str] = field(default_factory=list)  # compiles that ended well
    pooled: list = field(default_factory=list)  # PooledOutputs of prompts finished (pooling)
    num_tokens: np.ndarray | None = None  # [len(req_ids)] tokens each (None: one each)


class ModelRunner:
    """Owns the model, its KV cache tensors, the persistent batch and the sampler; prepares
    the attention backend's plan once per step."""

    def __init__(self, config: WorkerConfig, model: CausalLM, args: ModelConfig,
                 device: torch.device, dtype: torch.dtype, attention_backend: AttentionBackend,
                 pp: PipelineParallel = PipelineParallel()):
        self.config, self.model, self.args = config, model, args
        self.pp = pp
        self.device, self.dtype = device, dtype
        self.attention_backend = attention_backend  # the one the model's layers were built with
        self.block_size = config.block_size
        self.max_blocks_per_req = math.ceil(config.max_model_len / config.block_size)
        self.batch = PersistentBatch(config.max_num_seqs, config.max_model_len,
                                     self.max_blocks_per_req, args.vocab_size)
        self.refused: set[str] = set()
        """Requests refused for their own data, until the engine core finishes them: later
        plans may still list them (async scheduling), and are run without them."""
        self.sampler = Sampler(config.seed, device)
        self.structured = StructuredOutputs(config.tokenizer or config.model, args.vocab_size,
                                            config.grammar_compile_timeout,
                                            config.grammar_cache_bytes)
        """Grammar matchers of the requests with structured_outputs (see its module)."""
        self.sampler_rows = SamplerRows(self.batch, self.structured, args.vocab_size, device)
        self.kv_caches: list[KVCache] = []
        self.pooling = PoolingRequests(args.hidden_size) if config.runner == "pooling" else None
        """An embedding model's requests (`workers/pooling.py`): pooled, never sampled."""
        self.lora = None
        """The model's LoRA slots (`workers/lora.py` LoRAModel) when the engine serves
        adapters, set by the worker after load."""
        self.graphs: DecodeGraphs | None = None
        self.drafter = None
        """Speculative decoding with a draft model (`workers/drafter.py` Drafter), set by
        the worker after load: makes the drafts of `num_model_drafts` before each forward."""
        self.kv_commit: threading.Thread | None = None  # CPU: making the cache resident
        self.idle = threading.Event()
        """Set while no step runs (`set_idle`); the CPU cache is made resident only then."""
        self.idle.set()
        self.num_kv_heads = kv_heads_per_rank(args.num_key_value_heads,
                                              config.tensor_parallel_size)
        self.head_dim = args.head_dim

    # -- KV cache ------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on this rank, K and V over every layer of its stage, and
        the draft model's where there is one (`workers/attention.py` kv_block_bytes)."""
        target = kv_block_bytes(self.attention_backend, self.model.num_layers, self.block_size,
                                self.num_kv_heads, self.head_dim, self.dtype)
        return target + (self.drafter.kv_block_bytes if self.drafter is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """K and V tensors per layer, [num_blocks, block_size, kv_heads, head_dim] (stored as
        the attention backend reads them fastest: `AttentionBackend.kv_cache`).

        Left uninitialised (zero-filling the CPU default of 4 GiB took 2-3 s; on the CPU
        `init_kv_cache` makes the pages resident without writing them): attention reads,
        for the token at position p, only the slots of positions 0..p of its request, and
        each of those was written before it is read (this step's K/V are written before
        attention runs; earlier positions were written by an earlier step, or by the
        request that computed a prefix-cached full block). No kernel reads a slot past a
        request's `seq_len` (the torch backend masks by position, Triton masks its loads).
        Only the null block 0, which padding rows and padded block tables point at, is
        zeroed so that nothing ever sees NaN there.

        A quantized cache (`kv_cache_dtype` int8/fp8) is (K, V, K scales, V scales) per
        layer, the scales [num_blocks, block_size, kv_heads] float32, block 0's zeroed too.
        """
        return self.allocate_kv_layers(num_blocks, self.model.num_layers, self.num_kv_heads,
                                       self.head_dim)

    def allocate_kv_layers(self, num_blocks: int, num_layers: int, num_kv_heads: int,
                           head_dim: int) -> list[KVCache]:
        """`allocate_kv_cache` for any layer count and head geometry (the draft model's
        cache too: `workers/drafter.py`)."""
        geometry = (num_blocks, self.block_size, num_kv_heads, head_dim, self.dtype,
                    self.device)
        backend = self.attention_backend
        caches = []
        for _ in range(num_layers):
            layer = [backend.kv_cache(*geometry), backend.kv_cache(*geometry)]
            if backend.kv_dtype is not None:
                layer += [backend.kv_scales(num_blocks, self.block_size, num_kv_heads,
                                            self.device) for _ in range(2)]
            for tensor in layer:
                tensor[0].zero_()
            caches.append(tuple(layer))
        return caches

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache (block 0 is the null block); on the CPU start making all of
        it resident (`host_memory.py`: otherwise the prefix cache faults it in round after
        round under load); on CUDA without enforce_eager, capture the decode graphs."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), "
                             f"got {num_blocks}")
        self.kv_caches = self.allocate_kv_cache(num_blocks)
        draft = (self.drafter.init_kv_cache(self.allocate_kv_layers, num_blocks)
                 if self.drafter is not None else [])
        if self.device.type == "cpu":
            self.kv_commit = commit_pages([t for pair in self.kv_caches for t in pair] + draft,
                                          f"rank {self.config.worker_index}: KV cache",
                                          self.idle)
        if self.device.type == "cuda" and not self.config.enforce_eager and self.pp.size == 1:
            self.graphs = DecodeGraphs.try_capture(self, self.config.max_num_seqs)

    def set_idle(self, idle: bool) -> None:
        """Whether the process is waiting for work (background chores may run meanwhile)."""
        if idle:
            self.idle.set()
        else:
            self.idle.clear()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run one step on this rank; every rank samples the same tokens (and refuses the
        same requests). The result also lists the grammar compiles that ended meanwhile."""
        result = self._execute(plan)
        computes = plan.new_requests or plan.cached_requests
        wait = POLL_WAIT if plan.awaits_grammars and not computes else 0.0
        if self.structured.pending():
            result.grammars_ready, grammar_failures = self.structured.poll(wait)
            result.failed.extend(grammar_failures)
        return result

    def _execute(self, plan: BatchPlan) -> StepResult:
        inputs, failed = self.prepare(plan)
        if inputs is None:
            return StepResult([], np.zeros(0, np.int32), None, failed)
        hidden = self.run_model(inputs)
        if not self.pp.is_last:
            return StepResult([], np.zeros(0, np.int32), None, failed)
        if inputs.pooling is not None:
            return StepResult([], np.zeros(0, np.int32), None, failed,
                              pooled=self.pooling.pool(hidden, inputs.pooling))
        prompt_logprobs = []
        if inputs.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprobs)
        if not inputs.sample_req_ids:
            return StepResult([], np.zeros(0, np.int32), None, failed, prompt_logprobs)
        if inputs.spec is not None:
            # the LM head once for the sampled rows and the drafts' rows: one pass over its
            # weights (on an AVX2 CPU's 4/8-bit blocks, where widening them is the cost)
            n = inputs.logits_indices.shape[0]
            both = self.model.compute_logits(hidden[torch.cat(
                [inputs.logits_indices, inputs.spec.draft_hidden_rows])])
            return self._verify(inputs, both[:n], both[n:], failed, prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        out = self.sampler(logits, self.sampler_rows.sampling_batch(inputs.sample_rows,
                                                                    inputs.sample_req_ids))
        token_ids = out.token_ids.cpu().numpy()
        if self.pp.size == 1:  # else the tokens come back in the next plan
            self.batch.append_sampled(inputs.sample_rows, token_ids)
        if len(self.structured):
            self.structured.accept(inputs.sample_req_ids, token_ids)
        return StepResult(inputs.sample_req_ids, token_ids.astype(np.int32),
                          self.sampler_rows.pack_logprobs(out, inputs.sample_rows), failed,
                          prompt_logprobs)

    def _verify(self, inputs: StepInputs, logits: torch.Tensor, draft_logits: torch.Tensor,
                failed: list[RequestFailure], prompt_logprobs: list) -> StepResult:
        """A step where some requests verify drafts: the others sample as usual, these get
        1 + accepted tokens from `Sampler.verify`. `logits`: the sampled rows' (one a
        request), `draft_logits`: the rows of `spec.draft_hidden_rows`."""
        spec = inputs.spec
        rows, req_ids = inputs.sample_rows, inputs.sample_req_ids
        n = len(req_ids)
        is_spec = np.zeros(n, bool)
        is_spec[spec.sample_index] = True
        plain = np.nonzero(~is_spec)[0]
        per_row: list[np.ndarray] = [None] * n  # type: ignore[list-item]
        logprobs = None
        if len(plain):
            plain_ids = [req_ids[i] for i in plain]
            out = self.sampler(logits[torch.from_numpy(plain).to(logits.device)],
                               self.sampler_rows.sampling_batch(rows[plain], plain_ids))
            plain_tokens = out.token_ids.cpu().numpy().astype(np.int32)
            for i, token in zip(plain, plain_tokens):
                per_row[i] = np.asarray([token], np.int32)
            packed = self.sampler_rows.pack_logprobs(out, rows[plain])
            if packed is not None:
                logprobs = [None] * n
                for i, lp in zip(plain, packed):
                    logprobs[i] = lp
            if len(self.structured):
                self.structured.accept(plain_ids, plain_tokens)
        # per spec request: its k draft positions' logits, then its last row's
        k = spec.num_drafts
        offsets = np.concatenate([[0], np.cumsum(k)[:-1]])
        combined = torch.cat([draft_logits, logits[torch.from_numpy(spec.sample_index)
                                                   .to(logits.device)]])
        total = int(k.sum())
        order = np.concatenate([np.concatenate([offsets[i] + np.arange(k[i]), [total + i]])
                                for i in range(len(k))]).astype(np.int64)
        spec_rows = rows[spec.sample_index]
        row_of = np.repeat(spec_rows, k + 1)
        step_of = np.concatenate([np.arange(ki + 1) for ki in k])
        batch = self.sampler_rows.sampling_batch(row_of)
        batch.positions = batch.positions + self._to_device(step_of, torch.int64)
        accepted = self.sampler.verify(combined[torch.from_numpy(order).to(combined.device)],
                                       batch, spec.draft_ids, k)
        for i, tokens in zip(spec.sample_index, accepted):
            per_row[i] = tokens
        if self.pp.size == 1:  # else the tokens come back in the next plan
            for row, tokens in zip(rows, per_row):
                self.batch.append_many(int(row), tokens)
        counts = np.asarray([len(t) for t in per_row], np.int32)
        return StepResult(req_ids, np.concatenate(per_row).astype(np.int32), logprobs,
                          failed, prompt_logprobs, num_tokens=counts)

    @torch.inference_mode()
    def compute_logits_all(self, plan: BatchPlan) -> torch.Tensor:
        """Apply a plan and return logits for every scheduled token [num_tokens, vocab],
        sampling nothing (tests and diagnostics: prompt logits)."""
        inputs, _ = self.prepare(plan)
        if inputs is None:
            return torch.zeros(0, self.args.vocab_size, device=self.device)
        return self.model.compute_logits(self.run_model(inputs))

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for the step's tokens: the final ones on the
        last stage; an earlier stage's output, already sent on to the next stage."""
        lora_step = self.lora is not None and self.lora.step.active  # eager: grouped rows
        if self.graphs is not None and not lora_step and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        pp = self.pp
        hidden = None
        if not pp.is_first:
            hidden = pp.recv((inputs.num_tokens, self.args.hidden_size), self.dtype,
                             self.device)
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention,
                         hidden)
        if not pp.is_last:
            pp.send(out)
        return out

    # -- inputs --------------------------------------------------------------------------

    def prepare(self, plan: BatchPlan) -> tuple[StepInputs | None, list[RequestFailure]]:
        """Apply the plan to the persistent batch and build the step's inputs (None when
        nothing runs); new requests refused for their own data are left out and listed."""
        if not self.kv_caches:
            raise RuntimeError("init_kv_cache must run before the first step")
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            if self.pooling is not None:
                self.pooling.remove(req_id)
        for req_id in plan.finished_req_ids:
            self.batch.remove(req_id)
            self.structured.forget(req_id)
            self.refused.discard(req_id)
        for req_id in plan.preempted_req_ids:
            self.batch.remove(req_id)
            self.structured.remove(req_id)
            self.refused.discard(req_id)
        if plan.grammars:
            self.structured.start(plan.grammars)
        if plan.lora_slots:
            self._lora().load(plan.lora_slots)
        req_ids, rows, num_scheduled, failed = [], [], [], []
        num_new = 0  # the first num_new of rows joined with this plan
        for new in plan.new_requests:
            try:
                rows.append(self._add_new(new))
            except BadRequestData as e:
                logger.warning("rank %d refused request %r: %s", self.config.rank, new.req_id, e)
                failed.append(RequestFailure(new.req_id, str(e)))
                self.refused.add(new.req_id)
                continue
            req_ids.append(new.req_id)
            num_scheduled.append(new.num_scheduled_tokens)
            num_new += 1
        for cached in plan.cached_requests:
            if cached.req_id in self.refused:
                continue
            rows.append(self.batch.update(cached))
            req_ids.append(cached.req_id)
            num_scheduled.append(cached.num_scheduled_tokens)
        if not req_ids:
            return None, failed
        rows, num_scheduled = np.asarray(rows, np.int64), np.asarray(num_scheduled, np.int64)
        if self.batch.num_model_drafts[rows].any() and self.drafter is None:
            raise ValueError("a plan asks for num_model_drafts from a worker without a draft "
                             "model (speculative_config.model)")
        if self.drafter is not None:  # its KV keeps up with every step; drafts if asked
            self.drafter.draft(self.batch, rows, num_scheduled,
                               np.arange(len(rows)) < num_new)
        return self._build_inputs(req_ids, rows, num_scheduled), failed

    def _lora(self):
        if self.lora is None:
            raise ValueError("a plan loads LoRA adapters into a worker built without LoRA "
                             "slots (max_loras 0)")
        return self.lora

    def _add_new(self, new: NewRequestData) -> int:
        """The row of a request joining the batch; a constrained one gets its grammar
        matcher, replayed over the tokens it already generated. BadRequestData (the request
        left out) when its data or its grammar is unusable."""
        if new.lora_int_id:  # its adapter must be in a slot (a folder may fail to read)
            try:
                self._lora().check(new.lora_int_id)
            except ValueError as e:
                raise BadRequestData(str(e)) from None
        if (self.pooling is None) != (new.pooling is None):
            raise BadRequestData("pooling: this worker " + (
                "generates text; it takes no pooling requests" if self.pooling is None
                else "runs an embedding model; it takes only pooling requests"))
        if self.pooling is not None:
            try:
                self.pooling.add(new.req_id, new.pooling)
            except ValueError as e:
                raise BadRequestData(str(e)) from None
        row = self.batch.add(new)
        spec = new.sampling.structured_outputs
        if spec is None:
            self.structured.remove(new.req_id)
            return row
        b = self.batch
        try:  # the grammar has matched the tokens generated so far, resumed ones included
            self.structured.add(new.req_id, spec, b.stop_ids[row],
                                b.token_ids[row, b.output_start[row]:b.num_tokens[row]])
        except BadRequestData:
            b.remove(new.req_id)
            raise
        return row

    def _build_inputs(self, req_ids: list[str], rows: np.ndarray,
                      num_scheduled: np.ndarray) -> StepInputs:
        b, bs = self.batch, self.block_size
        start = b.num_computed[rows]
        seq_lens = start + num_scheduled
        _check_schedule(req_ids, rows, num_scheduled, seq_lens, b, bs)
        if self.lora is not None:
            self.lora.prepare_step(b.lora_id[rows], num_scheduled)
        query_start_loc = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # token t of request i sits at position start[i] + (t - query_start_loc[i])
        offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
        positions = np.repeat(start, num_scheduled) + offsets
        token_rows = np.repeat(rows, num_scheduled)
        input_ids = b.token_ids[token_rows, positions]
        slot_mapping = (b.block_table[token_rows, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        width = max(1, int((seq_lens.max() + bs - 1) // bs))
        num_spec = b.num_spec[rows]
        samples = seq_lens >= b.num_tokens[rows] + num_spec
        pooling = None
        if self.pooling is not None:  # every request pools; none samples
            pooling = self.pooling.plan(req_ids, start, seq_lens, b.prompt_len[rows],
                                        query_start_loc)
            samples = np.zeros_like(samples)
        to_dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_dev(slot_mapping, torch.int64),
            block_tables=to_dev(np.ascontiguousarray(b.block_table[rows, :width]), torch.int32),
            query_start_loc=to_dev(query_start_loc, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32),
        )
        return StepInputs(
            input_ids=to_dev(input_ids, torch.int64),
            positions=to_dev(positions, torch.int64),
            attention=self.attention_inputs(meta),
            logits_indices=to_dev(query_start_loc[1:][samples] - 1, torch.int64),
            sample_rows=rows[samples],
            sample_req_ids=[r for r, s in zip(req_ids, samples) if s],
            num_tokens=num_tokens,
            decode_only=bool((num_scheduled == 1).all()),
            prompt_logprobs=self._prompt_logprob_rows(req_ids, rows, start, seq_lens,
                                                      query_start_loc),
            pooling=pooling,
            spec=self._spec_rows(rows, num_spec, samples, query_start_loc)
            if num_spec.any() else None,
        )

    def _spec_rows(self, rows: np.ndarray, num_spec: np.ndarray, samples: np.ndarray,
                   query_start_loc: np.ndarray) -> SpecRows:
        """Where the drafts of this step's verifying requests sit (a request's last k + 1
        query rows sample: the k before its last judge its drafts)."""
        b = self.batch
        sampling = np.nonzero(samples)[0]
        k = num_spec[sampling]
        has = k > 0
        which = sampling[has]
        k = k[has]
        ends = query_start_loc[1:][which] - 1  # each one's last query row
        hidden_rows = np.concatenate([ends[i] - k[i] + np.arange(k[i]) for i in range(len(k))])
        starts = b.num_tokens[rows[which]]
        drafts = np.concatenate([b.token_ids[rows[w], s:s + ki]
                                 for w, s, ki in zip(which, starts, k)]).astype(np.int64)
        return SpecRows(sample_index=np.nonzero(has)[0], num_drafts=k, draft_ids=drafts,
                        draft_hidden_rows=self._to_device(hidden_rows, torch.int64))

    def _prompt_logprob_rows(self, req_ids: list[str], rows: np.ndarray, start: np.ndarray,
                             seq_lens: np.ndarray,
                             query_start_loc: np.ndarray) -> PromptLogprobRows | None:
        """Rows at prompt positions start .. min(seq_len, prompt_len - 1) - 1 of requests
        that want prompt logprobs (None when there are none)."""
        b = self.batch
        top = b.num_prompt_logprobs[rows]
        counts = np.where(top >= 0, np.minimum(seq_lens, b.prompt_len[rows] - 1) - start, 0)
        wanted = np.nonzero(counts > 0)[0]
        if not len(wanted):
            return None
        hidden_rows, targets, segments = [], [], []
        for i in wanted:
            n, first = int(counts[i]), int(start[i])
            hidden_rows.append(query_start_loc[i] + np.arange(n))
            targets.append(b.token_ids[rows[i], first + 1:first + 1 + n])
            segments.append((req_ids[i], first + 1, n, int(top[i])))
        return PromptLogprobRows(
            hidden_rows=self._to_device(np.concatenate(hidden_rows), torch.int64),
            target_ids=self._to_device(np.concatenate(targets), torch.int64),
            segments=segments, max_top=int(top[wanted].max()))

    def attention_inputs(self, meta: AttentionMetadata) -> AttentionInputs:
        """The step's metadata with the backend's plan for it, prepared once for every
        layer of the forward."""
        plan = self.attention_backend.prepare(meta, self.block_size, self.num_kv_heads,
                                              self.head_dim, self.dtype)
        return AttentionInputs(meta, plan)

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(array, dtype, self.device)

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         plan: PromptLogprobRows) -> list[PromptLogprobs]:
        """Log-softmax of the model's logits at the planned prompt rows: each prompt token's
        logprob and rank, and the top alternatives. Every rank computes the logits (the LM
        head gathers across ranks); rank 0 packs them."""
        ids, values, ranks = [], [], []
        rows_per_slice = max(MIN_PROMPT_LOGITS_ROWS, self.config.max_num_seqs)
        for lo in range(0, len(plan.target_ids), rows_per_slice):
            hi = lo + rows_per_slice
            logits = self.model.compute_logits(hidden[plan.hidden_rows[lo:hi]])
            logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
            chunk = token_logprobs(logprobs, plan.target_ids[lo:hi], plan.max_top)
            ids.append(chunk[0].cpu())
            values.append(chunk[1].cpu())
            ranks.append(chunk[2].cpu())
        if not self.config.reports_tokens:
            return []
        ids = torch.cat(ids).numpy().astype("<i4")
        values = torch.cat(values).numpy().astype("<f4")
        ranks = torch.cat(ranks).numpy().astype("<i4")
        out, row = [], 0
        for req_id, first, count, top in plan.segments:
            rows = slice(row, row + count)
            out.append(PromptLogprobs(req_id, first, top, ids[rows, :top + 1].tobytes(),
                                      values[rows, :top + 1].tobytes(), ranks[rows].tobytes()))
            row += count
        return out

    # -- profiling -----------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward over `num_tokens` dummy tokens (sequences of at most max_model_len)
        into a temporary cache, then the sampler over `num_seqs` rows, to find the peak
        activation memory."""
        max_len, bs = self.config.max_model_len, self.block_size
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len]
                                                      if num_tokens % max_len else [])
        blocks_per_seq = [math.ceil(n / bs) for n in lens]
        kv_caches = self.allocate_kv_cache(sum(blocks_per_seq) + 1)
        tables = np.zeros((len(lens), max(blocks_per_seq)), np.int64)
        first = 1
        for i, n in enumerate(blocks_per_seq):
            tables[i, :n] = np.arange(first, first + n)
            first += n
        positions = np.concatenate([np.arange(n) for n in lens])
        seq_of = np.repeat(np.arange(len(lens)), lens)
        slots = tables[seq_of, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(tables, torch.int32),
            query_start_loc=self._to_device(np.concatenate([[0], np.cumsum(lens)]), torch.int32),
            seq_lens=self._to_device(np.asarray(lens), torch.int32))
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        stage_input = None if self.pp.is_first else torch.zeros(
            num_tokens, self.args.hidden_size, dtype=self.dtype, device=self.device)
        hidden = self.model(ids, self._to_device(positions, torch.int64), kv_caches,
                            self.attention_inputs(meta), stage_input)
        if not self.pp.is_last or self.pooling is not None:  # no LM head, no sampler
            del kv_caches, hidden
            return
        rows = min(num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        self.sampler(logits, dummy_sampling(rows, self.device))
        del kv_caches, hidden, logits


def _check_schedule(req_ids, rows, num_scheduled, seq_lens, batch: PersistentBatch,
                    block_size: int) -> None:
    known = batch.num_tokens[rows] + batch.num_spec[rows]
    bad = np.nonzero((seq_lens > known) | (num_scheduled < 1))[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"request {req_ids[i]!r}: scheduled up to token {int(seq_lens[i])} "
                         f"but the worker knows {int(batch.num_tokens[rows[i]])} tokens "
                         f"(num_scheduled_tokens={int(num_scheduled[i])})")
    short = np.nonzero((seq_lens + block_size - 1) // block_size > batch.num_blocks[rows])[0]
    if len(short):
        i = int(short[0])
        raise ValueError(f"request {req_ids[i]!r}: {int(seq_lens[i])} tokens need more than "
                         f"its {int(batch.num_blocks[rows[i]])} KV blocks")
