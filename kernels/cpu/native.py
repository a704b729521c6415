"""C kernels of this folder, compiled on first use with the machine's C compiler and loaded
with ctypes: the panel GEMM (`small_m_gemm.c`), the paged decode and prefill attention
(`decode_attention.c`), RMSNorm and the rotary rotation (`layer_ops.c`), the AMX GEMM of a
GGUF's blocks (`amx_gemm.c`) and the decoder layers in one call (`decoder_layers.c`, which
calls the others' functions through pointers its caller passes: each library is built and
keyed on its own source alone).

A source is compiled with `$CC` (else `cc`) and `-O3 -march=native -fopenmp` (or
`-march=MARCH` where the CPU op seam set `march`: `cpu_kernels=auto,march=haswell`) into
`kernels` in tidal's cache folder (`ipc/paths.py`, this folder's one import of ours:
`$TIDAL_CACHE_DIR/kernels`, else `~/.cache/tidal/kernels`), under a name keyed by the source,
the compiler and flags and this CPU's flags, and loaded from there after
(a build takes 0.1-0.3 s). A machine without a compiler, a build that fails or a library built
for a CPU its kernel cannot use (each source exports an `..._available()` that says) gives a
`Build` without a library and with the reason, and the caller keeps its other path; the CPU op
seam (`ops.py`) logs every library's `Build` in its start-up line. The libraries' OpenMP loops
link `libgomp.so.1`; loaded after torch, that name is torch's own runtime already in the
process, so their threads are torch's (`torch.get_num_threads()` sets the count).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...ipc.paths import cache_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

march = "native"
"""The CPU the libraries are built for: `native` (this one), or another CPU's name for gcc's
`-march=` (`haswell`: the AVX2 paths on an AVX-512 machine, for tests and measurements). Set
once per process, before any library is loaded, by the CPU op seam (`ops.select_cpu_ops`,
from `cpu_kernels`'s `march=`)."""


def flags(target: str | None = None) -> tuple[str, ...]:
    """FLAGS, with `-march=target` (default: `march`) in place of `-march=native`."""
    target = target or march
    return tuple(f"-march={target}" if f == "-march=native" else f for f in FLAGS)


@dataclass(frozen=True)
class Build:
    """What became of one C source on this machine."""

    library: ctypes.CDLL | None
    """The loaded library; None where it could not be built or cannot run here."""
    why_not: str = ""
    """Why there is no library ("" where there is one): no compiler, a failed build, or this
    CPU lacking what the kernel needs (the source's `..._available()` returned 0)."""
    no_compiler: bool = False
    """Whether the reason is the compiler (none, or a failed build), not the CPU."""


_builds: dict[tuple[Path, str], Build] = {}
"""Each source's `Build` per `march`, as `build` found it; looked up once per process and
kernel, at model load, never in a step's loop."""


def load(source: Path, available: str,
         declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """`build(...)`'s library (or None)."""
    return build(source, available, declare).library


def build(source: Path, available: str, declare: Callable[[ctypes.CDLL], None]) -> Build:
    """`build_and_load(source, available)` the first time in this process (for `march`), with
    `declare` giving its functions their ctypes signatures; the same `Build` after."""
    key = (source, march)
    if key not in _builds:
        built = build_and_load(source, available)
        if built.library is not None:
            declare(built.library)
        _builds[key] = built
    return _builds[key]


def build_and_load(source: Path, available: str, target: str | None = None) -> Build:
    """`source` compiled for `target` (default: `march`) and loaded, or the reason it cannot
    be: no compiler, a failed build, or the library's `available()` function returning 0."""
    compiler = compiler_name()
    if shutil.which(compiler) is None:
        return Build(None, f"no C compiler: {compiler!r} not found, set $CC", True)
    path = cache_folder() / f"{source.stem}-{_build_key(source, compiler, target)}.so"
    try:
        if not path.is_file():
            _compile(source, compiler, path, target)
        library = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        error = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        logger.info("%s did not build:\n%s", source.name, "\n".join(error))
        return Build(None, f"its build failed ({error[-1] if error else e})", True)
    except (OSError, subprocess.SubprocessError) as e:
        return Build(None, f"its build failed ({e})", True)
    if not getattr(library, available)():
        return Build(None, "this CPU lacks the instructions it needs")
    return Build(library)


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where it cannot be
    read): some kernel choices measured differently on this project's Xeon and EPYC VMs."""
    return _cpuinfo_line("vendor_id").partition(":")[2].strip()


def _cpuinfo_line(key: str) -> str:
    """The first line of /proc/cpuinfo that starts with `key` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def compiler_name() -> str:
    """The C compiler: $CC, else cc."""
    return os.environ.get("CC") or "cc"


def cache_folder() -> Path:
    """`kernels` in tidal's cache folder (`ipc/paths.py`: $TIDAL_CACHE_DIR, else
    $XDG_CACHE_HOME/tidal, else ~/.cache/tidal)."""
    return Path(cache_dir()) / "kernels"


def _build_key(source: Path, compiler: str, target: str | None) -> str:
    """The source, the compiler and flags, and this CPU (`-march=native`)."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join((compiler, *flags(target))).encode())
    digest.update(_cpuinfo_line("flags").encode())
    return digest.hexdigest()[:16]


def _compile(source: Path, compiler: str, path: Path, target: str | None) -> None:
    """Build into a temporary file beside `path`, then rename: processes starting at once
    each see a whole library or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s for this CPU with %s (once per machine and version; cached in "
                "%s)", source.name, compiler, path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        subprocess.run([compiler, *flags(target), "-o", str(built), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, path)
