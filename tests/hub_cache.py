"""A Hugging Face Hub cache laid out on disk the way huggingface_hub writes it, so tests can
name a model by its Hub id offline (HF_HUB_OFFLINE=1) and go through the real code path:

    CACHE/models--ORG--NAME/blobs/<sha256>              the files' bytes
    CACHE/models--ORG--NAME/snapshots/<commit>/<file>   relative symlinks to the blobs
    CACHE/models--ORG--NAME/refs/main                   the commit
"""

from __future__ import annotations

import hashlib
import os

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_repo(cache: str, repo: str, files: dict[str, str], commit: str = COMMIT,
                 ref: str = "main") -> str:
    """Put `files` (name in the repository -> a local file to copy) into the Hub cache folder
    `cache` as repository `repo` at `commit`, `ref` pointing to it; the snapshot folder."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    with open(os.path.join(root, "refs", ref), "w") as f:
        f.write(commit)
    for name, source in files.items():
        with open(source, "rb") as f:
            data = f.read()
        blob = os.path.join(root, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    return snapshot


def lay_out_folder(cache: str, repo: str, folder: str, **kwargs) -> str:
    """Every file of model folder `folder` as repository `repo`; the snapshot folder."""
    return lay_out_repo(cache, repo, {name: os.path.join(folder, name)
                                      for name in sorted(os.listdir(folder))
                                      if os.path.isfile(os.path.join(folder, name))}, **kwargs)
