"""Which engine core the data-parallel router (`dp_router.py`) gives a new request, and the
whole server's statistics from the cores' own. No IO: the router feeds it what it hears.

Load. Each core's latest `SchedulerStats` (the answer to the router's `StatsQuery`, every
`STATS_POLL_S` while requests are in flight) gives its waiting and running requests and KV
usage. Reports are a few hundred milliseconds old, so the requests the router sent a core
since the query that report answers count as waiting too (vLLM's DP client does the same).
The score is `WAITING_WEIGHT * waiting + running`: a waiting request costs its whole prefill
before its first token, a running one a decode slot. Ties go to the lower KV usage (a fuller
cache preempts sooner), then to the lower index.

Prefix affinity. No core routes on prefixes, so the router remembers, for the full blocks of
every prompt it placed, which core it sent them to (the prefix cache's chained block hashes,
`engine_core/block_pool.py`, salt included: the same tokens give the same hash in any
process). A new prompt's blocks are looked up from the first until one is unknown; the core
that got the longest known prefix is chosen unless its score is more than `PREFIX_SLACK`
above the least loaded core's (SGLang's cache-aware router makes the same trade). Memory is
bounded: the least recently placed hashes are forgotten past `MAX_REMEMBERED_BLOCKS`, and a
dead core's are dropped (its cache died with it). The core may have evicted a block the
router remembers; the cost of that guess is one prefill, as without affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from .block_pool import NONE_HASH, hash_request_blocks
from ..ipc.frontend_messages import SchedulerStats

WAITING_WEIGHT = 4
"""Score of a waiting request, in running requests."""
PREFIX_SLACK = 4 * WAITING_WEIGHT
"""A core holding the prompt's prefix wins unless its score exceeds the least by more than
this: four waiting requests' worth, so that a burst sharing a system prompt mostly lands
where it is cached, and a longer queue there spills over."""
MAX_REMEMBERED_BLOCKS = 1 << 16
"""Block hashes the router remembers (16 bytes plus a dict entry each: a few MB)."""


@dataclass
class CoreLoad:
    """What the router knows of one core's load."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_sent: int = 0  # requests placed on this core, ever
    num_sent_at_query: int = 0  # num_sent when the query the last report answers went out
    num_sent_at_report: int = 0  # num_sent_at_query of the last report

    def score(self) -> int:
        unreported = self.num_sent - self.num_sent_at_report
        return WAITING_WEIGHT * (self.num_waiting + unreported) + self.num_running


class Placement:
    """Least load with prefix affinity over `num_cores` cores (see the module docstring)."""

    def __init__(self, num_cores: int, block_size: int,
                 max_remembered_blocks: int = MAX_REMEMBERED_BLOCKS) -> None:
        self.block_size = block_size
        self.loads = [CoreLoad() for _ in range(num_cores)]
        self.live = [False] * num_cores
        self._max_blocks = max_remembered_blocks
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # block hash -> core, LRU first

    # -- what the router hears ----------------------------------------------------------------

    def mark_live(self, core: int) -> None:
        """The core answered Hello: it takes requests."""
        self.live[core] = True

    def mark_dead(self, core: int) -> None:
        """The core died: it takes nothing, and its cached prefixes are gone."""
        self.live[core] = False
        self.loads[core] = CoreLoad()
        for block_hash in [h for h, c in self._owner.items() if c == core]:
            del self._owner[block_hash]

    def query_sent(self, core: int) -> None:
        """A StatsQuery went to the core; its answer covers every request placed so far."""
        load = self.loads[core]
        load.num_sent_at_query = load.num_sent

    def report(self, core: int, stats: SchedulerStats) -> None:
        """The core's answer to the last StatsQuery."""
        load = self.loads[core]
        load.num_waiting, load.num_running = stats.num_waiting, stats.num_running
        load.kv_cache_usage = stats.kv_cache_usage
        load.num_sent_at_report = load.num_sent_at_query

    # -- the decision ---------------------------------------------------------------------------

    def place(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """The core for a new request (None when no core is live); remembers its blocks."""
        live = [i for i, ok in enumerate(self.live) if ok]
        if not live:
            return None
        hashes = self.block_hashes(prompt_token_ids, cache_salt)
        least = min(live, key=self._rank)
        core = least
        holder = self.prefix_holder(hashes)
        if holder is not None and \
                self.loads[holder].score() <= self.loads[least].score() + PREFIX_SLACK:
            core = holder
        self._remember(hashes, core)
        self.loads[core].num_sent += 1
        return core

    def prefix_holder(self, hashes: list[bytes]) -> int | None:
        """The live core that was sent the longest known prefix of these blocks."""
        holder = None
        for block_hash in hashes:
            core = self._owner.get(block_hash)
            if core is None or not self.live[core]:
                break
            holder = core
        return holder

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The prefix cache's hashes of the prompt's full blocks."""
        salt = cache_salt.encode("utf-8", "surrogateescape") if cache_salt else b""
        return hash_request_blocks(token_ids, self.block_size, 0, NONE_HASH,
                                   len(token_ids) // self.block_size, salt)

    def _rank(self, core: int) -> tuple:
        load = self.loads[core]
        return load.score(), load.kv_cache_usage, core

    def _remember(self, hashes: list[bytes], core: int) -> None:
        for block_hash in hashes:
            self._owner[block_hash] = core
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self._max_blocks:
            self._owner.popitem(last=False)


# ---------------------------------------------------------------------------------------------
# the whole server's statistics

_SUMMED = ("num_running", "num_waiting", "num_kv_blocks", "num_preemptions",
           "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
           "num_steps", "preempted_prefix_cache_queries", "preempted_prefix_cache_hits",
           "num_worker_restarts", "queued_prompt_tokens", "spec_num_drafts",
           "spec_num_draft_tokens", "spec_num_accepted_tokens")


def merge_stats(per_core: list[SchedulerStats]) -> SchedulerStats:
    """One snapshot for the whole server, with each core's in `cores` (in core order).

    Counts and counters are summed; KV usage is the share of all blocks in use; the queue
    delay estimate is the least loaded core's, since that is where a new request goes."""
    total = SchedulerStats(cores=list(per_core))
    for name in _SUMMED:
        setattr(total, name, sum(getattr(s, name) for s in per_core))
    positions = max((len(s.spec_accepted_per_pos) for s in per_core), default=0)
    if positions:
        total.spec_accepted_per_pos = [
            sum(s.spec_accepted_per_pos[i] for s in per_core if i < len(s.spec_accepted_per_pos))
            for i in range(positions)]
    if total.num_kv_blocks:
        used = sum(s.kv_cache_usage * s.num_kv_blocks for s in per_core)
        total.kv_cache_usage = used / total.num_kv_blocks
    if per_core:
        best = min(per_core, key=lambda s: s.est_queue_delay_s)
        total.est_queue_delay_s = best.est_queue_delay_s
        total.est_s_per_prompt_token = best.est_s_per_prompt_token
        total.est_s_per_queued_request = best.est_s_per_queued_request
    return total
