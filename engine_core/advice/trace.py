"""Request traces: when each request arrived, how long its prompt and output were, and which
prompt blocks it shared with others. Never the text.

A trace file is JSON lines: a header, then one request per line, in any order (the reader sorts
by arrival):

    {"format": "tidal-trace", "version": 1, "block_tokens": 16, "source": "...", ...}
    {"arrival_time": 12.5, "prompt_len": 812, "output_len": 128, "priority": 0,
     "prefix_hashes": ["9f1c2a...", ...]}

- `arrival_time`: seconds; only differences matter (a recorded trace holds wall-clock times,
  a generated one starts near 0).
- `prefix_hashes`: one 64-bit hash (16 hex digits) per full `block_tokens`-token block of the
  prompt, chained (block i's hash covers blocks 0..i), so two requests share their first k
  hashes exactly when their first k blocks are equal. The hash is keyed with a random key
  made per recording and never written, so a hash cannot be checked against a guessed text;
  hashes compare only within one trace.
- `finish_reason` (recorded traces): why the request ended (a `length` or `stop` output ran
  to its natural end; `abort` is a client that left).

A simulator rebuilds token ids from the hashes (`TraceRequest.token_ids`): equal hashes give
equal blocks, so the engine's own prefix cache finds the same sharing the live server saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

FORMAT_VERSION = 1
TRACE_BLOCK_TOKENS = 16
"""Tokens per hashed prompt block: any engine block size dividing it, or a multiple of it,
sees the same sharing (the default engine block size is 16)."""

_HASH_ROOT = b"tidal-trace-root"


@dataclass
class TraceRequest:
    """One request of a trace."""

    arrival_time: float
    """Seconds (only differences between requests matter)."""
    prompt_len: int
    output_len: int
    """Tokens generated (exact in the simulator: requests ignore EOS)."""
    prefix_hashes: list[str] = field(default_factory=list)
    """Chained keyed hashes of the prompt's full blocks (see the module docstring)."""
    priority: int = 0
    finish_reason: str | None = None

    def to_json(self) -> dict:
        row = {"arrival_time": round(self.arrival_time, 6), "prompt_len": self.prompt_len,
               "output_len": self.output_len, "priority": self.priority,
               "prefix_hashes": self.prefix_hashes}
        if self.finish_reason is not None:
            row["finish_reason"] = self.finish_reason
        return row

    @classmethod
    def from_json(cls, row: dict, where: str) -> TraceRequest:
        try:
            request = cls(float(row["arrival_time"]), int(row["prompt_len"]),
                          int(row["output_len"]), list(row.get("prefix_hashes") or []),
                          int(row.get("priority", 0)), row.get("finish_reason"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a trace request ({type(e).__name__}: {e})") from None
        if request.prompt_len < 1 or request.output_len < 0:
            raise ValueError(f"{where}: prompt_len must be >= 1 and output_len >= 0")
        if len(request.prefix_hashes) > request.prompt_len // TRACE_BLOCK_TOKENS:
            raise ValueError(f"{where}: more prefix_hashes than full blocks in the prompt")
        return request

    def token_ids(self, index: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
        """Prompt token ids equal to another request's exactly over their shared hashed blocks,
        unique to this request (`index`) elsewhere. Ids of hashed blocks are in [0, 2^30), the
        others above."""
        ids: list[int] = []
        for h in self.prefix_hashes:
            value = int(h, 16)
            ids += [value & 0x3FFFFFFF, (value >> 30) & 0x3FFFFFFF, value >> 60]
            ids += [0] * (block_tokens - 3)
        unique = 0x40000000 + index % 0x3FFFFFFF
        ids += [unique] * (self.prompt_len - len(ids))
        return ids


@dataclass
class Trace:
    """A header and requests sorted by arrival (seconds from the start of the run)."""

    requests: list[TraceRequest]
    header: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival_time if self.requests else 0.0

    def mean_rate(self) -> float:
        """Requests per second over the arrivals (inf when they all arrive at once)."""
        if len(self.requests) < 2 or self.duration <= 0:
            return float("inf")
        return (len(self.requests) - 1) / self.duration

    def scaled(self, factor: float) -> Trace:
        """The same requests arriving `factor` times faster (gaps divided by `factor`)."""
        return Trace([TraceRequest(r.arrival_time / factor, r.prompt_len, r.output_len,
                                   r.prefix_hashes, r.priority, r.finish_reason)
                      for r in self.requests], dict(self.header))


def block_hashes(token_ids: Sequence[int], key: bytes = b"",
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> list[str]:
    """Chained keyed 64-bit hashes (hex) of the full blocks of `token_ids`."""
    parent = _HASH_ROOT
    out = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start:start + block_tokens]
        parent = hashlib.blake2b(parent + struct.pack(f"<{len(block)}q", *block),
                                 digest_size=8, key=key).digest()
        out.append(parent.hex())
    return out


def normalized(requests: Iterable[TraceRequest], header: dict) -> Trace:
    """Sorted by arrival; a wall-clock trace (`"clock": "epoch"`) shifted so the first
    arrives at 0 (a generated one starts where its first arrival gap ends, as bench serve's)."""
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    if ordered and header.get("clock") == "epoch":
        t0 = ordered[0].arrival_time
        for r in ordered:
            r.arrival_time -= t0
    return Trace(ordered, header)


# -- files -------------------------------------------------------------------------------------


def trace_header(source: str, **extra) -> dict:
    return {"format": "tidal-trace", "version": FORMAT_VERSION,
            "block_tokens": TRACE_BLOCK_TOKENS, "source": source, "created": time.time(),
            **extra}


def write_trace(path: str, trace: Trace) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(trace.header) + "\n")
        for request in trace.requests:
            f.write(json.dumps(request.to_json()) + "\n")


def read_trace(path: str) -> Trace:
    """The trace in `path` (ValueError naming the file and line on anything unreadable)."""
    header: dict | None = None
    requests = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{where}: not JSON ({e})") from None
                if row.get("format") == "tidal-trace":
                    header = _check_header(row, where)
                else:
                    requests.append(TraceRequest.from_json(row, where))
    except OSError as e:
        raise ValueError(f"trace {path!r}: {e}") from None
    if header is None:
        raise ValueError(f"trace {path!r}: no header line (format tidal-trace)")
    if not requests:
        raise ValueError(f"trace {path!r} holds no requests")
    return normalized(requests, header)


def _check_header(row: dict, where: str) -> dict:
    if row.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}: trace version {row.get('version')} is not {FORMAT_VERSION}")
    if row.get("block_tokens") != TRACE_BLOCK_TOKENS:
        raise ValueError(f"{where}: block_tokens {row.get('block_tokens')} is not "
                         f"{TRACE_BLOCK_TOKENS}")
    return row


def start_recording(path: str, source: str = "tidal serve") -> bytes:
    """Create (or truncate) the trace file with its header; returns the hash key the
    recorders of this recording share. Arrival times are wall-clock (`"clock": "epoch"`).

    The file is readable by its owner alone (0600), an existing one too: its hashes and
    lengths describe the users' prompts."""
    key = new_hash_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode applies to a new file only
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(trace_header(source, clock="epoch")) + "\n")
    return key


class TraceRecorder:
    """Appends one line per finished request to a trace file `start_recording` made.

    Several HTTP server processes may append to the same file: each line is one `write` on a
    file opened with O_APPEND, and they share the hash `key`, so their hashes compare.
    """

    def __init__(self, path: str, key: bytes) -> None:
        self.path = path
        self.key = key
        self._lock = threading.Lock()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._file = os.fdopen(fd, "ab", buffering=0)

    def record(self, arrival_time: float, prompt_token_ids: Sequence[int], output_len: int,
               priority: int = 0, finish_reason: str | None = None) -> None:
        """One finished request (arrival_time: time.time() when it arrived)."""
        request = TraceRequest(arrival_time, len(prompt_token_ids), output_len,
                               block_hashes(prompt_token_ids, self.key), priority,
                               finish_reason)
        data = (json.dumps(request.to_json()) + "\n").encode()
        with self._lock:
            self._file.write(data)

    def close(self) -> None:
        self._file.close()


def new_hash_key() -> bytes:
    """A random key for one recording (never written to the trace)."""
    return os.urandom(16)
