"""Issue 38: what a newcomer trips over in the first hour, through real `tidal` processes.

- A model by its Hub id (offline, on a Hub cache laid out on disk), several served names and
  vLLM's underscore spellings of the flags (`--served_model_name a b`, `--max_model_len`).
- Start-up: 503 "Loading model" from /health (and a 503 that says so from every other route)
  until an engine core is attached; a deterministic start-up error is one line, printed once,
  exit non-zero, with no restart.
"""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from hub_cache import lay_out_folder
from live_server import ENGINE_FLAGS, LiveServer, Proc, free_port

pytestmark = pytest.mark.slow


def _tidal(*args: str, timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "tidal.frontend.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("args, message", [
    (["/no/such/path"], "model '/no/such/path': no such file or folder"),
    (["{tiny}", "-tp", "3"], "tensor_parallel_size (3) must divide the model's "
                             "num_attention_heads (4)"),
    (["{tiny}", "--max_model_len", "100000"], "max_model_len (100000) exceeds the model's "
                                              "context length (512)"),
])
def test_an_error_found_before_anything_starts_is_one_line(tiny_llama, args, message):
    result = _tidal("serve", *[a.format(tiny=tiny_llama) for a in args], "--port", "0")
    assert result.returncode == 2
    assert _lines(result.stderr) == [f"tidal serve: {message}"] or message in result.stderr
    assert len(_lines(result.stderr)) == 1, result.stderr
    assert result.stdout == ""


def test_an_unknown_architecture_is_printed_once_and_never_restarted(tiny_model_factory,
                                                                     tmp_path):
    folder = tmp_path / "foo"
    source = tiny_model_factory("llama")
    folder.mkdir()
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), folder / name)
    config = json.load(open(os.path.join(source, "config.json")))
    os.unlink(folder / "config.json")
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "architectures": ["FooForCausalLM"]}))
    result = _tidal("serve", str(folder), "--port", "0", *ENGINE_FLAGS)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert out.count("architecture FooForCausalLM is not supported") == 1, out
    assert "restart" not in out and "Traceback" not in out, out
    assert "could not start (its error is above); not starting it again" in out


def test_health_says_loading_until_an_engine_core_is_attached(tmp_path):
    """An HTTP server whose engine core is not there yet (here: none at the address) answers
    at once: 503 "Loading model" on /health, a 503 that says the model is loading elsewhere."""
    port = free_port()
    proc = Proc(["serve", "--engine", f"ipc://{tmp_path}/absent.sock", "--port", str(port),
                 "--disable-uvicorn-access-log"])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(base + "/health", timeout=5)
                break
            except httpx.HTTPError:
                assert proc.alive() and time.monotonic() < deadline, proc.output()
                time.sleep(0.2)
        assert health.status_code == 503 and health.headers["retry-after"]
        assert health.json()["error"]["message"] == "Loading model"
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 503
        assert httpx.get(base + "/version", timeout=5).status_code == 200
    finally:
        proc.stop()


class _HubServer(LiveServer):
    def __init__(self, args: list[str], env: dict):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        Proc.__init__(self, ["serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
                             "--disable-uvicorn-access-log"], env=env)


def test_a_hub_id_offline_with_several_names_and_underscore_flags(tiny_llama, tmp_path):
    lay_out_folder(str(tmp_path / "hf" / "hub"), "tidal-test/tiny-llama", tiny_llama)
    server = _HubServer(["tidal-test/tiny-llama", "--served_model_name", "first", "second",
                         "--max_model_len", "256", *ENGINE_FLAGS],
                        env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    try:
        server.start()
        with server.client(timeout=30) as client:
            cards = client.get("/v1/models").json()["data"]
            assert [c["id"] for c in cards] == ["first", "second"]
            assert "models--tidal-test--tiny-llama/snapshots/" in cards[0]["root"]
            assert cards[0]["max_model_len"] == 256
            r = client.post("/v1/completions", json={"model": "second", "prompt": "def add",
                                                     "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "second"
    finally:
        server.stop()


def test_a_hub_id_that_is_not_there_offline_is_one_line(tmp_path):
    result = _tidal("serve", "tidal-test/absent", "--port", "0",
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    (line,) = _lines(result.stderr)
    assert line.startswith("tidal serve: model 'tidal-test/absent' is not a local path, so "
                           "it was read as a Hugging Face Hub id")
    assert "hf download tidal-test/absent --local-dir DIR" in line


def test_version():
    result = _tidal("--version")
    assert result.returncode == 0 and result.stdout.startswith("tidal ")
