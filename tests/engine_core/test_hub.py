"""Issue 38 item 1: a model named by its Hugging Face Hub id is fetched once, before anything
starts, through huggingface_hub (`engine_core/hub.py`, `model_files.prepare_model`); here on
a Hub cache laid out on disk as huggingface_hub writes it, offline (HF_HUB_OFFLINE), so the
real code path runs without a network. The command-line path is in
tests/e2e/test_first_hour.py."""

import os

import huggingface_hub.constants
import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig
from tidal.engine_core.hub import hub_id, resolve_model
from tidal.engine_core.model_files import prepare_model

from hub_cache import lay_out_folder, lay_out_repo

COMMIT_V1 = "1" * 40


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama):
    cache = str(tmp_path_factory.mktemp("hf") / "hub")
    lay_out_folder(cache, "tidal-test/tiny-llama", tiny_llama)
    lay_out_folder(cache, "tidal-test/tiny-llama", tiny_llama, commit=COMMIT_V1, ref="v1")
    gguf = tmp_path_factory.mktemp("gguf") / "x.gguf"
    gguf.write_bytes(b"GGUF")
    lay_out_repo(cache, "tidal-test/tiny-GGUF", {"tiny-Q4_K_M.gguf": str(gguf),
                                                 "tiny-Q8_0.gguf": str(gguf)})
    return cache


def test_what_reads_as_a_hub_id():
    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert hub_id("org/M-GGUF:m-q4_k_m.gguf") == ("org/M-GGUF", "m-q4_k_m.gguf")
    assert hub_id("org/M-GGUF:Q4_K_M") == ("org/M-GGUF", "Q4_K_M")
    for path in ("/no/such/path", "./a/b", "~/a/b", "a/b/c", "model", "a b/c"):
        assert hub_id(path) is None, path


def test_a_path_that_does_not_exist_is_one_clear_error():
    with pytest.raises(ValueError, match=r"^model '/no/such/path': no such file or folder"):
        resolve_model("/no/such/path")


def test_a_hub_id_in_the_cache_is_its_snapshot_folder(hub, offline):
    folder = resolve_model("tidal-test/tiny-llama", download_dir=hub)
    assert folder.endswith(os.path.join("models--tidal-test--tiny-llama", "snapshots",
                                        "0123456789abcdef0123456789abcdef01234567"))
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert resolve_model("tidal-test/tiny-llama", "v1", hub).endswith(COMMIT_V1)


def test_a_gguf_repo_by_file_or_quantization_tag(hub, offline):
    q4 = resolve_model("tidal-test/tiny-GGUF:Q4_K_M", download_dir=hub)
    assert os.path.basename(q4) == "tiny-Q4_K_M.gguf" and os.path.isfile(q4)
    assert os.path.basename(resolve_model("tidal-test/tiny-GGUF:q8_0",
                                          download_dir=hub)) == "tiny-Q8_0.gguf"
    assert os.path.basename(resolve_model("tidal-test/tiny-GGUF:tiny-Q8_0.gguf",
                                          download_dir=hub)) == "tiny-Q8_0.gguf"
    with pytest.raises(ValueError, match="no file matching"):
        resolve_model("tidal-test/tiny-GGUF:IQ2_XS", download_dir=hub)


def test_offline_and_not_cached_says_it_was_read_as_a_hub_id(hub, offline):
    with pytest.raises(ValueError) as info:
        resolve_model("tidal-test/absent", download_dir=hub)
    message = str(info.value)
    assert "\n" not in message
    assert "read as a Hugging Face Hub id" in message and "HF_HUB_OFFLINE" in message
    assert "hf download tidal-test/absent --local-dir DIR" in message


def test_prepare_model_hands_on_the_folder_and_keeps_the_id_as_the_name(hub, offline):
    config = prepare_model(EngineConfig(ModelConfig("tidal-test/tiny-llama",
                                                    download_dir=hub)))
    assert os.path.isfile(os.path.join(config.model.model, "config.json"))
    assert config.model.name == "tidal-test/tiny-llama"
    assert config.model.tokenizer_path == config.model.model
    named = prepare_model(EngineConfig(ModelConfig("tidal-test/tiny-llama", download_dir=hub,
                                                   served_model_name=["a", "b"])))
    assert named.model.names == ["a", "b"]


def test_prepare_model_checks_what_config_json_allows(tiny_llama):
    assert prepare_model(EngineConfig(ModelConfig(tiny_llama))).model.model == tiny_llama
    with pytest.raises(ValueError, match=r"max_model_len \(100000\) exceeds"):
        prepare_model(EngineConfig(ModelConfig(tiny_llama, max_model_len=100000)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the "
                                         r"model's num_attention_heads \(4\)"):
        prepare_model(EngineConfig(ModelConfig(tiny_llama),
                                   parallel=ParallelConfig(tensor_parallel_size=3)))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(8\) exceeds"):
        prepare_model(EngineConfig(ModelConfig(tiny_llama),
                                   parallel=ParallelConfig(pipeline_parallel_size=8)))
    with pytest.raises(ValueError, match="is a file; expected a model folder or a .gguf"):
        prepare_model(EngineConfig(ModelConfig(os.path.join(tiny_llama, "config.json"))))
