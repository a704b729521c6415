"""Structured output in the frontends: the OpenAI / vLLM request fields that ask for it, and
the compile check that turns a constraint xgrammar cannot compile into a ValueError naming
the field (HTTP 400) before the request is sent.

The frontend compiles because it has the tokenizer and answers the client; the workers
compile the same constraint again for their masks (`workers/structured_output.py` says why),
each from xgrammar's compiler cache after the first time. xgrammar (and with it torch) is
imported on the first constrained request only.

HTTP fields, each mapped onto one `StructuredOutputsParams` (more than one is a 400):

    response_format {"type": "json_object"}                     json_object
    response_format {"type": "json_schema", "json_schema": {"schema": S, ...}}   json = S
    guided_json S | guided_regex R | guided_choice [..] | guided_grammar G   (vLLM, older)
    structured_outputs {"json": S} | {"regex": R} | {"choice": [..]} | ...   (vLLM, newer)
    structured_outputs {"disable_any_whitespace": false}   alone: beside any of the above,
                                                            free whitespace in its JSON
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from ..ipc.frontend_messages import EngineInfo
from ..ipc.grammar import (
    CompileTimer, check_structured_outputs, compile_threads, make_compiler, timeout_error,
)
from ..ipc.messages import SamplingParams, StructuredOutputsParams

POLL_S = 0.05
"""How often a check looks at its compile's CPU time."""

COMPILE_THREADS = 2
"""Compiles a frontend runs at once. A compile past the timeout cannot be stopped and holds
its thread until it ends, so two keep one hostile schema from queueing every other one behind
it while bounding what such schemas take from the machine."""

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class GrammarChecker:
    """Checks constraints as the engine core will take them (size, a token to stop on), then
    compiles them against the served tokenizer, within the core's compile timeout. xgrammar
    caches each compiled grammar (bounded by the core's cache size), so a repeated schema
    costs nothing the second time."""

    def __init__(self, tokenizer, info: EngineInfo, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        self.max_bytes = info.structured_outputs_max_bytes
        self.compile_timeout = info.structured_outputs_compile_timeout
        self.cache_bytes = info.structured_outputs_cache_bytes
        self.eos_token_id = eos_token_id
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = compile_threads(COMPILE_THREADS, "grammar-check")

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field ("structured_outputs.json does not compile: ...") when
        the request's constraint is too large, has no token to stop on, does not compile, or
        takes longer than the compile timeout; nothing for a request without one. Blocks
        (call it off the event loop)."""
        spec = params.structured_outputs
        if spec is None:
            return
        check_structured_outputs(params, self.eos_token_id, self.max_bytes)
        compiler = self._get_compiler()  # its first load does not count against the timeout
        timer = CompileTimer()

        def compile_it():
            timer.start()
            return spec.compile_with(compiler)

        future = self._pool.submit(compile_it)
        queued_since = time.monotonic()
        while True:  # the timeout counts the thread's CPU time, as the workers' does
            try:
                future.result(POLL_S)
                return
            except concurrent.futures.TimeoutError:
                pass
            if not timer.started and time.monotonic() - queued_since > self.compile_timeout:
                if future.cancel():
                    raise ValueError(f"structured_outputs.{spec.kind} could not start compiling "
                                     f"within {self.compile_timeout:g} s: every grammar-compile "
                                     "thread is busy with earlier constraints; retry later")
            elif timer.seconds() > self.compile_timeout:
                raise ValueError(timeout_error(spec, self.compile_timeout))

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                vocab_size = max(self.vocab_size, len(self.tokenizer))
                self._compiler = make_compiler(self.tokenizer, vocab_size, self.cache_bytes)
            return self._compiler


def from_request_fields(fields: dict[str, Any]) -> tuple[StructuredOutputsParams | None,
                                                          str | None]:
    """(the constraint, the request field that gave it) from an OpenAI / vLLM request's
    `response_format`, `guided_*` and `structured_outputs` fields (None values are unset).
    ValueError naming the field for a shape that is not understood or for two constraints."""
    found = [(name, value) for name, value in fields.items() if value is not None
             and not (name == "response_format" and value.get("type", "text") == "text")
             and not (name == "structured_outputs" and _whitespace_only(value))]
    if not found:
        return None, None
    if len(found) > 1:
        raise ValueError(f"{found[1][0]} cannot be combined with {found[0][0]}: give one "
                         "structured output constraint")
    name, value = found[0]
    try:
        if name == "response_format":
            return _from_response_format(value), name
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("must be an object")
            return StructuredOutputsParams(**value), name
        return StructuredOutputsParams(**{_GUIDED[name]: value}), name
    except (TypeError, ValueError) as e:
        message = str(e)
        if message.startswith("structured_outputs"):
            message = message.split(" ", 1)[1]
        raise ValueError(f"{name} {message}") from None


def _whitespace_only(value) -> bool:
    """`structured_outputs: {"disable_any_whitespace": ...}` alone is no constraint: it says
    how another field's JSON is written (server/serving.py `compact_json`)."""
    return isinstance(value, dict) and value.keys() == {"disable_any_whitespace"}


def _from_response_format(value: dict) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError('of type "json_schema" needs a "json_schema" object')
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})
    raise ValueError(f'type must be "text", "json_object" or "json_schema", got {kind!r}')
