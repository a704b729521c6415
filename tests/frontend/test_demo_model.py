"""The bundled demo model: a Hugging Face folder that transformers loads offline, within the
size limits, with a chat template and deterministic, peaked, code-like greedy output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.frontend import demo
from tidal.frontend.demo import DEMO_MODEL_DIR, demo_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_FOLDER_BYTES = 20 * 1024 * 1024
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md")
# No trailing newline: the byte-level pre-tokenizer merges a newline with the next line's
# indentation ("\n        "), so a prompt ending in a bare "\n" splits a token the model
# almost never saw on its own.
CODE_PROMPT = "class Stack:\n    def __init__(self):"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(demo_model_path(), local_files_only=True)
    return m.eval()


def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_path_helper_points_inside_the_package():
    assert demo_model_path() == DEMO_MODEL_DIR
    assert Path(DEMO_MODEL_DIR).is_absolute()
    assert Path(DEMO_MODEL_DIR).parent == Path(demo.__file__).resolve().parent


def test_path_helper_names_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        demo.demo_model_path()


def test_folder_holds_the_hf_files_within_the_size_limit():
    folder = Path(demo_model_path())
    for name in HF_FILES:
        assert (folder / name).is_file(), name
    total = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert total < MAX_FOLDER_BYTES
    for p in folder.iterdir():
        assert p.stat().st_mode & 0o044 == 0o044, f"{p.name} must be world-readable"


def test_config_is_a_small_gqa_llama_in_float32():
    config = json.loads((Path(demo_model_path()) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"


def test_model_loads_offline_with_a_few_million_params(model):
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 5_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.get_input_embeddings().weight.data_ptr() == model.lm_head.weight.data_ptr()


def test_tokenizer_is_fast_and_round_trips_code(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id
    source = "class A:\n    def f(self, x):\n\treturn {'k': x ** 2}  # ünïcode\n"
    ids = tokenizer(source).input_ids
    assert tokenizer.eos_token_id not in ids  # no BOS/EOS added on encode
    assert tokenizer.decode(ids) == source
    assert len(tokenizer) <= 8192


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now subtract."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>\nYou write Python.\n<|user|>\nAdd two numbers.\n"
        "<|assistant|>\ndef add(a, b):\n    return a + b<|endoftext|>\n"
        "<|user|>\nNow subtract.\n<|assistant|>\n"
    )
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    markers = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert [i for i in ids if i in markers] == markers  # each marker is one special token


def test_greedy_output_is_deterministic_and_looks_like_python(model, tokenizer):
    first = greedy(model, tokenizer, CODE_PROMPT)
    second = greedy(model, tokenizer, CODE_PROMPT)
    assert first == second
    completion = tokenizer.decode(first)
    assert completion.startswith("\n        ")  # the method body is indented
    assert "self" in completion


def test_next_token_distribution_is_peaked(model, tokenizer):
    """Trained logits are far from uniform: the indentation after a def line is confident."""
    ids = tokenizer(CODE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0, -1].softmax(-1)
    assert probs.max().item() > 0.5


def test_readme_states_corpus_licence_and_loss_curve():
    readme = (Path(demo_model_path()) / "README.md").read_text()
    assert "PSF" in readme and "standard library" in readme
    assert "| step |" in readme and "val loss" in readme
    assert (Path(demo_model_path()) / "corpus_files.txt").is_file()


def _copy_source_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".hypothesis", ".venv", "tests")
    shutil.copytree(REPO_ROOT, dst, ignore=ignore)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wheel_contains_the_model_and_works_in_a_fresh_venv(tmp_path):
    """Build the wheel from a copy of the tree (so no build/ lands in the repo), install it
    with --no-deps into a new venv that sees the system packages, and find the model's files
    there through `demo_model_path()` (that the model loads and generates: the tests above
    and test_demo_model_e2e)."""
    src, wheels, venv = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv"
    _copy_source_tree(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-w", str(wheels)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("tidal-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for name in HF_FILES:
        assert f"tidal/frontend/demo_model/{name}" in names
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    subprocess.run([vpy, "-m", "pip", "--disable-pip-version-check", "-q", "install",
                    "--no-deps", "--ignore-installed", str(wheel)], check=True, cwd=tmp_path)
    probe = "import tidal.frontend.demo as d; print(d.demo_model_path())"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="")
    out = subprocess.run([vpy, "-c", probe], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    installed = Path(out.stdout.strip().splitlines()[-1])
    assert installed.is_relative_to(venv)
    assert (installed / "model.safetensors").stat().st_size > 1_000_000
    assert all((installed / name).is_file() for name in HF_FILES)
