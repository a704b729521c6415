"""Where each engine core of `-dp N` runs, decided before the data-parallel router starts
them (`dp_router.Router._start_cores`): its config (data parallelism 1, a share of the CPU
threads), its environment (its own GPUs; PASSIVE waiting when every core's threads together
outnumber the CPUs) and its GPU set. No IO but reading the environment and the GPU list.
"""

from __future__ import annotations

import dataclasses
import os

from .config import EngineConfig
from .cpu_threads import available_cpus, worker_threads


def core_config(config: EngineConfig, model_dir: str | None = None) -> EngineConfig:
    """One core's config: data parallelism 1; the model from `model_dir` (a GGUF file's
    converted folder) under the name users know; and on the CPU, unless threads were given
    (--cpu-threads, OMP_NUM_THREADS, --cpu-affinity), an equal share of the cores per core's
    ranks, so that N cores do not each run a thread per CPU core."""
    p, m = config.parallel, config.model
    threads = p.cpu_threads
    if threads is None and p.cpu_affinity is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, available_cpus() // (p.data_parallel_size * p.tensor_parallel_size))
    if model_dir is not None and model_dir != m.model:
        m = dataclasses.replace(m, model=model_dir, served_model_name=m.names)
    return dataclasses.replace(
        config, model=m,
        parallel=dataclasses.replace(p, data_parallel_size=1, cpu_threads=threads))


def core_env(config: EngineConfig, env: dict[str, str], gpu_set: str | None
             ) -> dict[str, str]:
    """One core's environment: `env`, its GPUs (`gpu_set`, CUDA_VISIBLE_DEVICES) and, when
    the threads of every core's ranks outnumber this machine's CPUs (a thread count the user
    gave, OMP_NUM_THREADS or --cpu-threads, with no --cpu-affinity), PASSIVE waiting unless
    the user chose a policy. A core sees only its own ranks (`cpu_threads.worker_env`), so
    this rule, for the N cores at once, can only be applied here."""
    out = dict(env)
    if gpu_set is not None:
        out["CUDA_VISIBLE_DEVICES"] = gpu_set
    p = config.parallel
    if p.cpu_affinity is None:
        threads = worker_threads(p.cpu_threads, None, p.world_size * p.data_parallel_size, env)
        if threads * p.world_size * p.data_parallel_size > available_cpus():
            out.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return out


def visible_gpus(env: dict[str, str]) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (without torch:
    that variable when set, else one per NVIDIA GPU the driver lists)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def core_gpu_sets(config: EngineConfig, gpus: list[str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each core: `tensor_parallel_size` GPUs of its own (core k
    gets the k-th group), since each core sizes its KV cache from a GPU's whole memory. None
    on the CPU (`--device cpu`, or `auto` with no GPU). ValueError naming
    data_parallel_size when there are fewer GPUs than cores × ranks."""
    p = config.parallel
    if p.device == "cpu" or (p.device == "auto" and not gpus):
        return None
    per_core, needed = p.tensor_parallel_size, p.tensor_parallel_size * p.data_parallel_size
    if len(gpus) < needed:
        raise ValueError(f"data_parallel_size {p.data_parallel_size} x tensor_parallel_size "
                         f"{per_core} needs {needed} GPUs, one per rank of every engine core; "
                         f"{len(gpus)} are visible")
    return [",".join(gpus[k * per_core:(k + 1) * per_core]) for k in range(p.data_parallel_size)]
