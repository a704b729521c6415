"""How many CPU threads each worker rank runs, on which cores, and how its idle threads wait.

The worker's intra-op threads are OpenMP threads (torch's bundled libgomp; the numba decode
kernel runs on a second OpenMP runtime, the system's libgomp). Three choices, made here once
for every rank and handed to it through its environment before it imports torch:

- **Thread count** (`--cpu-threads`): by default every core this process may use, shared
  among the ranks. The engine core and the frontends sleep in `poll` while a step runs, so
  leaving them a core of their own (the old default) halved the worker's compute on a
  2-core machine.
- **Wait policy**: OpenMP's default keeps a thread spinning for ~300,000 iterations after
  each parallel region. Two runtimes in one process (torch's and numba's) then spin against
  each other, and a thread preempted by any other process (a busy neighbour, the engine
  core, the HTTP server) leaves its partner spinning at the next barrier for a whole
  scheduler time slice. `PASSIVE` makes idle threads sleep at once.
- **Affinity** (`--cpu-affinity`, vLLM's `VLLM_CPU_OMP_THREADS_BIND` syntax): optional
  core lists, one per rank separated by `|` (`0-3|4-7`); a rank then runs only there and
  its thread count defaults to its list's length.

An explicit `--cpu-threads` wins over `OMP_NUM_THREADS` in the environment, which wins over
the default; an `OMP_WAIT_POLICY` already in the environment is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"
"""OpenMP wait policy for the workers unless OMP_WAIT_POLICY is set (see the module text)."""


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


def worker_env(base: dict[str, str], threads: int) -> dict[str, str]:
    """`base` plus one rank's thread count (for torch's and numba's pools) and, unless `base`
    has one, the wait policy."""
    env = dict(base)
    env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return env
