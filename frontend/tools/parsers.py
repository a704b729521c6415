"""Tool-call parsers: a model's generated text -> (content, tool calls), whole or streamed.

Each parser knows one output format (vLLM's `--tool-call-parser` names):

    hermes       Qwen 2.5 / 3, Hermes:  text <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>
    llama3_json  Llama 3.1-3.3:         {"name": N, "parameters": {..}}; {...}   (the whole output,
                                        optionally after <|python_tag|>)
    mistral      Mistral:               text [TOOL_CALLS][{"name": N, "arguments": {..}}, ...]
                                        (or, v11 tokenizers, [TOOL_CALLS]N[ARGS]{..})
    pythonic     Llama 3.2 / 4:         [f(a=1, b='x'), g()]   (the whole output)

and, not a flag value, `json_list`: the `[{"name": N, "parameters": {..}}, ...]` array tidal's
grammar forces for `tool_choice` "required" / named under a parser whose own format it cannot
express (pythonic; vLLM's form for those choices).

A parser's `extract(text)` returns the text outside calls as `content` (None when empty) and
the calls whose JSON (or Python call) parses; anything that does not parse stays in the
content, so nothing the model wrote is lost. `stream()` gives a `ToolCallStream`: `feed(delta)`
returns the content that is certainly not part of a call (a possible call marker is held back
until it is decided) and each call once it is complete; `finish()` flushes the rest.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's
    `function.arguments`)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_call_id)

    def to_openai(self) -> dict:
        """The call as chat completions' `message.tool_calls[i]`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Extracted:
    """A whole output split into the text outside tool calls and the calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass
class StreamDelta:
    """What one `feed` / `finish` releases: content text, and the calls completed by it."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _call_from_object(obj: Any, args_keys=("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from {"name": str, "arguments" | "parameters": object | JSON string}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base of the parsers. Subclasses set `name` and implement `extract`; a parser whose
    calls are all marked by `start` (a string that begins every call region) gets a streaming
    state machine from `ToolCallStream` for free."""

    name = ""
    start: str = ""
    """The marker that opens the tool-call region (content before it is plain text)."""
    whole_output = False
    """True for formats where calls are the whole output (the region starts at the first
    non-space character, or not at all)."""
    skip_special_tokens = True
    """False for formats whose markers are special tokens the text must keep."""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def region_starts(self, text: str) -> bool:
        """For `whole_output` formats: does `text` (stripped, non-empty) open a call region?"""
        return text.startswith(self.start)


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks (Qwen 2.5 / 3, Hermes 2 Pro). With calls, the
    content is the text before the first block (as vLLM's hermes parser: what follows the
    calls, such as a last block cut by max_tokens, is dropped); without, the whole text. A
    last block left unclosed still counts when its JSON is complete (a model may end on EOS
    instead of the closing tag)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        calls, first = [], None
        for m in self._BLOCK.finditer(text):
            call = _parse_json_call(m.group(1).strip())
            if call is not None:
                calls.append(call)
                first = m.start() if first is None else first
        return _extracted(text[:first] if calls else text, calls)

    def complete_prefix(self, region: str) -> int:
        """Length of the complete blocks at the head of `region` (which starts at a marker),
        0 while the first is still open."""
        end = region.find(self.end)
        return 0 if end < 0 else end + len(self.end)


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calls: the output is `{"name": N, "parameters": {...}}`,
    several separated by ";", optionally after `<|python_tag|>`. Anything else is content."""

    name = "llama3_json"
    start = "{"
    whole_output = True
    skip_special_tokens = False
    _TAG = "<|python_tag|>"

    def region_starts(self, text: str) -> bool:
        return text.startswith("{") or text.startswith(self._TAG)

    def extract(self, text: str) -> Extracted:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG):].strip()
        if not body.startswith("{"):
            return _extracted(text, [])
        calls, rest = _json_sequence(body, separators=";")
        if not calls or rest.strip():
            return _extracted(text, [])
        return Extracted(None, calls)


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (or, v11 tokenizers,
    `[TOOL_CALLS]name[ARGS]{...}` repeated); content is the text before the marker."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    skip_special_tokens = False
    _V11 = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def extract(self, text: str) -> Extracted:
        at = text.find(self.start)
        if at < 0:
            return _extracted(text, [])
        body = text[at + len(self.start):]
        calls = self._parse_body(body)
        if calls is None:
            return _extracted(text, [])
        return _extracted(text[:at], calls)

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        stripped = body.strip()
        if stripped.startswith("["):
            try:
                value, end = json.JSONDecoder().raw_decode(stripped)
            except ValueError:
                return None
            calls = [_call_from_object(v) for v in value] if isinstance(value, list) else [None]
            return calls if calls and all(calls) and not stripped[end:].strip() else None
        calls = []
        while body.strip():  # name[ARGS]{json} (repeated, each after [TOOL_CALLS])
            body = body.lstrip()
            if body.startswith(self.start):
                body = body[len(self.start):]
            m = self._V11.match(body)
            if not m:
                return None
            try:
                args, end = json.JSONDecoder().raw_decode(body[m.end():])
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
            body = body[m.end() + end:]
        return calls or None


class PythonicParser(ToolParser):
    """A Python list of calls as the whole output: `[get_weather(city='Paris'), f()]`
    (Llama 3.2 / 4's pythonic format), optionally within <|python_start|>...<|python_end|>.
    Arguments must be literals (strings, numbers, booleans, None, lists, dicts)."""

    name = "pythonic"
    start = "["
    whole_output = True
    skip_special_tokens = False
    _WRAP = ("<|python_start|>", "<|python_end|>")

    def region_starts(self, text: str) -> bool:
        return text.startswith("[") or text.startswith(self._WRAP[0])

    def extract(self, text: str) -> Extracted:
        body = text.strip()
        if body.startswith(self._WRAP[0]):
            body = body[len(self._WRAP[0]):]
            body = body[:-len(self._WRAP[1])] if body.endswith(self._WRAP[1]) else body
            body = body.strip()
        calls = _pythonic_calls(body)
        return Extracted(None, calls) if calls else _extracted(text, [])


class JsonListParser(ToolParser):
    """`[{"name": N, "parameters": {...}}, ...]` as the whole output: the form tidal's
    grammar forces for "required" / named choices under a parser with no grammar of its own."""

    name = "json_list"
    start = "["
    whole_output = True

    def extract(self, text: str) -> Extracted:
        try:
            value = json.loads(text)
        except ValueError:
            return _extracted(text, [])
        calls = [_call_from_object(v) for v in value] if isinstance(value, list) else []
        return Extracted(None, calls) if calls and all(calls) else _extracted(text, [])


def _extracted(content: str, calls: list[ToolCall]) -> Extracted:
    return Extracted(content if content.strip() or not calls else None, calls) \
        if content else Extracted(None, calls)


def _parse_json_call(text: str) -> ToolCall | None:
    try:
        return _call_from_object(json.loads(text))
    except ValueError:
        return None


def _json_sequence(text: str, separators: str) -> tuple[list[ToolCall], str]:
    """Calls decoded from JSON objects one after another (separated by whitespace or one of
    `separators`), and the text after the last one that decoded."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls, text[pos:]
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return calls, text[pos:]
        call = _call_from_object(obj)
        if call is None:
            return calls, text[pos:]
        calls.append(call)
        pos = end


def _pythonic_calls(body: str) -> list[ToolCall]:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(
                node.func, (ast.Name, ast.Attribute)):
            return []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return []
        if None in args:  # **kwargs
            return []
        calls.append(ToolCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
    return calls


# ---------------------------------------------------------------------------------------------
# streaming


class ToolCallStream:
    """The streaming state machine of one output: text in, (content, completed calls) out.

    States: `text` (plain content; a tail that could be the start of the parser's marker is
    held back), `region` (from the marker on, everything is held: calls are released as they
    complete, for hermes at each closing tag, for the others at the end), `done`. Whole-output
    formats decide at the first non-space character: a region, or plain text to the end.

    Calls come out whole (name and complete arguments): `to_chunks` below makes them OpenAI's
    two deltas per call. The content released over the stream plus that of `finish` equals
    `parser.extract(full_text).content` for a well-formed output.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0  # characters of `text` released as content
        self.region_at: int | None = None  # where the call region starts in `text`
        self.region_parsed = 0  # characters of the region whose calls were released
        self.num_calls = 0
        self.plain = False  # a whole-output format that turned out to be plain text

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        if self.region_at is None and not self.plain:
            self._find_region()
        if self.region_at is None:
            return StreamDelta(self._release_content(self._safe_content_end()))
        out = StreamDelta(self._release_content(self.region_at))
        if isinstance(self.parser, HermesParser):
            out.calls = self._hermes_complete_blocks()
        return out

    def finish(self) -> StreamDelta:
        """Everything still held: the rest of the content and the calls of the region."""
        if self.region_at is None:
            return StreamDelta(self._release_content(len(self.text)))
        region = self.text[self.region_at + self.region_parsed:]
        extracted = self.parser.extract(region) if region else Extracted(None, [])
        if self.num_calls:  # after calls, what is left is not content (HermesParser)
            extracted.content = None
        # (a region without calls goes out as content after all: extract keeps it)
        out = StreamDelta(self._release_content(self.region_at) + (extracted.content or ""),
                          extracted.calls)
        self.num_calls += len(out.calls)
        return out

    def _find_region(self) -> None:
        if self.parser.whole_output:
            stripped = self.text.lstrip()
            if not stripped:
                return
            prefixes = [self.parser.start, getattr(self.parser, "_TAG", None),
                        getattr(self.parser, "_WRAP", (None,))[0]]
            if self.parser.region_starts(stripped):
                self.region_at = 0
            elif not any(p and p.startswith(stripped) for p in prefixes):
                self.plain = True
            return
        at = self.text.find(self.parser.start, self.sent_content)
        if at >= 0:
            self.region_at = at

    def _safe_content_end(self) -> int:
        """How much of `text` is certainly content: all of it, less a tail that is a prefix
        of the marker (or, for a whole-output format, all of it until it is decided)."""
        if self.plain:
            return len(self.text)
        if self.parser.whole_output:
            return self.sent_content
        marker = self.parser.start
        for keep in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def _release_content(self, end: int) -> str:
        piece = self.text[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return piece

    def _hermes_complete_blocks(self) -> list[ToolCall]:
        calls = []
        while True:
            region = self.text[self.region_at + self.region_parsed:]
            start = region.find(self.parser.start)
            if start < 0:
                return calls
            size = self.parser.complete_prefix(region[start:])
            if not size:
                return calls
            block = region[:start + size]
            extracted = self.parser.extract(block)
            if not extracted.calls:  # a block that does not parse: leave it for finish()
                return calls
            calls += extracted.calls
            self.num_calls += len(extracted.calls)
            self.region_parsed += start + size


def to_chunks(calls: list[ToolCall], first_index: int) -> list[dict]:
    """OpenAI's streamed `delta.tool_calls` entries for completed calls: per call, one with
    its index, id, type and name (arguments ""), then one with its arguments."""
    out = []
    for i, call in enumerate(calls, first_index):
        out.append({"index": i, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})
        out.append({"index": i, "function": {"arguments": call.arguments}})
    return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}
"""`--tool-call-parser` values -> parser classes."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser for `name` (a `TOOL_PARSERS` key, or "json_list"); ValueError naming the
    known ones."""
    if name == JsonListParser.name:
        return JsonListParser()
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; tidal has "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
