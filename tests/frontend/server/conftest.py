"""Fixtures for the HTTP server's unit tests: the tiny models' tokenizer (with a chat
template), taken from the session's `tiny_llama` folder so it is built once per session."""

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)
