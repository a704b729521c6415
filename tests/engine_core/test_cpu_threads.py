"""Worker threads, cores and wait policy (`engine_core/cpu_threads.py`): how `--cpu-threads`,
`--cpu-affinity` and the environment decide each rank's OpenMP setup."""

import ast
import os
import subprocess
import sys

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig
from tidal.engine_core.cpu_threads import (
    available_cpus,
    parse_cpu_affinity,
    parse_cpu_list,
    torch_libgomp,
    worker_env,
    worker_threads,
)


def test_cpu_lists_read_like_vllms_omp_threads_bind():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_affinity("0-1", 1) == [[0, 1]]
    assert parse_cpu_affinity("0-3|4-7", 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_cpu_affinity(None, 2) is None and parse_cpu_affinity("all", 1) is None


@pytest.mark.parametrize("text,ranks", [("0-x", 1), ("3-1", 1), ("0,0", 1), ("0-1|2-3", 1),
                                        ("0-1", 2)])
def test_bad_affinity_is_a_value_error_naming_the_field(text, ranks):
    with pytest.raises(ValueError, match="cpu_affinity"):
        ParallelConfig(cpu_affinity=text, tensor_parallel_size=ranks)


def test_thread_count_precedence():
    """Explicit --cpu-threads, then OMP_NUM_THREADS, then the rank's cores, then every core
    this process may use shared among the ranks."""
    assert worker_threads(3, [0, 1], 1, {"OMP_NUM_THREADS": "5"}) == 3
    assert worker_threads(None, [0, 1], 1, {"OMP_NUM_THREADS": "5"}) == 5
    assert worker_threads(None, [0, 1, 2], 1, {}) == 3
    assert worker_threads(None, None, 1, {}) == available_cpus()
    assert worker_threads(None, None, 10**6, {}) == 1
    with pytest.raises(ValueError, match="cpu_threads"):
        ParallelConfig(cpu_threads=0)


def test_worker_env_sets_threads_for_both_pools_and_keeps_the_users_wait_policy():
    env = worker_env({"PATH": "/bin"}, 2)
    assert env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "2"
    assert "OMP_WAIT_POLICY" not in env and env["PATH"] == "/bin"  # libgomp's default spin
    assert worker_env({"OMP_WAIT_POLICY": "PASSIVE"}, 1)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_workers_openblas_threads_sleep_at_once_unless_the_user_says_otherwise():
    """numpy's OpenBLAS threads would spin ~70 ms each right after torch imports numpy,
    taking the CPU from the start-up's other processes; no worker code calls numpy's BLAS."""
    assert worker_env({}, 2)["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert worker_env({"OPENBLAS_THREAD_TIMEOUT": "28"}, 2)["OPENBLAS_THREAD_TIMEOUT"] == "28"


def test_threads_that_outnumber_the_cores_sleep_at_once():
    cores = available_cpus()
    assert "OMP_WAIT_POLICY" not in worker_env({}, cores, ranks_here=1)
    assert worker_env({}, cores, ranks_here=2)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert worker_env({}, cores + 1)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert worker_env({"OMP_WAIT_POLICY": "ACTIVE"}, cores + 1)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_worker_environment_gives_numba_and_torch_one_openmp_runtime(tmp_path, monkeypatch):
    """Under worker_env a process that runs a torch GEMM and a parallel numba kernel maps
    exactly one libgomp, torch's (the two runtimes' spinning threads fought each other)."""
    if torch_libgomp() is None or not sys.platform.startswith("linux"):
        pytest.skip("torch bundles no libgomp here")
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    env = worker_env(dict(os.environ), 2)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0].startswith(str(tmp_path))
    script = (
        "import numpy as np, torch, numba\n"
        "@numba.njit(parallel=True)\n"
        "def total(a):\n"
        "    s = 0.0\n"
        "    for i in numba.prange(a.shape[0]):\n"
        "        s += a[i]\n"
        "    return s\n"
        "assert total(np.ones(1000)) == 1000.0 and torch.ones(64, 64).mm(torch.ones(64, 64))[0, 0] == 64\n"
        "print(numba.threading_layer())\n"
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    layer, mapped = out.stdout.splitlines()
    if layer != "omp":
        pytest.skip(f"numba runs its {layer} threading layer here, not OpenMP")
    assert ast.literal_eval(mapped) == [str(torch_libgomp())]


def test_each_rank_gets_its_own_cores_in_its_worker_config(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(
        tensor_parallel_size=2, cpu_affinity="0-2|3-4"))
    ranks = [config.worker_config(r, 64, "") for r in range(2)]
    assert [(w.cpu_cores, w.cpu_threads) for w in ranks] == [([0, 1, 2], 3), ([3, 4], 2)]
    plain = EngineConfig(ModelConfig("m")).worker_config(0, 64, "")
    assert plain.cpu_cores is None and plain.cpu_threads == available_cpus()
