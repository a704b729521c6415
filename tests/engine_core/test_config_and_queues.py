"""Config validation, engine flags, request states and the waiting queues."""

import argparse
import dataclasses
import json
import sys

import pytest
from sched_utils import make_request

from tidal.engine_core.args import add_engine_args, config_from_args, config_to_argv
from tidal.engine_core.config import (
    CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    decode_engine_config,
    encode_engine_config,
    read_model_max_len, resolve_max_model_len,
)
from tidal.engine_core.request import Request, RequestStatus
from tidal.engine_core.request_queue import create_request_queue
from tidal.ipc.frontend_messages import AddRequest, FinishReason
from tidal.ipc.messages import SamplingParams, pack_token_ids


def test_defaults_are_vllms():
    c = EngineConfig(ModelConfig("m"))
    assert (c.cache.block_size, c.cache.enable_prefix_caching, c.cache.gpu_memory_utilization) \
        == (16, True, 0.92)
    s = c.scheduler
    assert (s.enable_chunked_prefill, s.scheduling_policy, s.stream_interval,
            s.async_scheduling, s.max_num_batched_tokens, s.max_num_seqs) \
        == (True, "fcfs", 1, None, 2048, 256)
    # async scheduling unset: as vLLM, on for CUDA workers and off for CPU workers
    assert (s.async_on("cuda"), s.async_on("cuda:1"), s.async_on("cpu")) == (True, True, False)
    assert (c.pipeline_depth("cuda"), c.pipeline_depth("cpu")) == (2, 1)
    assert SchedulerConfig(async_scheduling=True).async_on("cpu")
    assert not SchedulerConfig(async_scheduling=False).async_on("cuda")


@pytest.mark.parametrize("make, field", [
    (lambda: SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=256),
     "max_num_batched_tokens"),
    (lambda: CacheConfig(block_size=24), "block_size"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (lambda: CacheConfig(kv_cache_dtype="int4"), "kv_cache_dtype"),
    (lambda: SchedulerConfig(scheduling_policy="lifo"), "scheduling_policy"),
    (lambda: SchedulerConfig(stream_interval=0), "stream_interval"),
    (lambda: SchedulerConfig(max_queue_delay=0.0), "max_queue_delay"),
    (lambda: SchedulerConfig(preemption_advice_quiet_s=0.0), "preemption_advice_quiet_s"),
    (lambda: ModelConfig("m", dtype="int8"), "dtype"),
    (lambda: ModelConfig(""), "model"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
    (lambda: ParallelConfig(attention_backend="flash"), "attention_backend"),
    (lambda: ParallelConfig(distributed_executor_backend="mpi"), "distributed_executor_backend"),
    (lambda: ParallelConfig(tensor_parallel_size=2, cpu_affinity="0|1",
                            distributed_executor_backend="ray"), "cpu_affinity"),
    (lambda: EngineConfig(ModelConfig("m", max_model_len=4096),
                          scheduler=SchedulerConfig(enable_chunked_prefill=False)),
     "max_num_batched_tokens"),
])
def test_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_config_is_frozen():
    c = EngineConfig(ModelConfig("m"))
    with pytest.raises(Exception):
        c.cache.block_size = 32


def _parser():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_flags_round_trip_through_argv():
    ns = _parser().parse_args([
        "some/model", "--max-model-len", "1024", "--block-size", "32", "--no-enable-prefix-caching",
        "--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024",
        "--no-enable-chunked-prefill", "--scheduling-policy", "priority", "--no-async-scheduling",
        "--max-num-queued-reqs", "100", "--max-num-queued-tokens", "32K", "--stream-interval",
        "4", "-tp", "2", "--device", "cpu",
        "--attention-backend", "torch", "--enforce-eager", "--dtype", "half",
        "--num-gpu-blocks-override", "64", "--served-model-name", "tiny",
        "--max-queue-delay", "1.5", "--step-cost-model", "/tmp/cost.json",
        "--distributed-executor-backend", "ray"])
    config = config_from_args(ns)
    assert config.parallel.distributed_executor_backend == "ray"
    assert config.scheduler.max_queue_delay == 1.5
    assert config.scheduler.step_cost_model == "/tmp/cost.json"
    assert config.cache.kv_cache_memory == 2 * 2**30 and config.model.dtype == "float16"
    assert config.scheduler.scheduling_policy == "priority"
    assert not config.scheduler.async_scheduling and config.parallel.tensor_parallel_size == 2
    assert config.cache.num_kv_blocks_override == 64
    assert config.scheduler.max_num_queued_tokens == 32 * 1024
    assert config_from_args(_parser().parse_args(config_to_argv(config))) == config
    default = EngineConfig(ModelConfig("m"))
    assert config_from_args(_parser().parse_args(config_to_argv(default))) == default
    assert decode_engine_config(encode_engine_config(config)) == config  # what -pp sets too
    assert config_from_args(_parser().parse_args(["m", "-pp", "2"])).pipeline_depth("cpu") == 2
    assert config_from_args(_parser().parse_args(
        ["m", "-pp", "2", "--async-scheduling"])).pipeline_depth("cpu") == 3


def test_every_config_field_is_a_flag_whose_help_is_its_docstring():
    """One source of truth: each field of the four config sections has a flag (MODEL for
    `model`), and the flag's --help text is the field's docstring plus its default."""
    from tidal.engine_core.args import FLAGS, field_docs

    flags = {(f.section, f.field): f for group in FLAGS.values() for f in group}
    helps = {a.dest: a.help for a in _parser()._actions}
    for section in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig):
        docs = field_docs(section)
        for field in dataclasses.fields(section):
            assert field.name in docs, f"{section.__name__}.{field.name} has no docstring"
            if (section, field.name) == (ModelConfig, "model"):
                continue
            flag = flags[(section, field.name)]  # KeyError: a field without a flag
            assert helps[flag.dest].replace("%%", "%").startswith(docs[field.name])
    assert "(default: 256)" in helps["max_num_seqs"]
    assert "off for CPU workers" in helps["async_scheduling"]


def test_engine_config_from_json_is_checked_field_by_field():
    """The config a frontend hands its private daemon is validated again on arrival."""
    text = encode_engine_config(EngineConfig(ModelConfig("m")))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        decode_engine_config(text.replace('"pipeline_parallel_size":1',
                                          '"pipeline_parallel_size":0'))
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_engine_config(text[:-1])


@pytest.mark.parametrize("text,value", [("8192", 8192), ("32k", 32_000), ("32K", 32_768),
                                        ("1.5m", 1_500_000), ("2M", 2 * 2**20)])
def test_max_num_queued_tokens_takes_vllm_counts(text, value):
    assert _parser().parse_args(["--max-num-queued-tokens", text]).max_num_queued_tokens == value


@pytest.mark.parametrize("text", ["abc", "1x", "", "k", "1.5K", "-3"])
def test_max_num_queued_tokens_refuses_what_is_not_a_count(text):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-queued-tokens", text])


def test_model_flag_errors():
    with pytest.raises(ValueError, match="model"):
        config_from_args(_parser().parse_args([]))
    assert config_from_args(_parser().parse_args(["--model", "x"])).model.model == "x"


def test_model_max_len_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    assert read_model_max_len(str(tmp_path)) == 4096
    config = EngineConfig(ModelConfig(str(tmp_path), max_model_len=1000))
    assert resolve_max_model_len(config) == 1000
    assert resolve_max_model_len(EngineConfig(ModelConfig(str(tmp_path)))) == 4096
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_max_model_len(EngineConfig(ModelConfig(str(tmp_path), max_model_len=5000)))
    with pytest.raises(ValueError, match="model"):
        read_model_max_len(str(tmp_path / "missing"))


def test_engine_core_config_does_not_import_torch():
    import subprocess
    code = ("import sys; import tidal.engine_core.scheduler, tidal.engine_core.args;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_request_from_add_and_states():
    msg = AddRequest("r1", pack_token_ids([1, 2, 3]), SamplingParams(max_tokens=5),
                     eos_token_id=2, priority=3, arrival_time=1.5, cache_salt="s")
    req = Request.from_add(msg, "client")
    assert req.prompt_token_ids == [1, 2, 3] and req.num_tokens == 3
    assert (req.client_id, req.priority, req.eos_token_id, req.cache_salt) == ("client", 3, 2, "s")
    assert req.status == RequestStatus.WAITING and not req.status.is_finished()
    assert RequestStatus.FINISHED_LENGTH.is_finished()
    assert RequestStatus.FINISHED_ABORTED.finish_reason == FinishReason.ABORT
    assert RequestStatus.PREEMPTED.finish_reason is None


def test_fcfs_queue():
    q = create_request_queue("fcfs")
    reqs = [make_request(i, 4) for i in range(4)]
    for r in reqs[:3]:
        q.add(r)
    q.prepend(reqs[3])
    assert [r.req_id for r in q] == ["3", "0", "1", "2"] and q.peek() is reqs[3]
    q.remove(reqs[0])
    assert q.pop() is reqs[3] and len(q) == 2


def test_priority_queue():
    q = create_request_queue("priority")
    specs = [(2, 0.0), (0, 5.0), (0, 1.0), (1, 0.0), (0, 1.0)]
    reqs = []
    for i, (prio, t) in enumerate(specs):
        r = make_request(i, 4, priority=prio, arrival_time=t)
        r.arrival_seq = i
        reqs.append(r)
        q.add(r)
    assert [r.req_id for r in q] == ["2", "4", "1", "3", "0"]
    q.remove(reqs[4])
    q.prepend(reqs[4])  # a preempted request goes back by its key
    assert [q.pop().req_id for _ in range(5)] == ["2", "4", "1", "3", "0"]
    assert not q
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")
