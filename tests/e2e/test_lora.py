"""LoRA adapters end to end (docs/lora.md): tiny random PEFT adapters (different ranks and
target modules) on the tiny Llama, one engine with TP=2, async scheduling, a KV cache small
enough to preempt and fewer slots than adapters; every request's greedy tokens equal
transformers + PEFT with its adapter applied. Then the HTTP surface: adapters as model names,
load / unload at run time while requests run. The scheduler's slot rule and the prefix cache's
separation: tests/engine_core/test_lora_scheduling.py."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from live_server import ENGINE_FLAGS, Proc, free_port
from tidal.ipc.messages import LoRARequest, SamplingParams

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, target modules, lora_alpha, seed)
    "all8": (8, ALL, 16, 1),
    "qv4": (4, ["q_proj", "v_proj"], 8, 2),
    "mlp16": (16, ["o_proj", "up_proj", "down_proj", "gate_proj"], 8, 3),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [20, 21, 22, 23] * 2, [30, 31, 32, 33, 34]]
MAX_TOKENS = 10


def make_adapter(base: str, path: str, rank: int, targets: list[str], alpha: int,
                 seed: int) -> str:
    """A PEFT adapter with random A and B (init_lora_weights=False), saved as safetensors."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            lora_dropout=0.0, init_lora_weights=False))
    peft.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_llama, str(root / name), *spec)
            for name, spec in ADAPTERS.items()}


def peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(tiny_llama, adapters) -> dict[tuple[str | None, int], list[int]]:
    """(adapter name or None, prompt index) -> transformers + PEFT greedy tokens."""
    return {(name, i): peft_greedy(tiny_llama, adapters[name] if name else None, prompt)
            for name in [None, *adapters] for i, prompt in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from tidal.frontend import LLM

    # 12 KV blocks (11 usable) for 12 requests of 2-3 blocks: preemption; 2 slots for 3
    # adapters: the scheduler swaps adapters in and out
    with LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32",
             tensor_parallel_size=2, async_scheduling=True, num_gpu_blocks_override=12,
             max_model_len=64) as llm:
        yield llm


def test_a_batch_mixing_three_adapters_and_the_base_model_equals_peft(llm, adapters,
                                                                       references):
    """Three adapters (ranks 8, 4, 16; all projections, q/v only, o + MLP) and the base model
    in one generate() call, each prompt under each: TP=2, async scheduling, 2 slots for 3
    adapters, preemption; the same prompt under different adapters shares no KV blocks."""
    names = [None, *adapters]
    loras = {name: LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(adapters)}
    jobs = [(name, i) for name in names for i in range(len(PROMPTS))]
    before = llm.get_stats().num_preemptions if hasattr(llm, "get_stats") else 0
    outs = llm.generate([PROMPTS[i] for _, i in jobs],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False,
                        lora_request=[loras[name] if name else None for name, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == references[(name, i)], (name, i)
    assert references[(None, 0)] != references[("all8", 0)]  # the adapters change the output
    if hasattr(llm, "get_stats"):
        assert llm.get_stats().num_preemptions > before


def test_bad_lora_requests_are_value_errors(llm, tmp_path):
    with pytest.raises(ValueError, match="lora_path .*not a PEFT adapter folder"):
        llm.generate([[5, 6, 7]], lora_request=LoRARequest("x", 9, str(tmp_path)),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be in"):
        LoRARequest("x", 0, str(tmp_path))


def test_an_adapter_above_max_lora_rank_is_refused(llm, tiny_llama, tmp_path):
    path = make_adapter(tiny_llama, str(tmp_path / "r32"), 32, ["q_proj"], 16, 4)
    with pytest.raises(ValueError, match="rank 32 exceeds --max-lora-rank 16"):
        llm.generate([[5, 6, 7]], lora_request=LoRARequest("r32", 10, path), use_tqdm=False)


def test_an_adapter_whose_weights_cannot_be_read_fails_its_requests_alone(llm, tmp_path):
    """The config passes the frontend's check, the weights do not pass the workers': the
    request fails with an error naming lora_request, the engine and its workers go on."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 64)},
              str(tmp_path / "adapter_model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="lora_request: .*embed_tokens.* not on a supported"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("bad", 11, str(tmp_path)),
                     use_tqdm=False)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


# -- HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    port = free_port()
    proc = Proc(["serve", tiny_llama, "--port", str(port), "--dtype", "float32",
                 "--enable-lora", "--max-loras", "2", "--lora-modules",
                 f"all8={adapters['all8']}", json.dumps({"name": "qv4",
                                                         "path": adapters["qv4"]}),
                 *ENGINE_FLAGS], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
                                      "TIDAL_API_KEY": "secret"})
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, headers={"Authorization": "Bearer secret"},
                          timeout=120)
    try:
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.alive(), proc.output()
            threading.Event().wait(0.2)
        else:
            raise AssertionError(proc.output())
        yield client
    finally:
        client.close()
        proc.stop()


def _complete(client: httpx.Client, model: str, prompt: list[int],
              max_tokens: int = MAX_TOKENS) -> list[int]:
    r = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _num_running(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("tidal:num_requests_running"):
            return float(line.split()[-1])
    return 0.0


def test_models_lists_the_base_model_and_each_adapter(server, adapters):
    cards = server.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards][1:] == ["all8", "qv4"]
    assert cards[1]["root"] == adapters["all8"] and cards[1]["parent"] == cards[0]["id"]


def test_a_completion_with_an_adapters_name_runs_with_it(server, references):
    base = server.get("/v1/models").json()["data"][0]["id"]
    for model, name in (("all8", "all8"), ("qv4", "qv4"), (base, None)):
        assert _complete(server, model, PROMPTS[0]) == references[(name, 0)], model


def test_load_and_unload_at_run_time_while_requests_run(server, adapters, references):
    """mlp16 is loaded while a batch on all8 runs, all8 is unloaded while its requests run:
    they finish with it; new ones get 404; mlp16 then serves."""
    results, errors = [], []

    def run_all8():
        try:  # long enough to be running when the adapter is unloaded
            results.append(_complete(server, "all8", PROMPTS[1], max_tokens=60)[:MAX_TOKENS])
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run_all8) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(600):  # all four in the engine's batch
        if _num_running(server) >= 4 or not any(t.is_alive() for t in threads):
            break
        threading.Event().wait(0.05)
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "mlp16",
                                                   "lora_path": adapters["mlp16"]})
    assert r.status_code == 200, r.text
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "all8"})
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    assert not errors and results == [references[("all8", 1)]] * 4
    r = server.post("/v1/completions", json={"model": "all8", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert _complete(server, "mlp16", PROMPTS[2]) == references[("mlp16", 2)]
    assert "mlp16" in [c["id"] for c in server.get("/v1/models").json()["data"]]


def test_bad_adapter_loads_are_4xx(server, tmp_path):
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                   "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "not a PEFT adapter folder" in r.json()["error"]["message"]
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "qv4", "lora_path": "/x"})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404
    r = httpx.post(str(server.base_url) + "/v1/load_lora_adapter",
                   json={"lora_name": "y", "lora_path": "/y"})
    assert r.status_code == 401
