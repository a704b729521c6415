"""`tidal bench chaos`: its traffic plan, its verdict, and one short soak of a real server
whose workers are killed and stopped (the soak must end with nothing lost or mismatched, an
idle engine and no orphan)."""

import random
import subprocess
import sys

import pytest

from tidal.frontend.bench.chaos import ChaosConfig, Outcome, plan_requests, report


def test_plan_is_poisson_over_the_duration_with_every_kind_and_a_calm_start():
    cfg = ChaosConfig(model=None, duration_s=200, request_rate=5, calm_fraction=0.25)
    plan = plan_requests(cfg, random.Random(0))
    assert 900 < len(plan) < 1100
    assert all(0 <= o.start < 200 for o in plan)
    assert {o.kind for o in plan} == {"greedy", "greedy-stream", "disconnect", "bad-body"}
    assert all(o.during_faults == (o.start >= 50) for o in plan)


def _result(statuses, idle=None):
    plan = [Outcome("greedy", 0, float(i), status=s, latency_s=0.1) for i, s in
            enumerate(statuses)]
    return {"plan": plan, "faults": [(1.0, "worker-kill pid 7")], "soak_s": 10.0,
            "idle": idle or {"running": 0, "waiting": 0, "kv_usage": 0, "restarts": 1},
            "rss_start": {}, "rss_end": {}}


def test_report_passes_only_with_nothing_lost_mismatched_leaked_or_orphaned():
    cfg = ChaosConfig(model=None)
    text, status = report(cfg, _result(["ok", "refused", "error", "disconnected"]), [])
    assert status == 0 and "lost:           0" in text and "worker-kill 1" in text
    assert report(cfg, _result(["ok", "lost"]), [])[1] == 1
    assert report(cfg, _result(["ok", "mismatched"]), [])[1] == 1
    assert report(cfg, _result(["ok"]), [4242])[1] == 1
    assert report(cfg, _result(["ok", "cut"]), [])[1] == 1  # no HTTP process was killed
    with_http_kill = _result(["ok", "cut"])
    with_http_kill["faults"].append((2.0, "http-kill pid 8"))
    assert report(cfg, with_http_kill, [])[1] == 0  # its own connections break, nothing else
    leaked = {"running": 0, "waiting": 0, "kv_usage": 0.1}
    assert report(cfg, _result(["ok"], leaked), [])[1] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_soak_with_worker_faults_loses_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tidal.frontend.cli", "bench", "chaos", "--duration", "8",
         "--request-rate", "3", "--fault-interval", "3", "--calm", "0.25", "--max-tokens", "8",
         "--worker-timeout", "2", "--api-server-count", "1",
         "--faults", "worker-kill,worker-stop", "--log", str(tmp_path / "serve.log")],
        capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr + (tmp_path / "serve.log").read_text()
    assert "lost:           0" in out.stdout and "orphans:        0" in out.stdout
    assert "faults injected: worker-" in out.stdout
