"""The panel GEMM of `small_m_gemm.c`: float32 linear layers for decode batches on AVX-512
CPUs, where it beats oneDNN (`cpu_gemm.py`) by streaming the weights with prefetches.

Measured on this project's 2-core Xeon VM (AVX-512, two threads), SmolLM2-135M's four layer
shapes in 30 layers, each weight streamed from memory (BENCHMARKS.md, "On the Xeon again"):

    rows     8        16       32       64       128      256
    oneDNN   25.1 ms  31.7 ms  41-44 ms 67.3 ms  97.9 ms  167.7 ms
    panels   20.7 ms  25.3 ms  33.6 ms  58.1 ms  94.6 ms  178.0 ms

so `PanelGemm` takes inputs of up to `PANEL_ROWS` rows. The C source is compiled on first use
with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native -fopenmp`) into tidal's
cache folder, keyed by the source, the flags and the CPU, and loaded from there after; a
machine without a compiler, or a CPU without AVX-512 (the kernel's registers are 16-float
vectors), keeps oneDNN: `load()` returns None. The library's OpenMP parallel loop links
`libgomp.so.1`; loaded after torch, that name is torch's own runtime already in the process,
so its threads are torch's (`torch.get_num_threads()` sets the count).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PANEL_ROWS = 128
"""Most rows that take the panel kernel (above, oneDNN's kernel is level or faster)."""
SOURCE = Path(__file__).with_name("small_m_gemm.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_OPS = {None: 0, "add": 1, "mul": 2}
_library: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built the first time on this machine), or None where it cannot
    run here; tried once per process."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _build_and_load()
    return _library


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("TIDAL_NO_PANEL_GEMM"):
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None
    path = _cache_folder() / f"small_m_gemm-{_build_key(compiler)}.so"
    try:
        if not path.is_file():
            _compile(compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("panel GEMM not built (%s); linear layers keep oneDNN", e)
        return None
    if not library.tidal_panel_gemm_available():
        return None
    library.tidal_panel_gemm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int]
    library.tidal_panel_gemm.restype = None
    return library


def _cache_folder() -> Path:
    """$TIDAL_CACHE_DIR/kernels, else under $XDG_CACHE_HOME or ~/.cache (tidal's cache)."""
    base = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tidal")
    return Path(base) / "kernels"


def _build_key(compiler: str) -> str:
    """The source, the compiler and flags, and this CPU (`-march=native`)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((compiler, *FLAGS)).encode())
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            digest.update(next((line for line in f if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return digest.hexdigest()[:16]


def _compile(compiler: str, path: Path) -> None:
    """Build into a temporary file beside `path`, then rename: processes starting at once
    each see a whole library or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, path)


def panel_gemm_applies(weight: torch.Tensor) -> bool:
    """Whether `PanelGemm` can take this [N, K] weight: float32 on the CPU, N a multiple of
    32, and the kernel loads on this machine."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] > 0
            and load() is not None)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16], contiguous: panel p holds output columns 16p..16p+15."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


class PanelGemm:
    """`x @ weight.T` (and with a fused add or mul) through the panel kernel, for inputs of
    1..PANEL_ROWS rows (the caller routes the rest elsewhere)."""

    def __init__(self, weight: torch.Tensor):
        if not panel_gemm_applies(weight):
            raise ValueError(f"no panel GEMM for a {weight.dtype} {tuple(weight.shape)} weight "
                             f"on {weight.device} here")
        self.out_features, self.in_features = weight.shape
        self.panels = pack_panels(weight)
        self._kernel = load().tidal_panel_gemm

    def __call__(self, x2: torch.Tensor, other: torch.Tensor | None = None,
                 op: str | None = None) -> torch.Tensor:
        """x2 [rows, in] contiguous float32 -> [rows, out]; `op` "add"/"mul" with `other`
        [rows, out] contiguous applies it to the finished product."""
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        self._kernel(x2.data_ptr(), rows, self.in_features, self.panels.data_ptr(),
                     self.out_features, y.data_ptr(),
                     other.data_ptr() if other is not None else None, _OPS[op])
        return y
