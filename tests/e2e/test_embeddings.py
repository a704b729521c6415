"""Embeddings end to end (docs/embeddings.md): `LLM.embed` and `POST /v1/embeddings` on a
random-weight Qwen3 embedding model laid out as Qwen3-Embedding is (no lm_head, bare tensor
names, a sentence-transformers pooling config), through one real engine core with chunked
prefill (a 32-token step budget; the prompts are longer), against transformers' pooled hidden
states in float32 (MEAN, LAST and CLS pooling, Matryoshka truncation); the `openai` client
(float and base64) and LangChain's OpenAIEmbeddings against `tidal serve --engine` on it."""

from __future__ import annotations

import base64
import functools
import json
import os

import numpy as np
import pytest
import torch

from tidal.frontend import LLM
from tidal.ipc.pooling import PoolingParams

from live_server import ENGINE_FLAGS, LiveServer, Proc
from tiny_models import make_tiny_embedding_model

pytestmark = pytest.mark.slow

TOLERANCE = 2e-5
"""Largest absolute difference from transformers per number of a unit vector, in float32:
the same float32 ops summed in other orders (measured: at most 2e-7 on these prompts)."""

STEP_TOKENS = 32  # max_num_batched_tokens: every prompt below but one is chunked
PROMPTS = [
    "def add(a, b):\n    return a + b\n" * 4,
    "class Stack:\n    def __init__(self):\n        self.items = []\n" * 3,
    "import os",
    "for i in range(10):\n    print(i * i)\n" * 5,
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The model; its config.json lists Matryoshka dimensions [16, 32, 64]."""
    path = make_tiny_embedding_model(str(tmp_path_factory.mktemp("embed")))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["matryoshka_dimensions"] = [16, 32, 64]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    """prompt (text or ids) -> (token ids, transformers' final hidden states [T, H])."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.Qwen3Model.from_pretrained(folder, dtype=torch.float32).eval()

    @functools.cache
    def run_ids(ids: tuple[int, ...]):
        with torch.no_grad():
            return list(ids), model(torch.tensor([ids])).last_hidden_state[0]

    def run(prompt):
        return run_ids(tuple(tokenizer(prompt)["input_ids"] if isinstance(prompt, str)
                             else prompt))

    return run


def unit(vector: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(vector, dim=-1).numpy()


@pytest.fixture(scope="module")
def engine_address(folder, tmp_path_factory):
    """One engine core for the module (runner auto: modules.json names a sentence-transformers
    Pooling module; MEAN by --pooler-config over its lasttoken), which LLM and tidal serve
    attach to."""
    address = f"ipc://{tmp_path_factory.mktemp('core')}/engine.sock"
    core = Proc(["core", folder, "--pooler-config", '{"pooling_type": "MEAN"}',
                 "--served-model-name", "tiny-embed", *ENGINE_FLAGS,
                 "--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", "4",
                 "--dtype", "float32", "--max-model-len", "128", "--listen", address])
    yield address
    assert core.stop() == 0, core.output()[-3000:]


@pytest.fixture(scope="module")
def llm(engine_address):
    with LLM(engine=engine_address, startup_timeout=300) as frontend:
        yield frontend


def test_llm_embed_equals_transformers_in_a_chunked_batch(llm, reference):
    for params, pool, prompts in ((None, lambda h: h.mean(0), PROMPTS),
                                  (PoolingParams("LAST"), lambda h: h[-1], PROMPTS),
                                  (PoolingParams("CLS"), lambda h: h[0], PROMPTS[:2])):
        outs = llm.embed(prompts, params, use_tqdm=False)
        assert [o.prompt for o in outs] == prompts
        assert max(len(o.prompt_token_ids) for o in outs) > 2 * STEP_TOKENS
        for out in outs:
            ids, hidden = reference(out.prompt)
            assert out.prompt_token_ids == ids and out.finish_reason == "stop"
            assert out.outputs.hidden_size == 64
            np.testing.assert_allclose(np.array(out.outputs.embedding, dtype=np.float32),
                                       unit(pool(hidden)), rtol=0, atol=TOLERANCE)


def test_llm_embed_matryoshka_dimensions_truncate_then_normalise(llm, reference):
    ids, hidden = reference(PROMPTS[1])
    out, = llm.embed([ids], PoolingParams("LAST", dimensions=16), use_tqdm=False)
    np.testing.assert_allclose(out.outputs.embedding, unit(hidden[-1, :16]), atol=TOLERANCE)
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\]"):
        llm.embed(["x"], PoolingParams(dimensions=8), use_tqdm=False)


def test_an_embedding_engine_does_not_generate(llm):
    with pytest.raises(ValueError, match="runs an embedding model"):
        llm.generate(["def"], use_tqdm=False)


@pytest.fixture(scope="module")
def server(engine_address, llm):
    srv = LiveServer(["--engine", engine_address])
    try:
        yield srv.start(timeout=300)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_openai_client_float_and_base64(client, reference):
    expected = [unit(reference(p)[1].mean(0)) for p in PROMPTS]  # --pooler-config MEAN
    # none given: the client asks for base64 and decodes it itself; given, it hands back
    # what the server sent (base64: float32 little-endian bytes)
    for encoding, prompts in ((None, PROMPTS), ("float", PROMPTS[:2]), ("base64", PROMPTS[:2])):
        extra = {} if encoding is None else {"encoding_format": encoding}
        res = client.embeddings.create(model="tiny-embed", input=prompts, **extra)
        assert [d.index for d in res.data] == list(range(len(prompts)))
        for data, want in zip(res.data, expected):
            got = data.embedding
            if encoding == "base64":
                got = np.frombuffer(base64.b64decode(got), dtype="<f4")
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        assert res.usage.prompt_tokens == sum(len(reference(p)[0]) for p in prompts)
        assert res.usage.total_tokens == res.usage.prompt_tokens


def test_token_id_inputs(client, reference):
    ids, hidden = reference(PROMPTS[0])
    one = client.embeddings.create(model="tiny-embed", input=ids)
    two = client.embeddings.create(model="tiny-embed", input=[ids, ids[:5]])
    np.testing.assert_allclose(one.data[0].embedding, unit(hidden.mean(0)), atol=TOLERANCE)
    np.testing.assert_allclose(two.data[0].embedding, one.data[0].embedding, atol=1e-6)
    assert one.usage.prompt_tokens == len(ids) and two.usage.prompt_tokens == len(ids) + 5


def test_the_400s_vllm_gives(server):
    with server.client(timeout=30) as http:
        full = http.post("/v1/embeddings", json={"input": [1] * 128})  # fills the context
        assert full.status_code == 200, full.text
        cases = {
            "input": {"input": [1] * 129},
            "dimensions": {"input": "hi", "dimensions": 8},  # not one of [16, 32, 64]
            "model": {"model": "tiny-embed", "prompt": "hi"},  # to /v1/completions
        }
        for param, body in cases.items():
            route = "/v1/completions" if "prompt" in body else "/v1/embeddings"
            r = http.post(route, json=body)
            assert r.status_code == 400, (param, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == 400, error
        assert "matryoshka" in http.post("/v1/embeddings", json=cases["dimensions"]).text


def test_langchain_openai_embeddings(server, client):
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: else it tokenizes with tiktoken, which downloads
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="tiny-embed", base_url=server.base_url + "/v1", api_key="none",
        check_embedding_ctx_length=False)
    got = embeddings.embed_documents(PROMPTS[:2])
    want = client.embeddings.create(model="tiny-embed", input=PROMPTS[:2])
    np.testing.assert_allclose(got, [d.embedding for d in want.data], atol=1e-6)
    np.testing.assert_allclose(embeddings.embed_query(PROMPTS[2]),
                               client.embeddings.create(model="tiny-embed",
                                                        input=PROMPTS[2]).data[0].embedding,
                               atol=1e-6)
