"""How many CPU threads each worker rank runs, on which cores, and how its idle threads wait.

The worker's intra-op threads are OpenMP threads: torch's GEMMs and elementwise ops, and the
numba decode-attention kernel (numba's "omp" threading layer). Four choices, made here once
for every rank and handed to it through its environment before it imports torch:

- **One OpenMP runtime** (`shared_openmp_dir`): torch's wheel bundles its own libgomp, and
  numba's thread pool links the system's by the file name `libgomp.so.1.0.0`, so a worker
  ran two runtimes and two teams of threads on the same cores. The rank's
  `LD_LIBRARY_PATH` starts with a folder where that name points at torch's libgomp, so
  numba's pool is torch's pool: one team, which the kernels hand to each other.
- **Wait policy**: left to libgomp's default unless `OMP_WAIT_POLICY` is set, i.e. a thread
  spins for about 300,000 iterations after a parallel region, then sleeps. Measured on an
  AMD EPYC 2-core VM (7M Llama, 200 sharegpt-like requests offline, tokens/s):

      two runtimes, PASSIVE (the old default)    777-853
      one runtime, PASSIVE                       698-770
      one runtime, spin 10,000 / 50,000          686 / 731
      one runtime, default spin (300,000)        1810-2066
      one runtime, ACTIVE (spin forever)         1803-1970
      one thread                                 798

  A sleeping thread of a VM is a halted virtual CPU, and waking one for each of the ~30
  parallel regions of a step cost more than the step's work; the gaps between regions
  (Python between two kernels) are longer than 50,000 spins. Two runtimes spinning fought
  each other (a step 7x slower): that is why PASSIVE was the default before the runtimes
  were joined.
- **Thread count** (`--cpu-threads`): by default every core this process may use, shared
  among the ranks. The engine core and the frontends sleep in `poll` while a step runs, so
  leaving them a core of their own (the old default) halved the worker's compute on a
  2-core machine.
- **Affinity** (`--cpu-affinity`, vLLM's `VLLM_CPU_OMP_THREADS_BIND` syntax): optional
  core lists, one per rank separated by `|` (`0-3|4-7`); a rank then runs only there and
  its thread count defaults to its list's length.

A busy neighbour in another session takes its share of the cores, and a spinning thread
then waits at each barrier for a partner the scheduler has parked: the demo model's decode
went from ~5 ms to 0.4-1 s a token. `--cpu-wait-policy` (`ParallelConfig.cpu_wait_policy`)
chooses: auto (the default) spins, and has the worker switch libgomp to its throttled spin
count (about PASSIVE) while its threads wait for a CPU, back once the cores are free
(`workers/cpu_contention.py` says how a process changes this after libgomp has started);
spin never changes; passive sets OMP_WAIT_POLICY=PASSIVE in the worker's environment
(`cpu_contention.apply_wait_policy`).

A `nice`d neighbour: spinning threads give way to a `nice`d process only if the kernel compares
their priorities, and with autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`)
it does so only within one session; so the engine core and its workers stay in the session
that started them (`engine_core/supervisor.py`), and a `nice -n 19` job of that session cost the
7M run 4-12% of its throughput (1824 tokens/s beside two such busy loops). A neighbour in
another session gets an equal share of the CPU whatever its nice value; there, PASSIVE
(`OMP_WAIT_POLICY=PASSIVE`) keeps more.

An explicit `--cpu-threads` wins over `OMP_NUM_THREADS` in the environment, which wins over
the default; `OMP_WAIT_POLICY` and `GOMP_SPINCOUNT` already in the environment are kept.
Where the ranks' threads outnumber the cores (`--cpu-threads` set that high), the wait policy
is PASSIVE: spinning threads would wait for partners that are not running.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from ..ipc.paths import cache_dir

NUMBA_LIBGOMP_NAME = "libgomp.so.1.0.0"
"""The file name numba's OpenMP pool (numba/np/ufunc/omppool) asks the loader for."""


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; ValueError naming cpu_affinity on anything else."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu_affinity: cannot read {part!r} in {text!r} (expected core "
                             "numbers and ranges such as 0-3,6)") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_affinity: bad range {part!r} in {text!r}")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"cpu_affinity: a core appears twice in {text!r}")
    return cores


def parse_cpu_affinity(text: str | None, num_ranks: int) -> list[list[int]] | None:
    """Per-rank core lists from '0-1' (one rank) or '0-3|4-7' (one list per rank); None for
    None, '' or 'all'. ValueError naming cpu_affinity when the count of lists is wrong."""
    if text is None or text.strip() in ("", "all"):
        return None
    lists = [parse_cpu_list(part) for part in text.split("|")]
    if len(lists) != num_ranks:
        raise ValueError(f"cpu_affinity: {len(lists)} core list(s) in {text!r} for "
                         f"{num_ranks} rank(s); give one list per rank, separated by '|'")
    return lists


def available_cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def worker_threads(cpu_threads: int | None, cores: list[int] | None, num_ranks: int,
                   env: dict[str, str]) -> int:
    """OpenMP threads for one rank: `cpu_threads`, else OMP_NUM_THREADS from `env`, else the
    rank's core list's length, else this process's cores shared among the ranks (>= 1)."""
    if cpu_threads is not None:
        return cpu_threads
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) >= 1:
        return int(env["OMP_NUM_THREADS"])
    if cores is not None:
        return len(cores)
    return max(1, available_cpus() // num_ranks)


OPENBLAS_THREAD_TIMEOUT = "4"
"""A worker's OpenBLAS threads spin 2^4 cycles, not OpenBLAS's default 2^28 (~70 ms), before
they sleep. numpy's OpenBLAS starts OMP_NUM_THREADS - 1 threads when torch imports numpy, and
each spins its timeout right away; no worker code calls numpy's BLAS (torch's products are
MKL's and oneDNN's on x86, tidal's own are C). Spinning, they took ~0.1 s of CPU from the
start-up's other processes: the demo model answered 1.23 s after the command against 1.29 s
(medians of 9, interleaved, the 2-vCPU Zen 4 EPYC, 2026-12-04)."""


def worker_env(base: dict[str, str], threads: int, ranks_here: int = 1) -> dict[str, str]:
    """`base` plus one rank's thread count (for torch's and numba's pools), the library
    path that gives numba torch's OpenMP runtime (when torch's libgomp is found) and
    OpenBLAS's short spin (`OPENBLAS_THREAD_TIMEOUT`; a value in `base` wins). When the
    `ranks_here` ranks on this machine have more threads in all than it has cores, idle
    threads sleep at once (PASSIVE, unless `base` sets a policy): spinning threads that
    outnumber the cores wait at every barrier for a partner that is not running."""
    env = dict(base)
    env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    if threads * ranks_here > available_cpus():
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return with_shared_openmp(env)


def with_shared_openmp(env: dict[str, str]) -> dict[str, str]:
    """`env` with `shared_openmp_dir` first on its LD_LIBRARY_PATH (unchanged when torch's
    libgomp is not found). The loader reads the variable when a process starts."""
    shared = shared_openmp_dir()
    if shared is None:
        return env
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return {**env, "LD_LIBRARY_PATH": os.pathsep.join(
        [str(shared)] + [p for p in paths if p != str(shared)])}


def torch_libgomp() -> Path | None:
    """torch's bundled libgomp (torch/lib/libgomp.so.1), found without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "lib" / "libgomp.so.1"
        if candidate.is_file():
            return candidate.resolve()
    return None


def shared_openmp_dir() -> Path | None:
    """A folder holding `NUMBA_LIBGOMP_NAME` as a link to torch's libgomp (made once per
    torch install under tidal's cache folder, atomically); None where torch bundles none (its
    CUDA or macOS builds may not) or the link cannot be made."""
    target = torch_libgomp()
    if target is None:
        return None
    folder = Path(cache_dir()) / "openmp" / hashlib.sha256(str(target).encode()).hexdigest()[:16]
    link = folder / NUMBA_LIBGOMP_NAME
    try:
        if link.is_symlink() and link.resolve() == target:
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            temporary = Path(scratch) / NUMBA_LIBGOMP_NAME
            temporary.symlink_to(target)
            os.replace(temporary, link)  # atomic: concurrent ranks see old or new, never none
    except OSError:
        return None
    return folder
