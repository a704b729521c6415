"""The folder behind a model argument: a Hugging Face folder as given, or the folder a GGUF
file is converted into.

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

from ..ipc.lifeline import lifeline_fd
from .config import is_gguf

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_STOP_GRACE_S = 10.0


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
