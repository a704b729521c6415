"""Issue 38 item 5: /metrics carries vLLM's names beside tidal's, so a vLLM Grafana
dashboard works unchanged, and no metric has two HELP lines (no `_created` series)."""

import collections
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from tidal.frontend.server.metrics import ServerMetrics
from tidal.ipc.frontend_messages import SchedulerStats

VLLM_DASHBOARD = [  # the series vLLM's Grafana dashboard queries (old and new names)
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total",
]


def _page() -> str:
    metrics = ServerMetrics("m")
    metrics.observe_finished(SimpleNamespace(
        first_token_time=1.0, arrival_time=0.5, inter_token_latencies=[0.1, 0.2],
        finished_time=2.0, queue_time=0.1), "stop")
    return metrics.render(SchedulerStats(num_running=2, kv_cache_usage=0.25)).decode()


def test_both_names_and_one_help_line_each():
    page = _page()
    helps = collections.Counter(line.split()[2] for line in page.splitlines()
                                if line.startswith("# HELP"))
    assert [name for name, count in helps.items() if count > 1] == []
    assert "_created" not in page
    samples = {s.name: s.value for family in text_string_to_metric_families(page)
               for s in family.samples}
    for name in VLLM_DASHBOARD:
        assert name in samples, name
    assert samples["vllm:num_requests_running"] == samples["tidal:num_requests_running"] == 2
    assert samples["vllm:gpu_cache_usage_perc"] == samples["vllm:kv_cache_usage_perc"] == 0.25
    assert samples["vllm:time_per_output_token_seconds_count"] == 2


def test_speculative_decoding_counters_under_vllm_spec_decode_names():
    page = ServerMetrics("m").render(SchedulerStats(
        spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
        spec_accepted_per_pos=[9, 8, 5, 3])).decode()
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    for prefix in ("vllm:", "tidal:"):
        assert samples[prefix + "spec_decode_num_drafts_total", None] == 10
        assert samples[prefix + "spec_decode_num_draft_tokens_total", None] == 40
        assert samples[prefix + "spec_decode_num_accepted_tokens_total", None] == 25
        assert [samples[prefix + "spec_decode_num_accepted_tokens_per_pos_total", str(i)]
                for i in range(4)] == [9, 8, 5, 3]
