"""Incremental detokenization: token ids in, new text out, one token at a time.

The fast path is `tokenizers`' `DecodeStream`, primed with the prompt ids so the first
generated token decodes in context (a leading space, a byte sequence continued from the
prompt). It returns None while a multi-byte character is still incomplete. When the stream
reports an error (vLLM's "Invalid prefix" case) it is rebuilt from the ids seen so far.

A tokenizer without a Rust backend falls back to the classic prefix/read offset scheme
(decode a small window, emit what grew beyond the already-read part).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# How many prompt tokens prime the decoder; enough context for any byte-level merge.
_PRIME_TOKENS = 8


class IncrementalDetokenizer:
    """Turns the generated token ids of one completion into text, token by token."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # prompt context followed by every generated id; used for resets and the slow path
        self._ids: list[int] = list(prompt_token_ids[-_PRIME_TOKENS:])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = self._new_stream() if self._backend is not None else None
        # slow path offsets into self._ids (see _slow_step)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _new_stream(self):
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(self._ids), skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Feed one generated token; return the text it completes ('' if none yet)."""
        token_id = int(token_id)
        if self._stream is None:
            self._ids.append(token_id)
            return self._slow_step()
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as e:  # the stream's state went bad; rebuild it from the ids
            logger.debug("DecodeStream reset after %r", e)
            piece = self._reset_and_decode(token_id)
        self._ids.append(token_id)
        return piece or ""

    def _reset_and_decode(self, token_id: int) -> str:
        before = self._decode(self._ids)
        after = self._decode(self._ids + [token_id])
        self._stream = self._new_stream()
        self._stream.step(self._backend, token_id)
        if after.endswith("\ufffd"):
            return ""
        return after[len(before):] if after.startswith(before) else after

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _slow_step(self) -> str:
        # ids[prefix_offset:read_offset] were decoded before; emit what the new id adds
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


def decode_token(tokenizer, token_id: int) -> str:
    """One token on its own as text (for log-probability entries); special tokens kept."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)
