"""Every message that crosses a process boundary in tidal, and what a request carries across
all of them.

Three conversations, each a tagged union so a decoder built for one side accepts exactly the
messages that side may receive (anything else fails to decode, is logged and dropped):

    frontend ──FrontendMessage──► engine core ──CoreToWorker──► workers (every rank)
    frontend ◄──CoreToFrontend─── engine core ◄──WorkerToCore── worker (rank 0 answers a step)

Each boundary's messages are in their own module:

    ipc/frontend_messages.py   frontend ⇄ engine core: Hello, AddRequest, ..., EngineOutputs
    ipc/worker_messages.py     engine core ⇄ workers: WorkerConfig, BatchPlan, SampledTokens, ...
    ipc/messages.py (this)     what both carry: packed token ids, `SamplingParams`,
                               `StructuredOutputsParams`, `LoRARequest`, token and prompt
                               logprobs, and their checks

and one short-lived side conversation, whose types are in `ipc/advice.py`: after preemptions
the engine core hands the requests it saw (`PreemptionWindow`, a msgpack file) to a simulator
process (`tidal.engine_core.advice.advise`), which answers with a `PreemptionPrediction` on
stdout.

Conventions (every module of ipc/ that defines messages):
- Structs are `array_like=True` (positional on the wire, new fields go at the end),
  `omit_defaults=True`, `gc=False`; none of them holds a reference cycle.
- Token ids travel as little-endian int32 `bytes` (see `pack_token_ids` / `unpack_token_ids`),
  never as one Python object per token on the hot path.
- A request id (`req_id`) is a string unique within the engine core; frontends make it unique.
"""

from __future__ import annotations

import json
import sys
from array import array

import msgspec

from .grammar import TOO_DEEP, compile_constraint

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)

INT32_MAX = 2**31 - 1
"""Largest token id, top_k or min_tokens a worker takes (token ids travel as int32)."""
FLOAT32_MAX = 3.4028234663852886e38
"""Largest temperature or repetition penalty a worker takes (it samples in float32)."""

# ---------------------------------------------------------------------------------------------
# token id arrays

_LITTLE = sys.byteorder == "little"


def pack_token_ids(token_ids) -> bytes:
    """Token ids (any iterable of ints, an `array('i')` or an int32 numpy array) to bytes."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return bytes(token_ids)
    if isinstance(token_ids, array) and token_ids.typecode == "i":
        arr = token_ids
    elif hasattr(token_ids, "astype") and hasattr(token_ids, "tobytes"):  # numpy array
        return token_ids.astype("<i4", copy=False).tobytes()
    else:
        arr = array("i", token_ids)
    if not _LITTLE:
        arr = array("i", arr)
        arr.byteswap()
    return arr.tobytes()


def unpack_token_ids(data: bytes) -> array:
    """Bytes from `pack_token_ids` back to an `array('i')` (supports slicing, len, tolist)."""
    arr = array("i")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr


# ---------------------------------------------------------------------------------------------
# structured output


class StructuredOutputsParams(msgspec.Struct, **_STRUCT):
    """Constrain a request's output to a grammar (vLLM's `StructuredOutputsParams`): exactly
    one of `json`, `regex`, `choice`, `grammar`, `json_object`. The worker compiles it with
    xgrammar and masks every token the grammar does not allow; the request finishes with
    "stop" on the EOS / stop token the grammar allows once it is complete.

    Checked for shape here (the engine core decodes it without xgrammar); whether it compiles
    is checked by the frontend, which has the tokenizer (ValueError naming the field).
    """

    json: str | dict | None = None
    """A JSON schema (a dict or its JSON text): the output is one JSON value it accepts."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar / GBNF syntax, the rule `root` first)."""
    json_object: bool = False
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (a model that rambles spaces cannot)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # one canonical form on the wire: the schema's text
            try:
                self.json = json.dumps(self.json)
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of json, regex, choice, grammar, json_object; got "
               f"{', '.join(given) or 'none'}")
        _check(self.choice is None or (len(self.choice) > 0 and all(
            isinstance(c, str) and c and is_valid_unicode(c) for c in self.choice)),
            "structured_outputs.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)

    @property
    def num_bytes(self) -> int:
        """The constraint's size: its schema's text, regex, grammar, or choices together
        (UTF-8 bytes), what `--structured-outputs-max-bytes` limits."""
        if self.json_object:
            return 0
        text = self.json if self.json is not None else self.regex if self.regex is not None \
            else self.grammar if self.grammar is not None else "".join(self.choice or ())
        return len(text.encode("utf-8", "surrogatepass"))

    def compile_with(self, compiler):
        """The xgrammar `CompiledGrammar` of this constraint (`grammar.compile_constraint`);
        ValueError naming the field when it does not compile."""
        return compile_constraint(self, compiler)


# ---------------------------------------------------------------------------------------------
# sampling


class SamplingParams(msgspec.Struct, **_STRUCT):
    """How to pick tokens for one request. Validated on construction and on decode.

    Defaults follow vLLM's `SamplingParams`. `temperature == 0` means greedy.
    """

    n: int = 1
    """Number of completions for the prompt; the frontend fans out n > 1 into n requests."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """Tokens generated before EOS or a stop token / stop string may end the request."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence of a token among the generated tokens."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in prompt or output (HF)."""
    stop: list[str] = []
    """Stop strings, applied by the frontend on detokenized text."""
    stop_token_ids: list[int] = []
    """Token ids that end the request (the stop token is part of the output)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token plus this many top alternatives."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    prompt_logprobs: int | None = None
    """Return, for every prompt position after the first, the log-probability of the prompt
    token there plus this many top alternatives (vLLM's semantics). Such a request does not
    read the prefix cache until they are computed (cached positions have no logits)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see the class)."""

    def __post_init__(self) -> None:
        """ValueError naming the field for a value out of range, or one the worker cannot
        hold (it keeps these in float32 / int64 arrays): the same rules run on decode, so
        a value that passes here never reaches a worker it would crash."""
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= INT32_MAX, "min_tokens",
               f"must be in [0, {INT32_MAX}], got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.temperature >= 0.0, "temperature",
               f"must be non-negative, got {self.temperature}")
        _check(self.temperature <= FLOAT32_MAX, "temperature",
               f"must be finite (at most {FLOAT32_MAX:.4g}), got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k <= INT32_MAX, "top_k",
               f"must be -1, 0 (off) or positive (at most {INT32_MAX}), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= FLOAT32_MAX, "repetition_penalty",
               f"must be positive and finite, got {self.repetition_penalty}")
        _check(all(isinstance(s, str) and s and is_valid_unicode(s) for s in self.stop),
               "stop", "must be non-empty strings of valid Unicode (no lone surrogates)")
        _check(all(0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
               f"must be token ids in [0, {INT32_MAX}]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
               "must fit in a signed 64-bit integer")
        _check(self.structured_outputs is None or not self.ignore_eos or self.stop_token_ids,
               "ignore_eos", "cannot be set with structured_outputs unless stop_token_ids "
               "are given: a complete grammar ends the request on EOS or a stop token")
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
               "cannot be set with structured_outputs: the grammar decides where the output "
               "ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


def is_valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON may escape one, "\\ud800"): no
    tokenizer can encode it and msgpack cannot carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_priority(priority: int, scheduling_policy: str) -> None:
    """ValueError for a priority other than 0 under the fcfs policy (vLLM refuses it too:
    the request would be scheduled as if it had none). Frontends check before sending; the
    engine core checks again."""
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority {priority} needs --scheduling-policy priority; this engine "
                         "schedules fcfs, where every request's priority must be 0")


# ---------------------------------------------------------------------------------------------
# LoRA adapters


class LoRARequest(msgspec.Struct, **_STRUCT):
    """A LoRA adapter a request runs with (vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`): a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) that
    every worker reads itself, so only the path crosses the wire, never tensors. The id names
    the adapter in the engine core (its slots, the prefix cache) and must be at least 1; one
    id always means one (name, path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        _check(isinstance(self.lora_name, str) and self.lora_name != "", "lora_request",
               "lora_name must be a non-empty string")
        _check(1 <= self.lora_int_id <= INT32_MAX, "lora_request",
               f"lora_int_id must be in [1, {INT32_MAX}], got {self.lora_int_id}")
        _check(isinstance(self.lora_path, str) and self.lora_path != "", "lora_request",
               "lora_path must be a non-empty path to a PEFT adapter folder")




# ---------------------------------------------------------------------------------------------
# log-probabilities


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probabilities at one position: the sampled token first, then the top alternatives.

    `token_ids` is packed int32, `logprobs` packed float32; `sampled_rank` is the sampled
    token's rank in the distribution (1 = the most likely).
    """

    token_ids: bytes
    logprobs: bytes
    sampled_rank: int = 1


class PromptLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probabilities of the prompt tokens at positions [start, start + num_positions) of
    one request, each from the model's distribution after the tokens before it.

    Row i is position start + i: `token_ids` (packed int32) and `logprobs` (packed float32)
    hold `1 + num_logprobs` entries per row, the prompt token first, then the top
    alternatives, most likely first; `ranks` (packed int32) is the prompt token's rank in the
    distribution (1 = the most likely). Position 0 has no distribution and never appears.
    """

    req_id: str
    start: int
    num_logprobs: int
    token_ids: bytes
    logprobs: bytes
    ranks: bytes

    @property
    def num_positions(self) -> int:
        return len(self.ranks) // 4


def join_prompt_logprobs(parts: list[PromptLogprobs]) -> PromptLogprobs:
    """Consecutive parts of one request (each starting where the previous ends) as one."""
    first = parts[0]
    if len(parts) == 1:
        return first
    return PromptLogprobs(first.req_id, first.start, first.num_logprobs,
                          b"".join(p.token_ids for p in parts),
                          b"".join(p.logprobs for p in parts), b"".join(p.ranks for p in parts))


def drop_prompt_positions(part: PromptLogprobs, num_rows: int) -> PromptLogprobs:
    """The part without its first `num_rows` positions."""
    width = 4 * (1 + part.num_logprobs)
    return PromptLogprobs(part.req_id, part.start + num_rows, part.num_logprobs,
                          part.token_ids[num_rows * width:], part.logprobs[num_rows * width:],
                          part.ranks[num_rows * 4:])
