"""The data-parallel router's decisions, without processes (issue 14, part 3):
least load, prefix affinity and its limit, a dead core's prefixes forgotten, the whole
server's statistics from the cores', `/metrics` per core, a request moved off a dead core,
and each core's share of the CPU threads and GPUs.
"""

from __future__ import annotations

import pytest

from tidal.engine_core.config import EngineConfig, ModelConfig, ParallelConfig
from tidal.engine_core.dp_cores import core_config, core_env, core_gpu_sets, visible_gpus
from tidal.engine_core.dp_placement import PREFIX_SLACK, WAITING_WEIGHT, Placement, merge_stats
from tidal.engine_core.dp_router import lost_output, resume_request
from tidal.frontend.server.metrics import ServerMetrics
from tidal.ipc.frontend_messages import AddRequest, FinishReason, SchedulerStats
from tidal.ipc.messages import SamplingParams, pack_token_ids, unpack_token_ids

BLOCK = 4


def placement(num_cores: int = 2) -> Placement:
    p = Placement(num_cores, BLOCK)
    for core in range(num_cores):
        p.mark_live(core)
    return p


def report(p: Placement, core: int, waiting: int = 0, running: int = 0, kv: float = 0.0):
    p.query_sent(core)
    p.report(core, SchedulerStats(num_waiting=waiting, num_running=running, kv_cache_usage=kv))


def prompt(start: int, length: int = 3 * BLOCK) -> list[int]:
    return list(range(start, start + length))


def test_least_loaded_core_by_waiting_then_running_then_kv_usage():
    p = placement(3)
    report(p, 0, waiting=1)  # 1 waiting outweighs 3 running
    report(p, 1, running=3)
    report(p, 2, running=3, kv=0.5)
    assert p.place(prompt(100)) == 1
    p = placement(2)
    report(p, 0, running=2, kv=0.9)
    report(p, 1, running=2, kv=0.1)
    assert p.place(prompt(100)) == 1  # equal scores: the emptier cache


def test_requests_sent_since_the_last_report_count_as_waiting():
    """Reports lag: two unrelated requests in a row go to different idle cores, and one
    sent after a query is still counted when that query's answer arrives."""
    p = placement(2)
    assert [p.place(prompt(100)), p.place(prompt(200))] == [0, 1]
    p.query_sent(0)
    assert p.place(prompt(300)) == 0  # sent after the query: its answer cannot include it
    p.report(0, SchedulerStats(num_waiting=1))  # covers the first request only
    assert p.loads[0].score() == 2 * WAITING_WEIGHT
    assert p.place(prompt(400)) == 1


def test_a_shared_prefix_goes_to_the_core_that_holds_it():
    p = placement(2)
    system = prompt(1000, 2 * BLOCK)
    first = p.place(system + prompt(7))
    report(p, first, running=1)  # now the busier core, by one running request
    assert p.place(system + prompt(50)) == first
    assert p.place(prompt(9000)) != first  # no shared prefix: the least loaded


def test_affinity_gives_way_when_the_holder_is_too_busy():
    p = placement(2)
    system = prompt(1000, 2 * BLOCK)
    holder = p.place(system + prompt(7))
    other = 1 - holder
    report(p, holder, waiting=1, running=PREFIX_SLACK + 1)
    report(p, other, waiting=1)
    assert p.place(system + prompt(50)) == other


def test_partial_blocks_and_salts_do_not_match():
    p = placement(2)
    short = prompt(1000, BLOCK - 1)  # no full block: nothing to remember
    assert p.block_hashes(short, None) == []
    holder = p.place(prompt(1000))
    report(p, holder, running=1)
    assert p.place(prompt(1000), cache_salt="tenant-b") != holder


def test_a_dead_core_gets_nothing_and_its_prefixes_are_forgotten():
    p = placement(2)
    system = prompt(1000, 2 * BLOCK)
    holder = p.place(system + prompt(7))
    p.mark_dead(holder)
    assert p.prefix_holder(p.block_hashes(system, None)) is None
    assert p.place(system + prompt(8)) == 1 - holder
    p.mark_dead(1 - holder)
    assert p.place(system) is None


def test_remembered_blocks_are_bounded():
    p = Placement(2, BLOCK, max_remembered_blocks=5)
    p.mark_live(0)
    for start in range(0, 400, 40):
        p.place(prompt(start))
    assert len(p._owner) == 5


def test_whole_server_stats_sum_the_cores_and_keep_each():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_kv_blocks=100,
                       generation_tokens=10, num_preemptions=1, est_queue_delay_s=3.0)
    b = SchedulerStats(num_running=1, kv_cache_usage=0.1, num_kv_blocks=300,
                       generation_tokens=5, est_queue_delay_s=0.5, est_s_per_prompt_token=0.01)
    total = merge_stats([a, b])
    assert (total.num_running, total.num_waiting, total.generation_tokens) == (3, 1, 15)
    assert total.num_kv_blocks == 400 and abs(total.kv_cache_usage - 80 / 400) < 1e-12
    assert (total.est_queue_delay_s, total.est_s_per_prompt_token) == (0.5, 0.01)
    assert total.cores == [a, b]


def test_metrics_label_each_engine_core_plus_the_total():
    total = merge_stats([SchedulerStats(num_running=2, num_preemptions=3),
                         SchedulerStats(num_running=1)])
    page = ServerMetrics("m").render(total).decode()
    assert 'tidal:num_requests_running{engine="0",model_name="m"} 2.0' in page
    assert 'tidal:num_requests_running{engine="1",model_name="m"} 1.0' in page
    assert 'tidal:num_requests_running{engine="total",model_name="m"} 3.0' in page
    assert 'tidal:num_preemptions_total{engine="total",model_name="m"} 3.0' in page
    single = ServerMetrics("m").render(SchedulerStats(num_running=2)).decode()
    assert 'tidal:num_requests_running{model_name="m"} 2.0' in single


def test_a_request_moves_off_a_dead_core_with_its_delivered_tokens():
    add = AddRequest("r1", pack_token_ids([5, 6, 7]),
                     SamplingParams(max_tokens=10, min_tokens=4, seed=3, prompt_logprobs=2),
                     eos_token_id=2, priority=1, cache_salt="s")
    moved = resume_request(add, bytearray(pack_token_ids([8, 9])))
    assert moved.req_id == "r1" and unpack_token_ids(moved.prompt_token_ids).tolist() == \
        [5, 6, 7, 8, 9]
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (8, 2)
    assert moved.sampling.seed == 3 and moved.sampling.prompt_logprobs is None
    assert (moved.priority, moved.cache_salt, moved.eos_token_id) == (1, "s", 2)
    assert resume_request(add, bytearray()) is add
    done = bytearray(pack_token_ids(list(range(20, 29)) + [2]))  # 10 tokens, EOS last
    assert resume_request(add, done) is None
    assert lost_output(add, done).finish_reason == FinishReason.STOP


def test_each_core_gets_a_share_of_the_cpu_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("tidal.engine_core.dp_cores.available_cpus", lambda: 8)
    config = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2,
                                                                    tensor_parallel_size=2))
    child = core_config(config)
    assert (child.parallel.data_parallel_size, child.parallel.cpu_threads) == (1, 2)
    given = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2,
                                                                   cpu_threads=3))
    assert core_config(given).parallel.cpu_threads == 3
    gguf = EngineConfig(ModelConfig("/m/x.gguf"), parallel=ParallelConfig(data_parallel_size=2))
    converted = core_config(gguf, "/cache/x-123").model  # converted once, by the router
    assert (converted.model, converted.name) == ("/cache/x-123", "/m/x.gguf")


def test_cores_whose_threads_outnumber_the_cpus_wait_passive(monkeypatch):
    """-dp 2 with OMP_NUM_THREADS=2 on 2 CPUs: four spinning threads on two cores would each
    wait at every barrier for a partner that is not running."""
    monkeypatch.setattr("tidal.engine_core.dp_cores.available_cpus", lambda: 2)
    dp2 = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2))
    assert core_env(dp2, {"OMP_NUM_THREADS": "2"}, None)["OMP_WAIT_POLICY"] == "PASSIVE"
    kept = core_env(dp2, {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, None)
    assert kept["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice wins
    assert "OMP_WAIT_POLICY" not in core_env(dp2, {}, None)  # a share each: one thread a core
    pinned = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(
        data_parallel_size=2, cpu_affinity="0-1"))
    assert "OMP_WAIT_POLICY" not in core_env(pinned, {"OMP_NUM_THREADS": "2"}, None)
    assert core_env(dp2, {}, "2,3")["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_each_core_gets_gpus_of_its_own_and_too_few_are_refused():
    dp2_tp2 = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2,
                                                                     tensor_parallel_size=2))
    assert core_gpu_sets(dp2_tp2, ["0", "1", "2", "3", "4"]) == ["0,1", "2,3"]
    assert core_gpu_sets(dp2_tp2, []) is None  # device auto without a GPU: the CPU
    with pytest.raises(ValueError, match="data_parallel_size 2 x tensor_parallel_size 2 "
                                         "needs 4 GPUs"):
        core_gpu_sets(dp2_tp2, ["0", "1"])
    cpu = EngineConfig(ModelConfig("m"), parallel=ParallelConfig(data_parallel_size=2,
                                                                 device="cpu"))
    assert core_gpu_sets(cpu, ["0"]) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
