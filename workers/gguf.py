"""GGUF files: de-quantized once into a cached Hugging Face folder that everything else loads.

    python -m tidal.workers.gguf FILE.gguf [--cache-dir DIR] [--lifeline-fd F]
        prints one JSON line on stdout: {"folder": PATH} or {"error": MESSAGE} (exit 2)

The engine core runs this before it reads the context length or starts a worker
(`tidal.engine_core.model_files`), since it does not import torch. The folder is
`<cache>/gguf-v1/<file stem>-<sha256 of the file, 16 hex digits>/` with config.json,
generation_config.json, the tokenizer (tokenizer.json, tokenizer_config.json, the chat
template) and model.safetensors in float32; the cache is tidal's (`ipc/paths.py`:
`$TIDAL_CACHE_DIR`, else `$XDG_CACHE_HOME/tidal`, else `~/.cache/tidal`).

Why a folder, not the GGUF in every place: transformers parses the whole GGUF again for each
of config, tokenizer and weights (its reader builds one numpy view per vocabulary entry), so
each rank, the frontend and the core would each pay seconds to a minute at every start; a
folder is converted once per file and later starts are a hash and a safetensors mmap
(docs/gguf.md). The cost is disk: the weights are stored de-quantized, in
float32 (SmolLM2-135M in Q4_1: 538 MB from a 98 MB file).

A folder is written as a partial one, `.<stem>-partial-<pid>-<random>/` beside it, and renamed
into place once complete (its files synced, MARKER written last): a converter that dies
mid-way, however it dies, leaves nothing under the folder's name. Its writer holds a lock in
the partial folder while it lives (WRITER_LOCK); every start removes the partial folders whose
lock it can take, so half-written ones do not pile up (`_remove_abandoned_partials`).

Everything goes through transformers' own GGUF support (`from_pretrained(gguf_file=...)`,
which reads the file with the `gguf` package and de-quantizes each tensor with it, in
float32); nothing here parses GGUF. Only architectures the workers implement are converted;
any other is a ValueError naming it.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time

from ..ipc.lifeline import watch_parent
from ..ipc.paths import cache_dir

logger = logging.getLogger(__name__)

MARKER = "tidal_gguf.json"
"""Written last into a converted folder: where it came from (also: the folder is complete)."""
FORMAT_VERSION = 1
"""Part of the cache path (`gguf-v1`): raise it when the conversion changes what it writes."""
WRITER_LOCK = ".writer.lock"
"""In a partial folder: flock-ed by its writer for as long as it lives. The kernel releases it
when the writer dies, SIGKILL included, so a lock another process can take marks a folder
whose writer is gone; unlike a pid, it cannot be mistaken for a live writer after pid reuse,
nor for a dead one when the cache is shared across pid namespaces (containers) or hosts (NFS
takes it to the server: the file is opened read-write for that)."""
_PARTIAL_NAME = re.compile(r"^\..+-partial-\d+-[a-z0-9_]{8}$")
"""`_partial_prefix` + mkdtemp's 8 random characters. A converted folder can never match: its
name ends in a dash and 16 hex digits. Also matches partials of tidal before WRITER_LOCK."""
LIFELINE_GRACE_S = 5.0
"""From the engine core's death to SIGKILL: SIGTERM first, whose handler only removes this
process's partial folder (a Python handler waits for the C call under way, one tensor's
de-quantization or write); a partial left by the SIGKILL is removed by the next start."""

# transformers model_type (the GGUF's general.architecture, but gemma3's is gemma3_text) ->
# the class the workers implement (tidal.workers.models.ARCHITECTURES). transformers' GGUF
# reader maps no more than these of the families tidal runs (not granite, olmo2); of phi3 it
# reads no LongRoPE factors, of gemma2 / gemma3 no soft caps, query_pre_attn_scalar or local
# rope base, so a file whose model needs other values than transformers' defaults converts
# into a folder that is not that model (docs/models.md)
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    # mixture-of-experts (workers/models/qwen_moe.py). transformers reads no expert widths from
    # these files: it keeps its configs' defaults (Qwen1.5-MoE-A2.7B's 1408 / 5632, Qwen3-30B-
    # A3B's 768), so other widths fail in its loader with a shape error naming the tensor
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def file_sha256(path: str) -> str:
    """The file's sha256 (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_folder(path: str, root: str | None = None) -> str:
    """The converted folder of GGUF file `path`, converting it first if the cache lacks it.

    ValueError (naming the file) if it is missing, unreadable, or of an architecture the
    workers do not implement. Two processes converting the same file at once both succeed;
    one folder is kept.
    """
    if not os.path.isfile(path):
        raise ValueError(f"model {path!r}: no such GGUF file")
    t0 = time.perf_counter()
    digest = file_sha256(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    versions = _versions_dir(root or cache_dir())
    folder = os.path.join(versions, f"{stem}-{digest[:16]}")
    _remove_abandoned_partials(versions)
    if os.path.isfile(os.path.join(folder, MARKER)):
        logger.info("GGUF %s: using %s (hashed in %.1f s)", path, folder,
                    time.perf_counter() - t0)
        return folder
    os.makedirs(versions, exist_ok=True)
    logger.info("GGUF %s: converting it into a Hugging Face folder under %s, once per file "
                "(config, tokenizer, then the weights de-quantized: about a minute per "
                "billion parameters)", path, versions)
    partial, lock = _new_partial(versions, stem)
    try:
        seconds = convert(path, partial)
        _write_marker(partial, path, digest, seconds)
        _sync_files(partial)  # before the rename: a machine crash leaves a partial, not junk
        try:
            os.rename(partial, folder)
        except OSError:  # another process finished the same file first: keep its folder
            if not os.path.isfile(os.path.join(folder, MARKER)):
                raise
        else:
            _unlink_quietly(os.path.join(folder, WRITER_LOCK))  # only partials need it
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # still locked: no cleaner races it
        os.close(lock)
    logger.info("GGUF %s: converted into %s in %.1f s", path, folder, time.perf_counter() - t0)
    return folder


def _versions_dir(root: str) -> str:
    """Where this format's converted folders (and partial ones) live under the cache root."""
    return os.path.join(root, f"gguf-v{FORMAT_VERSION}")


def _partial_prefix(stem: str) -> str:
    """Names a partial folder after the converting process, so a SIGTERM can find its own."""
    return f".{stem}-partial-{os.getpid()}-"


def _new_partial(versions: str, stem: str) -> tuple[str, int]:
    """A new, empty partial folder in `versions` and the fd of its WRITER_LOCK, locked.

    Between mkdtemp and the lock a cleaner may take the folder for abandoned and remove it;
    then the lock file is gone or not the folder's own any more, and another is made."""
    while True:
        partial = tempfile.mkdtemp(prefix=_partial_prefix(stem), dir=versions)
        lock = os.path.join(partial, WRITER_LOCK)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # removed by a cleaner already
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner removes the folder
        if _same_file(fd, lock):
            return partial, fd
        os.close(fd)


def _remove_abandoned_partials(versions: str) -> None:
    """Remove the partial folders in `versions` whose writer is gone (SIGKILLed, out of memory,
    past its SIGTERM grace, the machine restarted): each start of any converter on this cache
    does it, so one found is left by a converter that died. A live writer's folder is left
    alone, however long it has run: the lock says whether its writer lives, which an age
    cannot (a large model converts for many minutes on a slow machine)."""
    try:
        names = os.listdir(versions)
    except FileNotFoundError:
        return
    for name in names:
        if _PARTIAL_NAME.match(name):
            _remove_if_abandoned(os.path.join(versions, name))


def _remove_if_abandoned(partial: str) -> None:
    lock = os.path.join(partial, WRITER_LOCK)
    try:  # created if missing: its writer died before making it, or was an older tidal
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # renamed into place or removed meanwhile, or not ours to touch
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, lock):  # else: renamed into place before the lock was taken
            logger.warning("GGUF cache: removing %s, left half-written by a converter that "
                           "died", partial)
            shutil.rmtree(partial, ignore_errors=True)
    except BlockingIOError:  # its writer is alive
        pass
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _sync_files(folder: str) -> None:
    """fsync every file in `folder` and the folder itself: renamed into place unsynced, a
    machine crash could leave the folder's name with MARKER present and weights missing."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_own_partials_and_exit(root: str) -> None:
    """SIGTERM: remove this process's partial folders, then exit at once. Not an exception
    unwinding the stack: a SystemExit raised inside `import torch` or transformers can meet a
    bare `except:` there and be swallowed, and the conversion would go on to the end."""
    for partial in glob.glob(os.path.join(_versions_dir(root), _partial_prefix("*") + "*")):
        shutil.rmtree(partial, ignore_errors=True)
    os._exit(143)


def convert(path: str, out: str) -> dict[str, float]:
    """De-quantize GGUF file `path` into HF folder `out` (existing, empty) through
    transformers; seconds per phase. ValueError naming the file or its architecture."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    folder, name = os.path.split(os.path.abspath(path))
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as e:  # "GGUF model with architecture X is not ..."
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
    arch = SUPPORTED.get(config.model_type)
    if arch is None:
        raise ValueError(f"GGUF file {path!r}: architecture {config.model_type!r} is not "
                         f"supported; tidal runs {', '.join(SUPPORTED)}")
    seconds["config"] = _lap(t)
    t = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    seconds["tokenizer"] = _lap(t)
    logger.info("GGUF %s: %s config and tokenizer read; de-quantizing the weights", path, arch)
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=torch.float32, **_dequantize_all())
    packed = [n for n, p in model.state_dict().items() if not p.is_floating_point()]
    if packed:
        raise ValueError(f"GGUF file {path!r}: transformers kept tensors packed "
                         f"({', '.join(packed[:3])}...) instead of de-quantizing them")
    seconds["weights"] = _lap(t)
    logger.info("GGUF %s: weights de-quantized in %.1f s; saving the folder", path,
                seconds["weights"])
    t = time.perf_counter()
    _save(model, arch, tokenizer, out)
    seconds["save"] = _lap(t)
    logger.info("GGUF %s (%s): config %.1f s, tokenizer %.1f s, de-quantized weights %.1f s, "
                "saved %.1f s", path, arch, seconds["config"], seconds["tokenizer"],
                seconds["weights"], seconds["save"])
    return seconds


def _dequantize_all() -> dict:
    """from_pretrained's argument for plain float weights: transformers 5.2x keeps supported
    architectures packed when the `kernels` package is installed, unless told otherwise
    (older versions have no GgufConfig and always de-quantize)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _save(model, arch: str, tokenizer, out: str) -> None:
    """A plain float32 folder: transformers marks a model loaded from GGUF as quantized and
    refuses to `save_pretrained` it, so the parts are written one by one."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain float32
    config.architectures = [arch]
    config.dtype = "float32"
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the same storage as the embedding
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def _write_marker(out: str, path: str, digest: str, seconds: dict) -> None:
    import gguf
    import transformers

    marker = {"format_version": FORMAT_VERSION, "source": os.path.abspath(path),
              "sha256": digest, "bytes": os.path.getsize(path),
              "transformers": transformers.__version__,
              "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
              "seconds": seconds}
    with open(os.path.join(out, MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _lap(t: float) -> float:
    return round(time.perf_counter() - t, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="convert a GGUF file into tidal's cache "
                                                 "(run by the engine core)")
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--cache-dir", default=None, help="default: " + cache_dir())
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--lifeline-fd", type=int, default=None,
                        help="read end of the engine core's lifeline pipe (ipc/lifeline.py)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' per-tensor bar, \r by \r in logs
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [tidal gguf] %(name)s: %(message)s")
    # SIGTERM: the engine core stopping during start-up, or gone (the lifeline's SIGTERM)
    root = args.cache_dir or cache_dir()
    signal.signal(signal.SIGTERM, lambda *_: _remove_own_partials_and_exit(root))
    if args.lifeline_fd is not None:  # after the handler: a dead core's SIGTERM cleans up
        watch_parent(args.lifeline_fd, LIFELINE_GRACE_S, what="GGUF converter")
    try:
        result = {"folder": gguf_folder(args.file, args.cache_dir)}
    except ValueError as e:
        result = {"error": str(e)}
    except ImportError as e:  # transformers needs gguf and accelerate for GGUF files
        result = {"error": f"reading GGUF files needs the gguf and accelerate packages: {e}"}
    except Exception as e:  # noqa: BLE001 - a quantization transformers lacks, a full disk...
        logger.exception("converting %s failed", args.file)
        result = {"error": f"cannot convert GGUF file {args.file!r}: {type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
