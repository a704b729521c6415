"""Issue 16, item 1: the engine core turns a GGUF model argument into a folder through a child
process (`engine_core/model_files.py`, which runs `python -m tidal.workers.gguf`), and
everything before that (the config, the frontends' tokenizer path) knows a GGUF file is not a
folder."""

import os
import subprocess
import sys

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, is_gguf, resolve_max_model_len
from tidal.engine_core.model_files import _folder_from, model_folder


def test_is_gguf_by_suffix():
    assert is_gguf("m.gguf") and is_gguf("/a/b/SmolLM2.Q4_1.GGUF")
    assert not is_gguf("/a/model") and not is_gguf("model.gguf.d/x")


def test_tokenizer_path_of_a_gguf_is_left_to_the_engine_core():
    assert ModelConfig("m.gguf").tokenizer_path is None  # EngineInfo.tokenizer names it
    assert ModelConfig("m.gguf", tokenizer="/tok").tokenizer_path == "/tok"
    assert ModelConfig("/folder").tokenizer_path == "/folder"
    assert ModelConfig("m.gguf").name == "m.gguf"  # the served name is the file given


def test_a_folder_is_its_own_model_folder():
    assert model_folder("/some/folder", lambda: pytest.fail("not polled")) == "/some/folder"


def test_the_converters_answer_is_read():
    assert _folder_from('log line\n{"folder": "/c/x"}\n', "m.gguf", 0) == "/c/x"
    with pytest.raises(ValueError, match="^architecture 'phi3' is not supported$"):
        _folder_from('{"error": "architecture \'phi3\' is not supported"}\n', "m.gguf", 2)
    with pytest.raises(ValueError, match=r"'m.gguf': converting the GGUF file failed \(exit "
                                         r"status -9; its log is above\)"):
        _folder_from("", "m.gguf", -9)
    with pytest.raises(ValueError, match="exit status 1"):
        _folder_from("Traceback (most recent call last):\n", "m.gguf", 1)


def test_a_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        model_folder(str(tmp_path / "missing.gguf"))


def test_max_model_len_is_read_from_the_converted_folder(tiny_llama):
    config = EngineConfig(ModelConfig("/nowhere/m.gguf", max_model_len=100))
    assert resolve_max_model_len(config, tiny_llama) == 100
    with pytest.raises(ValueError, match=f"from {tiny_llama}/config.json"):
        resolve_max_model_len(EngineConfig(ModelConfig("m.gguf", max_model_len=10**6)),
                              tiny_llama)


@pytest.mark.timeout(60)
def test_a_stop_while_converting_ends_the_converter(tiny_gguf_factory, tmp_path, monkeypatch):
    """The engine core stopped during start-up: the converter gets SIGTERM, leaves no
    partial folder, and model_folder raises InterruptedError. A cache of its own: with the
    session's, an earlier test's conversion would answer at once (a cache hit) and leave
    nothing to stop; a real conversion imports torch and transformers, seconds longer than
    the first 0.5 s poll that asks to stop."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    path = tiny_gguf_factory("Q8_0")
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr("tidal.engine_core.model_files.subprocess.Popen", Recorded)
    with pytest.raises(InterruptedError):
        model_folder(path, lambda: True)
    assert len(started) == 1 and started[0].returncode is not None  # waited for
    versions = tmp_path / "gguf-v1"
    assert not versions.is_dir() or list(versions.iterdir()) == []


def test_the_converter_runs_without_torch_until_it_converts(tmp_path):
    """The cached path (and a bad file) answer without importing torch or transformers."""
    code = ("import sys; from tidal.workers import gguf; "
            "gguf.main([sys.argv[1], '--cache-dir', sys.argv[2]]); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.gguf"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith('{"error": ') and "no such GGUF file" in lines[0]
    assert lines[1] == "False False"
