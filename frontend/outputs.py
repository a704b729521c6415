"""What `LLM.generate` returns and `AsyncLLM.generate` yields (vLLM's shapes).

A `RequestOutput` is one prompt; its `outputs` are the `n` completions. `text`, `token_ids`
and `logprobs` of a `CompletionOutput` are cumulative; the `delta_*` fields hold only what is
new since the previous update of that completion (for `LLM.generate`, whose single update is
the final one, delta and cumulative coincide).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position."""

    token_id: int
    logprob: float
    rank: int
    """Rank in the distribution at that position (1 = the most likely)."""
    decoded_token: str
    """The token on its own, decoded."""


@dataclass
class CompletionOutput:
    """One of the `n` completions of a prompt."""

    index: int
    """Which of the n completions (0-based)."""
    text: str
    """Text so far. A matched stop string is removed unless `include_stop_str_in_output`;
    while streaming with stop strings, the last `max(len(stop)) - 1` characters are held back
    until the completion finishes, so a partial stop string is never shown."""
    token_ids: list[int]
    """Generated token ids so far (cumulative)."""
    delta_text: str
    """Text new since the previous update of this completion."""
    delta_token_ids: list[int]
    """Token ids new since the previous update."""
    logprobs: list[dict[int, "Logprob"]] | None
    """Per generated token: the sampled token plus the requested top alternatives; None unless
    `SamplingParams.logprobs` was set."""
    delta_logprobs: list[dict[int, "Logprob"]] | None
    """The entries of `logprobs` new since the previous update."""
    cumulative_logprob: float | None
    """Sum of the sampled tokens' log-probabilities; None unless logprobs were requested."""
    finish_reason: str | None
    """None while running, then "stop", "length", "abort" or "error"."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the completion (None for EOS / length)."""
    error: str | None = None
    """With finish_reason "error": what went wrong."""

    @property
    def finished(self) -> bool:
        """Whether this completion is over."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of one request (wall-clock seconds, `time.time()`).

    For n > 1 the timings and `num_cached_tokens` are those of the first completion (index 0);
    `num_generation_tokens` counts the tokens of all n completions.
    """

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    queue_time: float | None
    """Seconds from the engine core receiving the request to its first scheduling."""
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    """Prompt tokens found in the prefix cache at admission."""
    inter_token_latencies: list[float] = field(default_factory=list)
    """Seconds between consecutive outputs of the first completion (one entry per output
    message after the first; a message may carry several tokens)."""


@dataclass
class RequestOutput:
    """One prompt's result (LLM.generate) or one update of it (AsyncLLM.generate)."""

    request_id: str
    prompt: str | None
    """The prompt text, or None when the prompt was given as token ids."""
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    """LLM.generate: all n completions, final, in index order. AsyncLLM.generate: the
    completions that changed in this update."""
    finished: bool
    """True on the last update (all n completions finished)."""
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first
    (nothing precedes it), then the prompt token's log-probability plus the top alternatives
    (vLLM's shape); present from the update with the first generated token on. None when not
    asked for."""


@dataclass
class EmbeddingOutput:
    """One prompt's vector (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Its length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt and `AsyncLLM.embed` gives (vLLM's shape:
    `outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput | None
    """The vector; None when the request ended without one (finish_reason abort / error)."""
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    """The prompt text, or None when it was given as token ids."""
    finish_reason: str | None = None
    """"stop" with a vector; "abort" or "error" without."""
    error: str | None = None
    """With finish_reason "error": what went wrong."""
