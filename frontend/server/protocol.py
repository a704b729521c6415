"""Request and response models of the OpenAI-compatible API, with vLLM's extra fields.

Requests are validated by pydantic (types and the documented bounds, which also appear in
/openapi.json); the sampling fields are then validated once more by `SamplingParams` itself
(cross-field rules such as min_tokens <= max_tokens), whose ValueError names the field. Unknown
request fields are accepted and ignored, as OpenAI SDKs and tools send fields of their own.
Floats must be finite (NaN / Infinity are rejected with a 400).

Response models document the shapes (they appear in /openapi.json and the tests validate
against them); the hot path builds the same shapes as plain dicts (see serving.py).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator,
    model_validator,
)

from ..structured_output import from_request_fields
from ...ipc.messages import SamplingParams, StructuredOutputsParams, is_valid_unicode

INT32_MAX = 2**31 - 1
MAX_N = 128
"""Most completions one request may ask for (n times the number of prompts)."""

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int32 = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _valid_unicode(text: str) -> str:
    """JSON may escape lone surrogates ("\\ud800"); no tokenizer can encode them, and no
    answer could quote them back."""
    if not is_valid_unicode(text):
        raise ValueError("must be valid Unicode (it contains a lone surrogate escape)")
    return text


MAX_STOP_STRINGS = 64
"""Most stop strings one request may give (OpenAI allows 4; vLLM has no limit)."""
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string, in characters. Each new token's text is searched for every stop
string over the new characters plus a look-back of the string's length (output_processor.py),
and a stream holds back the longest one's length: both limits bound that work per token."""


def _check_stop(stop: str | list[str] | None):
    """At most MAX_STOP_STRINGS stop strings of at most MAX_STOP_STRING_CHARS each."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got "
                         f"{len(strings)}")
    longest = max(map(len, strings), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} "
                         f"characters, got one of {longest}")
    return stop


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[Text, Field(min_length=1)]
Stop = Annotated[StopString | list[StopString] | None, AfterValidator(_check_stop)]


class OpenAIModel(BaseModel):
    """Base of every request model: unknown fields ignored, floats finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    """`stream_options` of a streaming request."""

    include_usage: bool = False
    """Send one last chunk, with empty `choices`, carrying the request's token usage."""
    continuous_usage_stats: bool = False
    """(vLLM) carry the usage so far in every chunk."""


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    """The served model name; None means the (only) served model."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    """Number of completions per prompt."""
    stream: bool = False
    """Answer as server-sent events, one `data: {json}` per update, ending `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    """Options of a streaming answer (`include_usage`)."""
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    """Softmax temperature (default 1.0); 0 is greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Nucleus sampling threshold in (0, 1] (default 1.0)."""
    stop: Stop = None
    """Stop string(s): generation ends when the text contains one; removed from the text.
    At most MAX_STOP_STRINGS, each at most MAX_STOP_STRING_CHARS characters."""
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    """Per-request seed: same seed, same tokens, whatever else runs in the batch."""
    presence_penalty: Penalty = 0.0
    """OpenAI presence penalty in [-2, 2]."""
    frequency_penalty: Penalty = 0.0
    """OpenAI frequency penalty in [-2, 2]."""
    user: str | None = None
    """An end-user id (accepted, not used)."""
    logit_bias: dict[str, float] | None = None
    """Not supported: a non-empty map is rejected with a 400."""
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """(vLLM) keep the k most likely tokens; 0 or -1 means all."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """(vLLM) drop tokens below min_p times the most likely token's probability."""
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    """(vLLM) HF repetition penalty (> 0, 1 = off)."""
    ignore_eos: bool = False
    """(vLLM) keep generating after the EOS token."""
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    """(vLLM) tokens generated before EOS / stop may end the request."""
    stop_token_ids: list[TokenId] | None = None
    """(vLLM) token ids that end the request."""
    priority: Int32 = 0
    """(vLLM) scheduling priority with `--scheduling-policy priority`; lower runs first."""
    include_stop_str_in_output: bool = False
    """(vLLM) keep the matched stop string in the text."""
    skip_special_tokens: bool = True
    """(vLLM) leave special tokens out of the text."""
    return_token_ids: bool = False
    """(vLLM) add `token_ids` to each choice (and `prompt_token_ids` to the response)."""
    response_format: dict[str, Any] | None = None
    """`{"type": "text"}` (the default), `{"type": "json_object"}`, or `{"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: the output
    is JSON (matching the schema), enforced token by token."""
    guided_json: str | dict[str, Any] | None = None
    """(vLLM) the output is JSON matching this schema."""
    guided_regex: str | None = None
    """(vLLM) the output matches this regular expression."""
    guided_choice: list[str] | None = None
    """(vLLM) the output is one of these strings."""
    guided_grammar: str | None = None
    """(vLLM) the output follows this EBNF grammar (xgrammar syntax)."""
    structured_outputs: dict[str, Any] | None = None
    """(vLLM) one of {"json": schema}, {"regex": r}, {"choice": [...]}, {"grammar": g},
    {"json_object": true}, optionally with "disable_any_whitespace"."""

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that set it (ValueError naming the
        field when it is malformed or set twice)."""
        return from_request_fields({
            "response_format": self.response_format, "guided_json": self.guided_json,
            "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
            "structured_outputs": self.structured_outputs})

    def sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """Keyword arguments for `SamplingParams`, request defaults filled in."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_output()[0],
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _prompt_kind(value: Any) -> str:
    """Which of `Prompt`'s shapes a value is, by its first element: pydantic then validates
    that shape alone. Left to try each shape in turn, it collected an error for every element
    of a token-id list while trying strings: 1.24 s for a 4.8 MB body of a million ids, on the
    event loop, against 0.28 s so."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "token_lists"
    return "tokens"


PROMPT_SHAPES = ("text", "texts", "tokens", "token_lists")
"""The tags of `Prompt`'s shapes (pydantic puts the one it validated in an error's location)."""

Prompt = Annotated[Union[
    Annotated[Text, Tag("text")],
    Annotated[list[Text], Tag("texts")],
    Annotated[list[TokenId], Tag("tokens")],
    Annotated[list[list[TokenId]], Tag("token_lists")],
], Discriminator(_prompt_kind)]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    """Most tokens to generate per completion (default 16; null = up to the context)."""
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """Log-probabilities of the sampled token and this many top alternatives per position."""
    echo: bool = False
    """Put the prompt in front of the completion text (and, with `logprobs`, the prompt's
    tokens and their logprobs in front of the completion's; the first has none: null)."""
    suffix: str | None = None
    """Not supported (rejected when set)."""
    best_of: int | None = None
    """Not supported beyond `best_of == n` (rejected otherwise)."""

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for each prompt; ValueError names the bad field."""
        prompt_logprobs = self.logprobs if self.echo else None
        return SamplingParams(**self.sampling_kwargs(self.max_tokens, self.logprobs),
                              prompt_logprobs=prompt_logprobs)


class TextContent(OpenAIModel):
    """One text part of a message's content list."""

    type: Literal["text"]
    text: Text


NOT_SUPPORTED_PARTS = "tidal serves text-only models: images, audio, video and files are " \
                      "not supported"


class ChatMessage(OpenAIModel):
    """One message of a chat conversation."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """A content part other than text is refused by name (not a pydantic dump)."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, "text"):
                raise ValueError(f"content part type {kind!r} is not supported: "
                                 f"{NOT_SUPPORTED_PARTS}")
        return content

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContent] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls (OpenAI's shape, `function.arguments` a JSON string), handed to
    the chat template with the arguments as an object, as HF templates expect."""
    tool_call_id: Text | None = None
    """A tool message's answer to which call."""

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_supported(cls, data):
        """OpenAI fields tidal does not serve are refused by name, never ignored: the legacy
        `functions` / `function_call` (use `tools`), and audio output."""
        if not isinstance(data, dict):
            return data
        for legacy in ("functions", "function_call"):
            if data.get(legacy) is not None:
                raise ValueError(f"{legacy} is not supported (OpenAI's legacy function "
                                 "calling): give the functions as tools=[{\"type\": "
                                 "\"function\", \"function\": {...}}] (docs/tools.md)")
        modalities = data.get("modalities")
        if data.get("audio") is not None or (isinstance(modalities, list)
                                             and set(modalities) - {"text"}):
            raise ValueError(f"audio output is not supported: {NOT_SUPPORTED_PARTS}")
        return data

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    """The conversation, rendered with the tokenizer's chat template."""
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Most tokens to generate (null = up to the context)."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Deprecated OpenAI alias of `max_completion_tokens`."""
    logprobs: bool = False
    """Return the log-probability of each sampled token."""
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """With `logprobs`, also this many most likely alternatives per position."""
    add_generation_prompt: bool = True
    """(vLLM) end the rendered prompt with the assistant's turn header."""
    continue_final_message: bool = False
    """(vLLM) leave the last (assistant) message open so the model continues it."""
    chat_template_kwargs: dict[str, Any] | None = None
    """(vLLM) extra variables for the chat template."""
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call, `[{"type": "function", "function": {"name",
    "description", "parameters": JSON schema}}]`, handed to the chat template (docs/tools.md)."""
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto" (the default with tools; needs --enable-auto-tool-choice), "required",
    or `{"type": "function", "function": {"name": N}}`; "required" and named choices are
    enforced by a grammar of the tools' schemas."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per answer (default true)."""

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for the conversation; ValueError names the bad field."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self.sampling_kwargs(max_tokens, top))


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: either `prompt` or `messages`."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    """For `prompt`: let the tokenizer add its special tokens (BOS, ...)."""
    add_generation_prompt: bool = True
    """For `messages`: end with the assistant's turn header."""
    return_token_strs: bool = False
    """Also return each token as a string."""


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: Text | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------------------------
# responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx / 5xx body."""

    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """Legacy (completions) logprobs: parallel lists, one entry per generated token (with
    `echo`, per prompt token first; the very first prompt token's logprob is null)."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """The arguments as a JSON string."""


class ToolCallInfo(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallInfo] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tidal"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
