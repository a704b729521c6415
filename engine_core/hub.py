"""A model named by its Hugging Face Hub id, fetched once into the Hub's cache.

    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")      -> .../snapshots/<commit>  (a folder)
    resolve_model("org/M-GGUF:m-q4_k_m.gguf")        -> .../snapshots/<commit>/m-q4_k_m.gguf
    resolve_model("org/M-GGUF:Q4_K_M")               -> the repository's one .gguf with Q4_K_M
                                                        in its name (case ignored)
    resolve_model("/path/to/folder" or "x.gguf")     -> as given, when it exists

A name that exists on disk is always a path; otherwise one of the forms `ORG/NAME`,
`ORG/NAME:FILE.gguf`, `ORG/NAME:TAG` is a Hub id, and anything else is a path that does not
exist (ValueError saying so). Downloads go through `huggingface_hub` as vLLM's do, so its
environment applies unchanged: HF_HOME / HF_HUB_CACHE (where the cache is; `--download-dir`
overrides it), HF_TOKEN (gated and private repositories), HF_HUB_OFFLINE=1 (the cache only,
no network), HF_ENDPOINT. A repository already in the cache at the asked revision is not
fetched again (huggingface_hub checks the revision's commit; offline it trusts refs/).

Called by `model_files.prepare_model`, in the process the user started (`tidal serve`, `tidal
core`, `LLM`, `tidal tune`, `tidal bench`) before any engine core or worker starts, so the
download happens once, with huggingface_hub's progress bars on stderr, and everything after
sees a local folder or file. huggingface_hub is pure Python (no torch).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re

logger = logging.getLogger(__name__)

FOLDER_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a Hugging Face model folder needs: config, tokenizer files, safetensors weights
(never `.bin` / `.pt` checkpoints, nor a repository's other GGUF or ONNX copies)."""

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<file>[^:/]+))?$")
"""ORG/NAME, optionally :FILE.gguf or :TAG (a quantization tag such as Q4_K_M)."""

_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def hub_id(model: str) -> tuple[str, str | None] | None:
    """(repository, file or tag) when `model` reads as a Hub id, else None."""
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return None
    match = _HUB_ID.match(model)
    if match is None or match.group("repo").endswith((".", "-")):
        return None
    return match.group("repo"), match.group("file")


def resolve_model(model: str, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """A local folder or GGUF file for `model` (see the module docstring). ValueError, one
    line, when it is neither on disk nor a Hub id, or when the Hub cannot give it."""
    if os.path.exists(model):
        return model
    parsed = hub_id(model)
    if parsed is None:
        raise ValueError(f"model {model!r}: no such file or folder (nor a Hugging Face Hub "
                         "id, which reads ORG/NAME)")
    repo, file = parsed
    try:
        if file is None:
            return _snapshot(repo, revision, download_dir, FOLDER_FILES)
        if file.lower().endswith(".gguf"):
            return os.path.join(_snapshot(repo, revision, download_dir, [file]), file)
        return _gguf_by_tag(repo, file, revision, download_dir)
    except ValueError:
        raise
    except Exception as exc:  # offline, no network, gated, no such repo or revision
        raise ValueError(_download_failed(model, repo, exc)) from exc


def _snapshot(repo: str, revision: str | None, download_dir: str | None,
              patterns: list[str]) -> str:
    """The snapshot folder of `repo` at `revision` holding (at least) the files matching
    `patterns`, fetched where missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if not HF_HUB_OFFLINE:
        logger.info("fetching %s%s from the Hugging Face Hub (%s) into %s", repo,
                    f" at revision {revision}" if revision else "", ", ".join(patterns),
                    download_dir or "the Hub cache")
    folder = snapshot_download(repo, revision=revision, cache_dir=download_dir,
                               allow_patterns=patterns)
    if not any(fnmatch.fnmatch(name, pattern) for name in os.listdir(folder)
               for pattern in patterns):
        raise ValueError(f"model {repo!r}: the Hugging Face Hub repository has no file "
                         f"matching {', '.join(patterns)}"
                         + (" (in the local cache; HF_HUB_OFFLINE is set)" if HF_HUB_OFFLINE
                            else ""))
    return folder


def _gguf_by_tag(repo: str, tag: str, revision: str | None, download_dir: str | None) -> str:
    """The one GGUF file of `repo` whose name holds `tag` (case ignored), as llama-server's
    `-hf repo:tag` picks it."""
    patterns = sorted({f"*{tag}*.gguf", f"*{tag.lower()}*.gguf", f"*{tag.upper()}*.gguf"})
    folder = _snapshot(repo, revision, download_dir, patterns)
    names = sorted(name for name in os.listdir(folder)
                   if name.lower().endswith(".gguf") and tag.lower() in name.lower())
    whole = [name for name in names if not _SPLIT_GGUF.search(name)]
    if not whole:
        raise ValueError(f"model {repo}:{tag}: the repository's GGUF files for {tag} are "
                         f"split into parts ({', '.join(names)}), which tidal does not read")
    if len(whole) > 1:
        logger.warning("%s: %d GGUF files match %s (%s); using %s", repo, len(whole), tag,
                       ", ".join(whole), whole[0])
    return os.path.join(folder, whole[0])


def _download_failed(model: str, repo: str, exc: Exception) -> str:
    """One line: the name was read as a Hub id, what failed, how to get a local folder."""
    from huggingface_hub.constants import HF_HUB_OFFLINE

    reason = " ".join(str(exc).split()) or type(exc).__name__
    if len(reason) > 300:
        reason = reason[:297] + "..."
    hint = ("HF_HUB_OFFLINE is set and it is not in the local cache" if HF_HUB_OFFLINE
            else "check the network, the id, and HF_TOKEN for a gated repository")
    return (f"model {model!r} is not a local path, so it was read as a Hugging Face Hub id, "
            f"and fetching it failed ({type(exc).__name__}: {reason}); {hint}. Or pass a "
            f"local folder: `hf download {repo} --local-dir DIR`, then give DIR")
