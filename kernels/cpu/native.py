"""C kernels of this folder, compiled on first use with the machine's C compiler and loaded
with ctypes: the panel GEMM (`small_m_gemm.c`), the paged decode and prefill attention
(`decode_attention.c`), RMSNorm and the rotary rotation (`layer_ops.c`), the AMX GEMM of a
GGUF's blocks (`amx_gemm.c`) and the decoder layers in one call (`decoder_layers.c`, which
calls the others' functions through pointers its caller passes: each library is built and
keyed on its own source alone).

A source is compiled with `$CC` (else `cc`) and `-O3 -march=native -fopenmp` (or
`-march=$TIDAL_KERNEL_MARCH`) into tidal's cache
folder (`$TIDAL_CACHE_DIR/kernels`, else `~/.cache/tidal/kernels`), under a name keyed by the
source, the compiler and flags and this CPU's flags, and loaded from there after (a build takes
0.1-0.3 s). A machine without a compiler, a build that fails or a library built for a CPU its
kernel cannot use (each source exports an `..._available()` that says) gives None, and the
caller keeps its other path. The libraries' OpenMP loops link `libgomp.so.1`; loaded after
torch, that name is torch's own runtime already in the process, so their threads are torch's
(`torch.get_num_threads()` sets the count).
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
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def flags() -> tuple[str, ...]:
    """FLAGS, with `-march=$TIDAL_KERNEL_MARCH` where that is set: another CPU's build run on
    this one (`haswell`: the AVX2 paths on an AVX-512 machine), for tests and measurements."""
    march = os.environ.get("TIDAL_KERNEL_MARCH")
    return tuple(f"-march={march}" if march and f == "-march=native" else f for f in FLAGS)


_loaded: dict[Path, ctypes.CDLL | None] = {}
"""Each source's library (or None), as `load` found it; looked up once per process and kernel,
at model load, never in a step's loop."""


def load(source: Path, available: str,
         declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """`build_and_load(source, available)` the first time in this process, with `declare`
    giving its functions their ctypes signatures; the same library (or None) after."""
    if source not in _loaded:
        library = build_and_load(source, available)
        if library is not None:
            declare(library)
        _loaded[source] = library
    return _loaded[source]


def build_and_load(source: Path, available: str) -> ctypes.CDLL | None:
    """`source` compiled for this machine and loaded, or None where it cannot be (no
    compiler, a failed build, or the library's `available()` function returning 0)."""
    compiler = compiler_name()
    if shutil.which(compiler) is None:
        return None
    path = cache_folder() / f"{source.stem}-{_build_key(source, compiler)}.so"
    try:
        if not path.is_file():
            _compile(source, compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("%s not built (%s); its callers keep their other path", source.name, e)
        return None
    return library if getattr(library, available)() else None


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
    """$TIDAL_CACHE_DIR/kernels, else under $XDG_CACHE_HOME or ~/.cache (tidal's cache)."""
    base = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tidal")
    return Path(base) / "kernels"


def _build_key(source: Path, compiler: str) -> str:
    """The source, the compiler and flags, and this CPU (`-march=native`)."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join((compiler, *flags())).encode())
    digest.update(_cpuinfo_line("flags").encode())
    return digest.hexdigest()[:16]


def _compile(source: Path, compiler: str, path: Path) -> None:
    """Build into a temporary file beside `path`, then rename: processes starting at once
    each see a whole library or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        subprocess.run([compiler, *flags(), "-o", str(built), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, path)
