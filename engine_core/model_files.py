"""The folder behind a model argument: a Hugging Face folder as given, the folder a GGUF
file is converted into, or what a Hub id names, fetched first.

`prepare_model(config)` runs where the user started tidal (`tidal serve`, `tidal core`,
`LLM`, `AsyncLLM.create`, `tidal tune`, `tidal bench`), before any engine core or worker
starts: a Hub id becomes its local folder or GGUF file (`hub.py`; the name users know stays
the served name), and what can be checked without torch is checked there, once, so that a
deterministic start-up error is one line and no process is started, let alone restarted: the
path exists, config.json reads, `--max-model-len` fits the model's, `-tp` divides the
attention heads, `-pp` does not exceed the layers. (An unknown architecture is the workers'
to find; the engine core then exits with EXIT_BAD_START and is not started again.)

A GGUF file is converted once into a cached Hugging Face folder by a child process,

    python -m tidal.workers.gguf FILE.gguf --lifeline-fd F
        (prints {"folder": ...} or {"error": ...})

because the conversion needs torch and transformers, which the engine core never imports.
The engine core does this first at start-up; from then on it reads the context length from
the folder, starts the workers on it, and names it to frontends (`EngineInfo.model`, and
`EngineInfo.tokenizer` unless --tokenizer was given), so nothing past this point sees a GGUF.

Like every child of the engine core, the converter dies with it, SIGKILL included (F is the
read end of its lifeline, `ipc/lifeline.py`): a killed core leaves no converter finishing a
cache nobody waits for (issue 39; before, one ran on for 41 s as an orphan).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable

import dataclasses
import os

from ..ipc.lifeline import lifeline_fd
from .config import EngineConfig, is_gguf, resolve_max_model_len
from .hub import hub_id, resolve_model

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_STOP_GRACE_S = 10.0


def prepare_model(config: EngineConfig) -> EngineConfig:
    """`config` with its model (and tokenizer) as local paths, a Hub id fetched first, and
    the checks above passed; ValueError (one line, naming the model or the flag) otherwise."""
    m = config.model
    model = resolve_model(m.model, m.revision, m.download_dir)
    tokenizer = m.tokenizer
    if tokenizer is not None and not os.path.exists(tokenizer) and hub_id(tokenizer):
        tokenizer = resolve_model(tokenizer, None, m.download_dir)
    if os.path.isfile(model) and not is_gguf(model):
        raise ValueError(f"model {m.model!r} is a file; expected a model folder or a .gguf "
                         "file")
    if model != m.model or tokenizer != m.tokenizer:
        names = m.served_model_name or m.model  # the Hub id, not the cache folder
        m = dataclasses.replace(m, model=model, tokenizer=tokenizer, served_model_name=names)
        config = dataclasses.replace(config, model=m)
    if not is_gguf(model):  # a GGUF file's config is known once it is converted
        check_model_folder(config)
    return config


def check_model_folder(config: EngineConfig) -> None:
    """What the model folder's config.json lets the frontend check (ValueError naming the
    flag): the context length against --max-model-len, the heads against -tp, the layers
    against -pp."""
    resolve_max_model_len(config)  # config.json reads; --max-model-len fits
    with open(os.path.join(config.model.model, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    p = config.parallel
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    tp = p.tensor_parallel_size
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's "
                         f"num_attention_heads ({heads})")
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide or be a multiple of the "
                         f"model's num_key_value_heads ({kv_heads})")
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and p.pipeline_parallel_size > layers:
        raise ValueError(f"pipeline_parallel_size ({p.pipeline_parallel_size}) exceeds the "
                         f"model's num_hidden_layers ({layers}): every stage needs a layer")
    if config.scheduler.draft_model is not None:
        check_draft_folder(config.scheduler.draft_model, text, tp)


def check_draft_folder(folder: str, target: dict, tp: int) -> None:
    """speculative_config.model (draft_model): a local folder with a config.json whose
    vocabulary is the target's (`target`: the target's config.json text part) and whose
    heads -tp can split (ValueError naming the key). The workers check again at load."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative_config.model {folder!r} is not a model folder (no "
                         "config.json there)")
    with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    draft = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    if draft.get("vocab_size") != target.get("vocab_size"):
        raise ValueError(f"speculative_config.model {folder!r} has vocab_size "
                         f"{draft.get('vocab_size')}; the draft model needs the target's "
                         f"({target.get('vocab_size')})")
    heads = draft.get("num_attention_heads")
    kv_heads = draft.get("num_key_value_heads", heads)
    if isinstance(heads, int) and heads % tp or (
            isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads):
        raise ValueError(f"speculative_config.model {folder!r}: tensor_parallel_size ({tp}) "
                         f"must divide its num_attention_heads ({heads}) and divide or be a "
                         f"multiple of its num_key_value_heads ({kv_heads})")


def model_folder(model: str, stop_requested: Callable[[], bool] = lambda: False,
                 log_level: str = "INFO") -> str:
    """`model` itself, or the converted folder of GGUF file `model` (converting it on the
    first use of the file; later uses find it in the cache by the file's sha256).

    ValueError naming the file when it cannot be converted; InterruptedError when
    `stop_requested()` turns true meanwhile (the converter is stopped first).
    """
    if not is_gguf(model):
        return model
    lifeline = lifeline_fd()  # the converter dies with this process (ipc/lifeline.py)
    cmd = [sys.executable, "-m", "tidal.workers.gguf", model, "--log-level", log_level,
           "--lifeline-fd", str(lifeline)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                            pass_fds=(lifeline,))
    stdout = ""
    while True:
        try:
            stdout, _ = proc.communicate(timeout=_POLL_S)  # its log goes to our stderr
            break
        except subprocess.TimeoutExpired:
            if stop_requested():
                _stop(proc)
                raise InterruptedError("stopped while converting the GGUF file") from None
    return _folder_from(stdout, model, proc.returncode)


def _folder_from(stdout: str, model: str, returncode: int) -> str:
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if isinstance(result, dict) and isinstance(result.get("folder"), str) and returncode == 0:
        return result["folder"]
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        raise ValueError(result["error"])
    raise ValueError(f"model {model!r}: converting the GGUF file failed (exit status "
                     f"{returncode}; its log is above)")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # it removes its partial folder on SIGTERM
    try:
        proc.communicate(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
