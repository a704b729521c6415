"""Benchmark workloads: lists of (prompt, prompt length, output length) with a fixed seed.

Four sources, chosen by `DatasetConfig.name`:

- `random`: input/output lengths uniform within +-`range_ratio` of `input_len`/`output_len`,
  optionally after a shared prefix of `prefix_len` tokens (vLLM's `random`).
- `sharegpt-like`: a built-in generator whose lengths follow the long-tailed mix of real chat
  traffic (log-normal input and output lengths, as in the ShareGPT set that vLLM benchmarks
  with: most prompts short, a tail of long ones), clamped by rejection to `max_input_len` and
  `max_total_len`, so no download is needed.
- `shared-prefix`: `num_prefixes` common prefixes of `prefix_len` tokens, each followed by a
  distinct suffix of ~`input_len` tokens (exercises the prefix cache).
- `jsonl`: one JSON object per line: `{"prompt": str, "output_len": int}` (`max_tokens` is
  accepted for `output_len`; missing, it is `output_len`).

With a tokenizer, prompts are token-length accurate: random token ids are decoded to text and
re-encoded until the text encodes to exactly the wanted number of tokens (byte-level BPE may
merge across the joins), so `prompt_len` is the true count. Without one, prompts are words from
a fixed list and `prompt_len` is the word count, an estimate (servers report the true count).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

DATASET_NAMES = ("random", "sharegpt-like", "shared-prefix", "jsonl")

# Log-normal parameters of the sharegpt-like mix: median and spread (sigma of log length).
# Medians ~100 prompt / ~120 output tokens, means ~210 / ~200, close to what vLLM's
# ShareGPT-v3 sampling yields after its filters (prompt < 1024, prompt + output < 2048).
SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA = 100.0, 1.2
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 120.0, 1.0
MIN_SHAREGPT_LEN = 4  # vLLM drops pairs with a prompt or an output shorter than this

_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "or had not but what all when we there can one so out up if about who them then she many "
    "some time would like other into more has two way could make than first been long day did "
    "number sound water people over know little most very after word called just where through "
    "back much good before great right think help line same tell boy follow came want show also "
    "around form three small set put end does another well large must big even such because turn"
).split()


@dataclass
class BenchRequest:
    """One request of a workload."""

    prompt: str
    """The text sent (servers tokenize it)."""
    prompt_len: int
    """Its length in tokens (a word-count estimate when no tokenizer was available)."""
    output_len: int
    """Tokens to generate (`max_tokens`; exact with `ignore_eos`)."""
    prompt_token_ids: list[int] | None = None
    """The token ids of `prompt` when a tokenizer was available (offline benchmarks use them)."""


@dataclass
class DatasetConfig:
    """Which workload to build."""

    name: str = "random"
    """random | sharegpt-like | shared-prefix | jsonl."""
    num_prompts: int = 100
    """Number of requests."""
    seed: int = 0
    """Seed of every random choice (same seed, same workload)."""
    input_len: int = 128
    """random: mean prompt length; shared-prefix: suffix length (tokens)."""
    output_len: int = 64
    """random, shared-prefix, jsonl default: mean output length (tokens)."""
    range_ratio: float = 0.0
    """random: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]; 0 = fixed."""
    prefix_len: int = 0
    """random, shared-prefix: tokens of common prefix before each prompt."""
    num_prefixes: int = 1
    """shared-prefix: number of distinct prefixes (requests take them round-robin)."""
    max_input_len: int = 1024
    """sharegpt-like: longest prompt kept (longer draws are redrawn)."""
    max_total_len: int = 2048
    """sharegpt-like: longest prompt + output kept."""
    path: str | None = None
    """jsonl: the file."""

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset name must be one of {DATASET_NAMES}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1, got "
                             f"{self.input_len} and {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ValueError(f"prefix_len must be >= 0 and num_prefixes >= 1, got "
                             f"{self.prefix_len} and {self.num_prefixes}")
        if self.max_input_len < MIN_SHAREGPT_LEN or self.max_total_len < 2 * MIN_SHAREGPT_LEN:
            raise ValueError(f"max_input_len must be >= {MIN_SHAREGPT_LEN} and max_total_len "
                             f">= {2 * MIN_SHAREGPT_LEN}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("path is required for the jsonl dataset (--dataset-path)")


def load_tokenizer(name_or_path: str | None):
    """A fast HF tokenizer from a local folder, or None when there is none to load."""
    if not name_or_path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None


def build_dataset(config: DatasetConfig, tokenizer=None) -> list[BenchRequest]:
    """The workload `config` names, identical for the same config and tokenizer."""
    rng = np.random.default_rng(config.seed)
    maker = PromptMaker(tokenizer, rng)
    if config.name == "random":
        return _random_dataset(config, maker, rng)
    if config.name == "sharegpt-like":
        return _sharegpt_like_dataset(config, maker, rng)
    if config.name == "shared-prefix":
        return _shared_prefix_dataset(config, maker)
    return _jsonl_dataset(config, tokenizer)


class PromptMaker:
    """Makes prompts of an exact token length (with a tokenizer) or a word count (without)."""

    def __init__(self, tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        if tokenizer is not None:
            self.vocab_ids = _stable_word_ids(tokenizer)

    def make(self, length: int, prefix: BenchRequest | None = None) -> BenchRequest:
        """A prompt of `length` tokens, after `prefix` when given (total = both lengths)."""
        if self.tokenizer is None:
            words = list(self.rng.choice(_WORDS, size=length))
            text = " ".join(words)
            if prefix is not None:
                return BenchRequest(prefix.prompt + " " + text, prefix.prompt_len + length, 0)
            return BenchRequest(text, length, 0)
        head = prefix.prompt_token_ids if prefix is not None else []
        ids = head + self._exact_ids(len(head) + length, head)
        return BenchRequest(self.tokenizer.decode(ids), len(ids), 0, ids)

    def _exact_ids(self, total: int, head: list[int]) -> list[int]:
        """Token ids to append to `head` so decode(head + ids) re-encodes to itself.

        Usually `total - len(head)` of them; when a tokenizer merges across the joins no
        matter what, the result is the re-encoded text, and its true length is what counts.
        """
        ids = [int(t) for t in self.rng.choice(self.vocab_ids, size=total - len(head))]
        for _ in range(8):
            encoded = self._encode(self.tokenizer.decode(head + ids))
            if encoded[: len(head)] != head:
                break
            if len(encoded) == total:
                return encoded[len(head):]
            tail = encoded[len(head): total]
            missing = total - len(head) - len(tail)
            extra = self.rng.choice(self.vocab_ids, size=max(0, missing))
            ids = [int(t) for t in tail] + [int(t) for t in extra]
        return self._encode(self.tokenizer.decode(head + ids))[len(head):]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _stable_word_ids(tokenizer) -> np.ndarray:
    """Ids of whole-word tokens (" word") that re-encode to themselves.

    Sequences of them survive decode/encode unchanged with byte-level BPE and SentencePiece
    alike; arbitrary ids do not (partial UTF-8 bytes, merges across joins). All non-special
    ids when the vocabulary has too few such words.
    """
    special = set(tokenizer.all_special_ids)
    candidates = [i for i in range(len(tokenizer)) if i not in special]
    words = []
    for token_id in candidates:
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" ?[A-Za-z]{2,}", text) and \
                tokenizer.encode(" " + text.lstrip(), add_special_tokens=False) == [token_id]:
            words.append(token_id)
    return np.array(words if len(words) >= 32 else candidates)


def _uniform_lengths(rng, mean: int, ratio: float, num: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def _random_dataset(config: DatasetConfig, maker: PromptMaker, rng) -> list[BenchRequest]:
    input_lens = _uniform_lengths(rng, config.input_len, config.range_ratio, config.num_prompts)
    output_lens = _uniform_lengths(rng, config.output_len, config.range_ratio, config.num_prompts)
    prefix = maker.make(config.prefix_len) if config.prefix_len else None
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        request = maker.make(in_len, prefix)
        request.output_len = out_len
        requests.append(request)
    return requests


def sharegpt_like_lengths(config: DatasetConfig, rng) -> list[tuple[int, int]]:
    """(prompt, output) lengths drawn from the log-normal chat mix, redrawn until in bounds."""
    pairs: list[tuple[int, int]] = []
    while len(pairs) < config.num_prompts:
        in_len = int(rng.lognormal(np.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA))
        out_len = int(rng.lognormal(np.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if in_len < MIN_SHAREGPT_LEN or out_len < MIN_SHAREGPT_LEN:
            continue
        if in_len > config.max_input_len or in_len + out_len > config.max_total_len:
            continue
        pairs.append((in_len, out_len))
    return pairs


def _sharegpt_like_dataset(config: DatasetConfig, maker: PromptMaker, rng) -> list[BenchRequest]:
    requests = []
    for in_len, out_len in sharegpt_like_lengths(config, rng):
        request = maker.make(in_len)
        request.output_len = out_len
        requests.append(request)
    return requests


def _shared_prefix_dataset(config: DatasetConfig, maker: PromptMaker) -> list[BenchRequest]:
    prefix_len = max(1, config.prefix_len)
    prefixes = [maker.make(prefix_len) for _ in range(config.num_prefixes)]
    requests = []
    for i in range(config.num_prompts):
        request = maker.make(config.input_len, prefixes[i % config.num_prefixes])
        request.output_len = config.output_len
        requests.append(request)
    return requests


def _jsonl_dataset(config: DatasetConfig, tokenizer) -> list[BenchRequest]:
    """The file's requests in order, cycled to reach `num_prompts`."""
    rows = []
    with open(config.path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                rows.append(_jsonl_row(json.loads(line), config, tokenizer, line_no))
    if not rows:
        raise ValueError(f"dataset path {config.path!r} holds no requests")
    return [BenchRequest(**vars(rows[i % len(rows)])) for i in range(config.num_prompts)]


def _jsonl_row(row: dict, config: DatasetConfig, tokenizer, line_no: int) -> BenchRequest:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{config.path}:{line_no}: field 'prompt' must be a non-empty string")
    output_len = int(row.get("output_len", row.get("max_tokens", config.output_len)))
    if output_len < 1:
        raise ValueError(f"{config.path}:{line_no}: field 'output_len' must be >= 1")
    if tokenizer is None:
        return BenchRequest(prompt, len(prompt.split()), output_len)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return BenchRequest(prompt, len(ids), output_len, ids)
