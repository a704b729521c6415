"""Structured-output constraints beyond their wire shape (`messages.StructuredOutputsParams`):
the limits every process checks before compiling one, the compile itself, and the compile
threads of the frontends and workers. xgrammar is imported inside the functions that use it
(it imports torch, and the engine core, which checks limits here, never does).

A compile runs on a thread of its own (xgrammar releases the GIL: a 13 s compile left the
main thread's largest gap at 0.02 s on this project's 2-core VM) at nice 10, and its timeout
counts that thread's CPU time (`CompileTimer`), so a busy machine slows a compile without
refusing it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .messages import SamplingParams, StructuredOutputsParams

MAX_SCHEMA_DEPTH = 128
"""The deepest nesting of JSON objects and arrays a schema's text may have. xgrammar's compile
time grows faster than linearly with it (on this project's 2-core VM and a 95-token
vocabulary: 100 nested object schemas, 201 levels of JSON, 0.6 s; 300 of them, 13 s), while
real schemas stay within a few dozen levels (OpenAI's structured outputs allow 10 levels of
nested objects)."""

TOO_DEEP = (f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON "
            "objects and arrays")


def check_structured_outputs(sampling: SamplingParams, eos_token_id: int | None,
                             max_bytes: int) -> None:
    """ValueError naming the field for a constraint the engine must not take: one larger than
    `max_bytes` (`--structured-outputs-max-bytes`), a schema nested deeper than
    MAX_SCHEMA_DEPTH, or one with no token to stop on (no EOS, and no stop_token_ids: a
    complete grammar would allow nothing at all). Checked by the frontend and again by the
    engine core, before anything compiles it."""
    spec = sampling.structured_outputs
    if spec is None:
        return
    if spec.num_bytes > max_bytes:
        raise ValueError(f"structured_outputs.{spec.kind} is {spec.num_bytes} bytes, over the "
                         f"limit of {max_bytes} (--structured-outputs-max-bytes)")
    if spec.json is not None and _json_depth(spec.json) > MAX_SCHEMA_DEPTH:
        raise ValueError(TOO_DEEP)
    if eos_token_id is None and not sampling.stop_token_ids:  # (ignore_eos: SamplingParams)
        raise ValueError("structured_outputs needs a token to stop on: the model declares no "
                         "EOS token and stop_token_ids is empty; give stop_token_ids")


def _json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON `text`, brackets inside strings
    aside (the text is not parsed: a schema that is not JSON is xgrammar's to refuse)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


# ---------------------------------------------------------------------------------------------
# compiling


def make_compiler(tokenizer, vocab_size: int, cache_bytes: int):
    """An `xgrammar.GrammarCompiler` for `tokenizer` over `vocab_size` token ids (the model's,
    at least the tokenizer's), one compile thread, its cache of compiled grammars bounded by
    `cache_bytes` (least recently used out: `--structured-outputs-cache-bytes`)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_bytes)


def compile_constraint(spec: StructuredOutputsParams, compiler):
    """The xgrammar `CompiledGrammar` of `spec`, from `compiler` (whose cache makes a repeated
    constraint free). ValueError naming the field when it does not compile."""
    try:
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else '{"type": "object"}'
            return compiler.compile_json_schema(
                schema, any_whitespace=not spec.disable_any_whitespace)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex("|".join(_regex_literal(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar: the input is bad
        raise ValueError(f"structured_outputs.{spec.kind} does not compile: "
                         f"{_xgrammar_message(e)}") from None


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (xgrammar's regex dialect: ECMAScript)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's error without its C++ log prefix ("[10:00:00] /project/cpp/x.cc:12: ")."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")


# ---------------------------------------------------------------------------------------------
# compile threads and their timeout


def compile_threads(num_threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """Threads for compiles, at nice 10 (Linux schedules threads apart): on a machine whose
    cores the step loop or the event loop already fills, a compile takes what they leave
    rather than an equal share."""
    return concurrent.futures.ThreadPoolExecutor(num_threads, name,
                                                 initializer=_lower_thread_priority)


def _lower_thread_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # where the OS does not allow it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class CompileTimer:
    """The CPU seconds one compile has taken on its thread: `start()` on that thread as the
    compile begins (after any wait for the thread and the compiler's first load), `seconds()`
    from any thread."""

    def __init__(self) -> None:
        self._clock: int | None = None
        self._start = 0.0

    def start(self) -> None:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        self._start = time.clock_gettime(clock)
        self._clock = clock

    @property
    def started(self) -> bool:
        return self._clock is not None

    def seconds(self) -> float:
        """CPU seconds since `start` (0 before it; once the compile ended, the thread's next
        work counts on: ask only while it runs)."""
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock) - self._start
        except OSError:  # the thread is gone
            return 0.0


def timeout_error(spec: StructuredOutputsParams, timeout: float) -> str:
    """The error of a compile that ran past `--structured-outputs-compile-timeout`."""
    return (f"structured_outputs.{spec.kind} did not compile within {timeout:g} s of CPU time "
            "(--structured-outputs-compile-timeout)")
