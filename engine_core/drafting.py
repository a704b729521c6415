"""The scheduler's side of speculative decoding: which of a step's one-token decodes get
drafts and how many, their KV slots, and what verification says back.

`Drafting` owns the proposer (`ngram`, `suffix`, or the draft model's count), the adaptive
policy that prices drafts (`spec_decode.AdaptivePolicy`) and vLLM's counters (`SpecStats`).
The scheduler holds one when `--speculative-config` is given and calls it at four points of
a step: `add_drafts` after its running and waiting passes, `may_draft` when deciding whether
a request with a token in flight can be planned ahead (one that may draft cannot: drafts
follow its last token), `record` when a request's verified tokens come back, and `step_ran`
with the workers' time for a plan. `num_computed_tokens` stays the scheduler's: drafts are
scheduled tokens like any other, and the scheduler sets the counter back to what was
accepted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .request import Request, RequestStatus
from .proposers import NO_DRAFT, make_proposer
from .spec_decode import AdaptivePolicy, CostTerms, SpecStats, SpeculativeConfig
from ..ipc.worker_messages import BatchPlan

if TYPE_CHECKING:  # the scheduler's scratch record of one step (no import cycle at run time)
    from .kv_cache_manager import KVCacheManager
    from .scheduler import _Step


class Drafting:
    """Drafts for one scheduler (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.config = spec
        self.max_model_len = max_model_len
        self.proposer = make_proposer(spec)
        self.policy = AdaptivePolicy(spec.num_speculative_tokens, CostTerms(), spec.adaptive)
        """Prices steps with `CostTerms`' defaults until the advisory wing gives it the
        measured step cost model (`advice/observers.py` SpeculationCostObserver)."""
        self.stats = SpecStats(spec.num_speculative_tokens)

    @property
    def drafts_in_worker(self) -> bool:
        """The workers make the drafts (a draft model): a plan carries only their count."""
        return self.config.drafts_in_worker

    @staticmethod
    def may_draft(request: Request) -> bool:
        """Whether drafts may be verified for this request: the worker's verification
        applies temperature, top-k, top-p and min-p only, so requests needing more (logprobs,
        penalties, a grammar, min_tokens still masking EOS) decode one token a step, as do
        pooling requests and LoRA requests (not verified with drafts yet)."""
        sp = request.sampling
        return (request.pooling is None and request.lora is None and sp.logprobs is None
                and sp.structured_outputs is None
                and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
                and sp.repetition_penalty == 1.0
                and len(request.output_token_ids) >= request.min_tokens)

    def add_drafts(self, step: "_Step", kv: "KVCacheManager") -> None:
        """Drafts for the step's one-token decodes, as many per request as the policy picks
        within the budget left (the scheduler's module docstring). The proposer runs only
        for the requests the policy asks (`AdaptivePolicy.ask`: none where even every draft
        found and accepted at its best rate would not pay)."""
        proposer, policy = self.proposer, self.policy
        terms = policy.terms
        ceiling = self.config.num_speculative_tokens
        base_cost = terms.intercept
        eligible, rest = [], []  # (request, most drafts), (request, num_new)
        rows, decodes_only = 0, True
        for request, num_new, _, admitted in step.scheduled.values():
            rows += num_new
            decodes_only = decodes_only and num_new == 1
            num_tokens = len(request.all_token_ids)
            if (num_new == 1 and not admitted and request.num_computed_tokens == num_tokens - 1
                    and not request.num_output_placeholders and self.may_draft(request)):
                room = min(request.max_tokens - len(request.output_token_ids),
                           self.max_model_len - num_tokens) - 1
                if room > 0:
                    eligible.append((request, min(room, ceiling)))
                    continue
            rest.append((request, num_new))
        if not eligible:
            return
        rows = rows if decodes_only else None
        best = policy.best_probs(ceiling)  # the best-paying kind of draft's acceptances
        best_case = [(most, request.num_computed_tokens, best) for request, most in eligible]
        rest_tokens = sum(request.num_computed_tokens + num_new >= len(request.all_token_ids)
                          for request, num_new in rest)
        ask = policy.ask(best_case, rest_tokens, step.budget, rows)
        candidates, proposals = [], []
        started, asked = time.perf_counter(), 0
        for (request, most), entry, asking in zip(eligible, best_case, ask):
            draft = NO_DRAFT
            if asking:
                asked += 1
                draft = proposer.propose(request.req_id, request.all_token_ids, most)
            if draft.tokens:
                candidates.append((len(draft.tokens), entry[1],
                                   policy.draft_probs(draft.match, len(draft.tokens))))
                proposals.append((request, draft))
            else:
                rest.append((request, 1))
                rest_tokens += 1  # a decode of its last token: it yields one
        if asked:
            policy.observe_proposer(time.perf_counter() - started, asked)
        if not candidates:
            return
        for request, num_new in rest:
            base_cost += terms.entry(request.num_computed_tokens, num_new)
        counts = policy.choose(candidates, base_cost, rest_tokens, step.budget, rows)
        for (request, draft), k in zip(proposals, counts):
            if k <= 0:
                continue
            extra = kv.allocate_slots(request, 1 + k, publish=False)
            if extra is None:
                continue  # no free blocks for its drafts: it decodes one token
            req_id = request.req_id
            _, _, block_ids, _ = step.scheduled[req_id]
            step.scheduled[req_id] = (request, 1 + k, block_ids + extra, False)
            step.budget -= k
            step.drafts[req_id] = draft.tokens[:k]
            request.num_drafts_in_flight = k
            request.draft_match = draft.match

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A request's drafts came back verified: the policy's acceptances, /metrics."""
        request.num_drafts_in_flight = 0
        self.policy.record(num_drafts, num_accepted, request.draft_match)
        self.stats.record(num_drafts, num_accepted)

    def finished(self, request: Request, status: RequestStatus) -> None:
        """A request left the scheduler: a complete output feeds the proposer's store of
        earlier answers (`suffix`); any other end only drops the request's index."""
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.proposer.finished(request.req_id, request.all_token_ids,
                                   request.num_prompt_tokens)
        else:
            self.proposer.forget(request.req_id)

    def step_ran(self, plan: BatchPlan, seconds: float) -> None:
        """`plan` took `seconds` at the workers: a step of decodes and their drafts only (no
        prefill chunk) teaches the policy what a step of that many query rows costs here."""
        if plan.new_requests:
            return
        for cached in plan.cached_requests:  # 4 bytes a packed draft token
            drafts = len(cached.spec_token_ids) // 4 + cached.num_model_drafts
            if cached.num_scheduled_tokens != 1 + drafts:
                return
        self.policy.observe_step(plan.total_num_scheduled_tokens, seconds)

    def counters(self) -> dict:
        """vLLM's spec_decode counters, as `SchedulerStats` fields."""
        stats = self.stats
        return dict(spec_num_drafts=stats.num_drafts,
                    spec_num_draft_tokens=stats.num_draft_tokens,
                    spec_num_accepted_tokens=stats.num_accepted_tokens,
                    spec_accepted_per_pos=list(stats.accepted_per_pos))
