"""The workload `tidal tune` simulates from a `tidal bench` dataset: the requests `tidal bench
serve` would send with the same dataset flags, seed, rate and burstiness, as a request trace
(`engine_core/advice/trace.py`; a recorded trace is read there as it is)."""

from __future__ import annotations

import zlib

from ..bench.datasets import build_dataset
from ..bench.serve import arrival_gaps
from ...engine_core.advice.trace import (
    Trace, TraceRequest, block_hashes, new_hash_key, trace_header,
)


def trace_from_dataset(dataset_config, request_rate: float, burstiness: float = 1.0,
                       seed: int = 0, tokenizer=None) -> Trace:
    """The workload `tidal bench serve` sends with the same dataset flags, seed, rate and
    burstiness: the same lengths, the same arrival times (its Gamma gaps), and prefix sharing
    from the prompts' token ids (or words, without a tokenizer)."""
    bench_requests = build_dataset(dataset_config, tokenizer)
    gaps = arrival_gaps(len(bench_requests), request_rate, burstiness, seed)
    key = new_hash_key()
    requests, t = [], 0.0
    for request, gap in zip(bench_requests, gaps):
        t += gap
        ids = request.prompt_token_ids
        if ids is None:  # words stand for tokens (prompt_len is their count)
            ids = [zlib.crc32(w.encode()) for w in request.prompt.split()]
        requests.append(TraceRequest(t, request.prompt_len, request.output_len,
                                     block_hashes(ids, key)))
    header = trace_header(f"tidal bench dataset {dataset_config.name}",
                          request_rate=None if request_rate == float("inf") else request_rate,
                          burstiness=burstiness, seed=seed,
                          dataset={k: v for k, v in vars(dataset_config).items()})
    trace = Trace(requests, header)  # already sorted; the first gap is kept, as in bench serve
    return trace
