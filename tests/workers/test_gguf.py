"""Issue 16, item 1: a GGUF file is de-quantized once, through transformers, into a cached
Hugging Face folder (`workers/gguf.py`). Issue 39: a converter that dies mid-way leaves
nothing taken for that folder, and the next start removes what it left.

Offline: the files are the tiny Llama written as GGUF by `tiny_models.make_tiny_gguf` (the
`gguf` package's writer, llama.cpp's layout, q/k rows permuted). A float32 file must come back
as the very tensors it was written from; a quantized one as exactly the tensors transformers'
own GGUF loader de-quantizes.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from process_tree import wait_for
from tidal.frontend.engine_client import load_tokenizer, read_eos_token_ids
from tidal.workers import gguf as gguf_module
from tidal.workers.gguf import MARKER, WRITER_LOCK, file_sha256, gguf_folder
from tidal.workers.loader import read_config
from tidal.workers.models.llama import parse_model_args

TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b"
SAME_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                    "tie_word_embeddings")


def _weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def test_float32_file_comes_back_as_the_folder_it_was_written_from(tiny_llama, tiny_gguf_factory,
                                                                   tmp_path):
    path = tiny_gguf_factory("F32")
    folder = gguf_folder(path, str(tmp_path))
    ours, original = _weights(folder), _weights(tiny_llama)
    assert ours.keys() == original.keys()
    for name, tensor in original.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name  # q/k rows back in HF order
    config, original_config = read_config(folder), read_config(tiny_llama)
    assert {k: config[k] for k in SAME_CONFIG_KEYS} == \
        {k: original_config[k] for k in SAME_CONFIG_KEYS}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config
    args, original_args = parse_model_args(config), parse_model_args(original_config)
    assert args.rope_theta == original_args.rope_theta
    assert args.rms_norm_eps == pytest.approx(original_args.rms_norm_eps, rel=1e-6)  # float32

    # the frontend's tokenizer loader reads the converted tokenizer, chat template included
    tokenizer, original_tokenizer = load_tokenizer(folder), load_tokenizer(tiny_llama)
    assert tokenizer.encode(TEXT) == original_tokenizer.encode(TEXT)
    messages = [{"role": "user", "content": "Hello world"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        == original_tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    assert read_eos_token_ids(folder, tokenizer) == read_eos_token_ids(tiny_llama,
                                                                       original_tokenizer)
    with open(os.path.join(folder, MARKER)) as f:
        marker = json.load(f)
    assert marker["sha256"] == file_sha256(path) and marker["source"] == os.path.abspath(path)


@pytest.mark.parametrize("qtype, max_error", [("Q8_0", 0.01), ("Q4_1", 0.1)])
def test_quantized_file_gives_transformers_dequantized_weights(tiny_llama, tiny_gguf_factory,
                                                               tmp_path, qtype, max_error):
    import transformers

    path = tiny_gguf_factory(qtype)
    folder = gguf_folder(path, str(tmp_path))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        **gguf_module._dequantize_all()).state_dict()
    ours, original = _weights(folder), _weights(tiny_llama)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
        scale = original[name].abs().max()  # and near the float32 weights it was made from
        assert (tensor - original[name]).abs().max() <= max_error * scale, name


def test_a_second_use_finds_the_cache_by_content(tiny_gguf_factory, tmp_path, monkeypatch):
    path = tiny_gguf_factory("F32")
    root = str(tmp_path / "cache")
    folder = gguf_folder(path, root)
    assert os.path.basename(folder).startswith("tiny-F32-")

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "convert", no_conversion)
    assert gguf_folder(path, root) == folder
    copy = tmp_path / "elsewhere" / os.path.basename(path)
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert gguf_folder(str(copy), root) == folder  # same name and bytes: same folder
    with open(copy, "ab") as f:
        f.write(b"\0" * 32)  # other bytes: a new conversion
    with pytest.raises(AssertionError, match="converted again"):
        gguf_folder(str(copy), root)
    assert os.listdir(os.path.dirname(folder)) == [os.path.basename(folder)]  # no partials


@pytest.mark.parametrize("arch, message", [
    ("gpt2", "architecture 'gpt2' is not supported; tidal runs llama, mistral, qwen2, qwen3"),
    ("tidalnet", "tidalnet"),  # one transformers cannot read either: its message names it
])
def test_other_architectures_are_refused_by_name(tiny_gguf_factory, tmp_path, arch, message):
    path = tiny_gguf_factory("F32", arch)
    with pytest.raises(ValueError, match=message) as info:
        gguf_folder(path, str(tmp_path))
    assert path in str(info.value)
    assert os.listdir(tmp_path / "gguf-v1") == []  # the partial folder is gone


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        gguf_folder(str(tmp_path / "nothing.gguf"), str(tmp_path))


@pytest.mark.timeout(120)
def test_a_converter_that_dies_midway_leaves_nothing_taken_for_the_cache(tiny_gguf_factory,
                                                                         tmp_path):
    """A converter caught in mid-conversion (SIGSTOP, once its partial folder exists: it then
    imports torch for seconds): its folder is left alone while it lives, however another
    start runs; once SIGKILLed, its half-written folder is never used, and the next start
    removes it (and one an older tidal left, with no lock). Nothing else is kept but the
    converted folder."""
    path = tiny_gguf_factory("F32")
    versions = tmp_path / "gguf-v1"
    converter = subprocess.Popen(
        [sys.executable, "-m", "tidal.workers.gguf", path, "--cache-dir", str(tmp_path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (partial,) = wait_for(lambda: [p for p in versions.glob(".tiny-F32-partial-*")
                                       if (p / WRITER_LOCK).exists()],
                              timeout=60, what="the converter's partial folder")
        time.sleep(0.2)  # past taking its lock, in the imports
        os.kill(converter.pid, signal.SIGSTOP)

        folder = gguf_folder(path, str(tmp_path))  # converts: the partial is not the cache
        assert partial.is_dir()  # its writer lives
        assert os.path.isfile(os.path.join(folder, MARKER))
        assert WRITER_LOCK not in os.listdir(folder)

        os.kill(converter.pid, signal.SIGKILL)
        converter.wait(10)
        (partial / "model.safetensors").write_bytes(b"\0" * 100)  # as if killed while saving
        older = versions / ".tiny-F32-partial-12345-abcd_123"  # no lock: an older tidal's
        older.mkdir()
        (older / "config.json").write_text("{}")
        assert gguf_folder(path, str(tmp_path)) == folder
        assert os.listdir(versions) == [os.path.basename(folder)]
    finally:
        if converter.poll() is None:
            converter.kill()
            converter.wait(10)
