"""`--distributed-executor-backend ray`: TP=2 (or PP=2) with one rank on each node of a
two-node Ray cluster (`ray.cluster_utils.Cluster`, one CPU per node, so the placement group
must put the two rank bundles on different nodes).

1. Greedy tokens equal transformers' with a 7-block KV cache that forces preemptions: TP=2
   with async scheduling on, PP=2 with it off (the CPU default). The other two cells of the
   matrix are not engine starts of their own (each costs ~8 s of a suite at its 10-minute
   limit): async scheduling is the engine core's loop, the same whatever executor runs the
   plans; the executor sees only how many plans are in flight, and these two cells give it
   two (TP=2 async, PP=2 sync), test 2 below one (TP=2 sync). The mp executor's tests run
   PP=2, PP=2 x TP=2 and DP=2 with async on and off.
2. A rank's actor killed mid-stream: the core replaces both ranks (new actors, a new
   placement group) and every stream ends with a fault-free run's tokens, greedy and seeded;
   then the second node removed mid-stream, past --max-worker-restarts: every request ends
   with an error that names the dead actor, the core exits non-zero, and no actor,
   placement group or worker process is left (the node is added back for later tests).

One cluster for the module (about 8 s to start on a 2-core machine). Skipped without ray
(`pip install -e ".[ray]"`); deselect with `-m "not ray"`.
"""

from __future__ import annotations

import os
import random
import re

import pytest

ray = pytest.importorskip("ray")

import zmq  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from process_tree import is_worker  # noqa: E402
from test_daemon import Client, Daemon, _alive  # noqa: E402
from test_llm import assert_greedy_equal, hf_greedy, wait_until  # noqa: E402
from tidal.engine_core.ray_executor import ACTOR_NAMESPACE  # noqa: E402
from tidal.frontend.llm import LLM  # noqa: E402
from tidal.ipc.frontend_messages import EngineDead, FinishReason
from tidal.ipc.messages import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 10
FAULT_MAX_TOKENS = 60  # streams long enough that a kill after 3 tokens lands mid-stream
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray", startup_timeout=180)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each; this process and the daemons it starts join it."""
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, object_store_memory=80 << 20, include_dashboard=False))
    c.add_node(num_cpus=1, object_store_memory=80 << 20)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", c.address)
        ray.init(address=c.address, logging_level="WARNING")
        c.wait_for_nodes()
        yield c
        ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """8 prompts of 3 to 61 tokens: with 10 new tokens each, 7 KV blocks of 16 cannot hold
    the longest three at once."""
    rng = random.Random(14)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 17, 25, 33, 40, 50, 61)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, MAX_TOKENS)


def core_placement(daemon_pid: int) -> list[dict]:
    """The placement groups of the engine core `daemon_pid`, as Ray's table lists them."""
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith(f"tidal-{daemon_pid}-")]


def core_actors(daemon_pid: int) -> list[str]:
    """Names of the live rank actors of the engine core `daemon_pid`."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"tidal-{daemon_pid}-"))


def cluster_worker_pids(cluster: Cluster) -> list[int]:
    """Live `tidal.workers.proc` processes descended from this cluster's raylets."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    roots = {p.process.pid for node in cluster.list_all_nodes()
             for p in node.all_processes.get("raylet", [])}

    def under_cluster(pid: int) -> bool:
        while pid > 1:
            if pid in roots:
                return True
            pid = parents.get(pid, 0)
        return False

    return [pid for pid in parents if is_worker(pid) and under_cluster(pid) and _alive(pid)]


# ---------------------------------------------------------------------------------------------
# 1. the same tokens as transformers


@pytest.mark.timeout(300)
def test_tp2_across_two_nodes_tiny_kv_cache_async_greedy_equals_transformers(
        cluster, tiny_llama, prompts, reference):
    with LLM(tiny_llama, num_gpu_blocks_override=8, max_model_len=112, async_scheduling=True,
             **RAY) as llm:
        [pg] = core_placement(llm.daemon_pid)
        assert pg["state"] == "CREATED" and len(set(pg["bundles_to_node_id"].values())) == 2
        assert len(core_actors(llm.daemon_pid)) == 2
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, reference)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0
        daemon_pid = llm.daemon_pid
    wait_until(lambda: not core_actors(daemon_pid), 20, "the rank actors to go")
    assert all(pg["state"] == "REMOVED" for pg in core_placement(daemon_pid))


@pytest.mark.timeout(300)
def test_pp2_across_two_nodes_tiny_kv_cache_greedy_equals_transformers(
        cluster, tiny_llama, prompts, reference):
    """Two pipeline stages, one per node: hidden states cross between the nodes; async
    scheduling off (the CPU default)."""
    pp = dict(RAY, tensor_parallel_size=1, pipeline_parallel_size=2)
    with LLM(tiny_llama, num_gpu_blocks_override=8, max_model_len=112, **pp) as llm:
        [pg] = core_placement(llm.daemon_pid)
        assert len(set(pg["bundles_to_node_id"].values())) == 2
        assert_greedy_equal(llm.generate(prompts, GREEDY, use_tqdm=False), reference)
        assert llm.get_stats().num_preemptions > 0


# ---------------------------------------------------------------------------------------------
# 2. a killed actor: healed once, then final, and nothing left behind


def submit(client: Client, prefix: str, prompts) -> list[str]:
    """Each prompt twice, greedy and seeded at temperature 1; their request ids."""
    ids = []
    for i, p in enumerate(prompts):
        client.add(f"{prefix}-g{i}", p, max_tokens=FAULT_MAX_TOKENS, ignore_eos=True)
        client.add(f"{prefix}-s{i}", p, max_tokens=FAULT_MAX_TOKENS, ignore_eos=True,
                   temperature=1.0, seed=1000 + i)
        ids += [f"{prefix}-g{i}", f"{prefix}-s{i}"]
    return ids


def run(client: Client, prefix: str, prompts, fault=None) -> dict[str, tuple]:
    """Submit, apply `fault()` once every stream has 3 tokens (none finished), wait for all;
    (tokens, finish reason) by request id without the prefix."""
    ids = submit(client, prefix, prompts)
    if fault is not None:
        client.recv_until(lambda m: all(len(client.tokens[r]) >= 3 for r in ids), 60)
        assert all(len(client.tokens[r]) < FAULT_MAX_TOKENS for r in ids), "finished too soon"
        fault()
    client.wait_finished(ids, timeout=120)
    return {r[len(prefix):]: (client.tokens[r], client.finish[r]) for r in ids}


def kill_actor(name: str) -> None:
    ray.kill(ray.get_actor(name, namespace=ACTOR_NAMESPACE))


@pytest.mark.timeout(300)
def test_killed_actor_is_replaced_then_a_lost_node_is_final_with_a_clear_error_no_orphans(
        cluster, tiny_llama, tmp_path, prompts):
    ctx = zmq.Context()
    second_node = cluster.list_all_nodes()[1]
    d = Daemon(tiny_llama, str(tmp_path / "core.log"), "--tensor-parallel-size", "2",
               "--distributed-executor-backend", "ray", "--max-worker-restarts", "1")
    try:
        client = Client(ctx, d.address, "ray-healing")
        client.hello(timeout=180)
        clean = run(client, "clean", prompts[:3])

        first = core_actors(d.proc.pid)
        assert run(client, "kill", prompts[:3], lambda: kill_actor(first[1])) == clean, \
            d.log_text()
        assert client.stats().num_worker_restarts == 1
        assert re.search(r"worker rank 1 \(pid \d+ on node [\d.]+\): its Ray actor died "
                         r"\(The actor is dead because it was killed by `ray.kill`.\)"
                         r".*replacing the workers \(restart 1 of at most 1", d.log_text())
        second = core_actors(d.proc.pid)
        assert len(second) == 2 and not set(second) & set(first)

        workers = cluster_worker_pids(cluster)
        assert len(workers) == 2
        final = run(client, "final", prompts[:3], lambda: cluster.remove_node(second_node))
        assert {finish for _, finish in final.values()} == {FinishReason.ERROR}
        errors = {client.errors[f"final{r}"] for r in final}
        dead = r"worker rank \d \(pid \d+ on node [\d.]+\): its Ray actor died \("
        assert all(re.search(dead, e) and "--max-worker-restarts" in e for e in errors), errors
        client.recv_until(lambda m: isinstance(m, EngineDead), 10)
        assert d.wait(timeout=30) != 0
        wait_until(lambda: not core_actors(d.proc.pid), 20, "the rank actors to go")
        assert all(pg["state"] == "REMOVED" for pg in core_placement(d.proc.pid))
        wait_until(lambda: not any(_alive(pid) for pid in workers), 20,
                   "the worker processes to exit")
        client.close()
    finally:
        d.stop()
        ctx.destroy(linger=0)
        if second_node not in cluster.list_all_nodes():
            cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
            cluster.wait_for_nodes()


@pytest.mark.timeout(120)
def test_more_ranks_than_the_cluster_holds_is_refused_at_once(cluster, tiny_llama):
    """-tp 4 on two one-CPU nodes: the engine core does not wait for room that will never
    come; start-up fails saying what the cluster has."""
    with pytest.raises(RuntimeError, match=r"can hold 2 of the 4 rank\(s\) of \{'CPU': 1.0\}"):
        LLM(tiny_llama, **{**RAY, "tensor_parallel_size": 4})
