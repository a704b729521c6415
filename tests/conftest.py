"""Shared test set-up. Triton kernels run under the interpreter on machines without CUDA.

Nothing of a run is left in the user's folders (issue 38 §6): its ipc:// sockets go into a
runtime folder of its own ($XDG_RUNTIME_DIR, which ipc/transport.runtime_dir reads), removed
when the session ends, after `pytest_sessionfinish` checked that no process of the run still
holds one; tidal's cache ($TIDAL_CACHE_DIR: kernel builds, the OpenMP link, GGUF conversions)
is the real-model cache under the temporary root (tests/real_models.py), unless set.
"""

import os
import shutil
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tiny_models import make_tiny_gguf, make_tiny_model  # noqa: E402

from run_folders import RUN_RUNTIME_DIR, live_socket_owners  # noqa: E402  (sets both folders)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process that bound a socket here outlived every test (10 s of grace
    for one still exiting), then remove the run's runtime folder."""
    folder = os.path.join(RUN_RUNTIME_DIR, "tidal")
    deadline = time.monotonic() + 10
    while (owners := live_socket_owners(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if owners and sys.platform.startswith("linux"):
        session.config.get_terminal_writer().line(
            f"tests/conftest.py: processes of this run outlived it, holding sockets: {owners}",
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(RUN_RUNTIME_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (once per session and arguments) a tiny random-weight HF folder; returns its path."""
    cache: dict = {}

    def build(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            cache[key] = make_tiny_model(path, arch, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def tiny_gguf_factory(tiny_llama, tmp_path_factory):
    """Write (once per session and arguments) the tiny Llama as a GGUF file; returns its path."""
    cache: dict = {}

    def build(qtype: str = "F32", arch: str = "llama") -> str:
        if (qtype, arch) not in cache:
            folder = tmp_path_factory.mktemp(f"gguf-{qtype}-{arch}")
            cache[qtype, arch] = make_tiny_gguf(tiny_llama, str(folder / f"tiny-{qtype}.gguf"),
                                                qtype, arch)
        return cache[qtype, arch]

    return build


@pytest.fixture(scope="session")
def gguf_cache_dir(tmp_path_factory):
    """TIDAL_CACHE_DIR for GGUF conversions from here on (daemons started later inherit it),
    so tests never write into the user's cache."""
    path = str(tmp_path_factory.mktemp("tidal-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", path)
        yield path
