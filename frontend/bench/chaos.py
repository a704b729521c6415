"""`tidal bench chaos`: a bounded soak of a live `tidal serve` while its processes are killed.

    tidal bench chaos [MODEL] [--duration 600] [--request-rate 4] [--fault-interval 5]
        [--faults worker-kill,worker-stop,core-kill,core-stop,http-kill] [--api-server-count 2]
        [--worker-timeout 3] [--calm 0.2] [--serve-args "..."]

It starts `tidal serve MODEL` itself (so it knows the process tree), then:

1. reference: every prompt of a fixed pool, greedy, non-streaming, before any fault;
2. soak: Poisson arrivals for `--duration` seconds, each a pool prompt, streaming or not,
   some disconnecting after their first chunk, some with a bad body (which must get a 4xx).
   The first `--calm` of the duration injects no fault (the baseline latency); after it, every
   `--fault-interval` seconds one fault from `--faults`, chosen at random:

       worker-kill   SIGKILL a worker rank         (the core replaces its workers)
       worker-stop   SIGSTOP a worker rank         (hung: past --worker-timeout, the same)
       core-kill     SIGKILL the engine core       (tidal serve restarts it, if it can)
       core-stop     SIGSTOP the engine core       (silent past --frontend-timeout: tidal serve
                                                    kills it and restarts it, the same)
       http-kill     SIGKILL one HTTP process      (the others' streams must go on)

3. idle: once every request is answered, the server's /metrics must show nothing running,
   nothing waiting and no KV block in use; then SIGTERM, and no process of the tree may be
   left (orphans).

Every request is classified: `ok` (a complete answer), `error` (an answer that says it
failed: HTTP 5xx, or a stream's error event / finish reason `error`), `refused` (the 4xx a
bad body must get), `disconnected` (the client left on purpose), `cut` (its connection
broke: expected only for the connections of an HTTP process that was killed) or `lost` (no
final answer: a stream that stopped with no finish reason and no error, or nothing within
`--request-timeout`). `mismatched` counts ok greedy answers whose text
differs from the reference. The report ends with the RSS of each process at the start of the
soak and at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ...ipc.lifeline import lifeline_fd

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The sky is blue because",
    "List three colours:", "import numpy as np\n", "Q: What is 7 times 8?\nA:", "Dear Sir,",
    "In 1492, Columbus", "The quick brown fox", "SELECT * FROM", "Water boils at",
    "My favourite food is", "The opposite of hot is", "To be or not to be", "Hello, my name is",
]
FAULTS = ("worker-kill", "worker-stop", "core-kill", "core-stop", "http-kill")


@dataclass
class ChaosConfig:
    """What one soak does (every field is a flag of `tidal bench chaos`)."""

    model: str | None
    duration_s: float = 600.0
    request_rate: float = 4.0
    fault_interval_s: float = 5.0
    faults: tuple[str, ...] = ("worker-kill", "worker-stop", "http-kill")
    calm_fraction: float = 0.2
    max_tokens: int = 32
    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.1
    bad_body_fraction: float = 0.05
    api_server_count: int = 2
    worker_timeout_s: float = 3.0
    kv_cache_memory: str = "256MiB"  # the server's --kv-cache-memory (see add_chaos_args)
    request_timeout_s: float = 120.0
    seed: int = 0
    serve_args: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """One request of the soak."""

    kind: str  # greedy | greedy-stream | disconnect | bad-body
    prompt: int
    start: float  # seconds since the soak began
    status: str = "lost"  # ok | error | refused | disconnected | lost
    text: str = ""
    latency_s: float = 0.0
    detail: str = ""
    during_faults: bool = False


# -- the process tree ----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_tree(root: int) -> dict[str, list[int]]:
    """The live processes under `root` by role: core, worker, http (other: the rest)."""
    roles: dict[str, list[int]] = {"core": [], "worker": [], "http": [], "other": []}
    stack = list(_children(root))
    while stack:
        pid = stack.pop()
        stack += _children(pid)
        if not _alive(pid):
            continue
        cmd = _cmdline(pid)
        if "tidal.workers.proc" in cmd:
            roles["worker"].append(pid)
        elif " core " in cmd or "engine_core.daemon" in cmd:
            roles["core"].append(pid)
        elif "multiprocessing" in cmd and "resource_tracker" not in cmd:
            roles["http"].append(pid)  # `tidal serve`'s spawned HTTP processes
        else:
            roles["other"].append(pid)
    return roles


def inject(fault: str, tree: dict[str, list[int]], rng: random.Random) -> str | None:
    """Apply one fault to a random process of its role; a description, or None if none."""
    role, sig = {"worker-kill": ("worker", signal.SIGKILL),
                 "worker-stop": ("worker", signal.SIGSTOP),
                 "core-kill": ("core", signal.SIGKILL),
                 "core-stop": ("core", signal.SIGSTOP),
                 "http-kill": ("http", signal.SIGKILL)}[fault]
    if not tree[role]:
        return None
    pid = rng.choice(tree[role])
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    return f"{fault} pid {pid}"


# -- the server ------------------------------------------------------------------------------


def start_server(cfg: ChaosConfig, port: int, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tidal.frontend.cli", "serve"]
    if cfg.model:
        cmd.append(cfg.model)
    cmd += ["--port", str(port), "--api-server-count", str(cfg.api_server_count),
            "--max-worker-restarts", "1000000", "--max-engine-restarts", "1000000",
            "--worker-timeout", str(cfg.worker_timeout_s),
            "--kv-cache-memory", cfg.kv_cache_memory, *cfg.serve_args]
    lifeline = lifeline_fd()  # the server stops with this process, SIGKILL included
    cmd += ["--lifeline-fd", str(lifeline)]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            pass_fds=(lifeline,))


async def wait_ready(client, base: str, timeout: float) -> str:
    """The served model's name, once /v1/models answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await client.get(f"{base}/v1/models", timeout=2)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.25)
    raise TimeoutError(f"the server at {base} did not answer /v1/models in {timeout:.0f} s")


# -- the traffic ------------------------------------------------------------------------------


def _body(model: str, prompt: str, cfg: ChaosConfig, stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens,
            "temperature": 0.0, "stream": stream}


def _no_answer(error: Exception) -> str:
    """`cut` when the connection broke (its HTTP process was killed, say: the answer cannot
    reach this client, whatever the engine does), `lost` when the server kept it open and
    never answered within the timeout."""
    import httpx

    return "lost" if isinstance(error, httpx.TimeoutException) else "cut"


async def complete(client, base: str, body: dict, timeout: float) -> tuple[str, str, str]:
    """(status, text, detail) of one non-streaming completion."""
    try:
        r = await client.post(f"{base}/v1/completions", json=body, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - no response
        return _no_answer(e), "", f"{type(e).__name__}: {e}"
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        if choice.get("finish_reason") in ("length", "stop"):
            return "ok", choice["text"], ""
        return "error", choice.get("text", ""), f"finish_reason {choice.get('finish_reason')}"
    if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
        return "refused", "", f"HTTP {r.status_code}"
    return "error", "", f"HTTP {r.status_code}: {r.text[:120]}"


async def stream(client, base: str, body: dict, timeout: float,
                 disconnect: bool) -> tuple[str, str, str]:
    """(status, text, detail) of one streamed completion; `disconnect`: leave after the
    first chunk."""
    text, finish, error = [], None, None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                return "error", "", f"HTTP {r.status_code}"
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))[:120]
                    continue
                choice = event["choices"][0]
                text.append(choice.get("text", ""))
                finish = choice.get("finish_reason") or finish
                if disconnect:
                    return "disconnected", "", ""
    except Exception as e:  # noqa: BLE001 - the connection was cut or timed out
        return _no_answer(e), "".join(text), f"{type(e).__name__}: {e}"
    if error is not None or finish == "error":
        return "error", "".join(text), error or "finish_reason error"
    if finish in ("length", "stop") and done:
        return "ok", "".join(text), ""
    return "lost", "".join(text), f"stream ended without an answer (finish {finish}, " \
                                  f"[DONE] {done})"


async def one_request(client, base, model, cfg, outcome: Outcome, t0: float) -> None:
    start = time.monotonic()
    prompt = PROMPTS[outcome.prompt]
    if outcome.kind == "bad-body":
        body = {"model": model, "prompt": prompt, "max_tokens": -5}
        status, text, detail = await complete(client, base, body, cfg.request_timeout_s)
        status = "refused" if status == "refused" else f"bad-body-{status}"
    elif outcome.kind == "greedy":
        status, text, detail = await complete(client, base, _body(model, prompt, cfg, False),
                                              cfg.request_timeout_s)
    else:
        status, text, detail = await stream(client, base, _body(model, prompt, cfg, True),
                                            cfg.request_timeout_s,
                                            outcome.kind == "disconnect")
    outcome.status, outcome.text, outcome.detail = status, text, detail
    outcome.latency_s = time.monotonic() - start


def plan_requests(cfg: ChaosConfig, rng: random.Random) -> list[Outcome]:
    """Poisson arrivals over the duration, each a random kind and pool prompt."""
    plan, t = [], 0.0
    while True:
        t += rng.expovariate(cfg.request_rate)
        if t >= cfg.duration_s:
            return plan
        u = rng.random()
        if u < cfg.bad_body_fraction:
            kind = "bad-body"
        elif u < cfg.bad_body_fraction + cfg.disconnect_fraction:
            kind = "disconnect"
        elif rng.random() < cfg.stream_fraction:
            kind = "greedy-stream"
        else:
            kind = "greedy"
        plan.append(Outcome(kind, rng.randrange(len(PROMPTS)), t,
                            during_faults=t >= cfg.calm_fraction * cfg.duration_s))


async def soak(cfg: ChaosConfig, server: subprocess.Popen, base: str, model: str,
               reference: list[str], rng: random.Random) -> dict:
    import httpx

    plan = plan_requests(cfg, rng)
    faults: list[tuple[float, str]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic()
        rss_start = {role: [(p, _rss_mb(p)) for p in pids]
                     for role, pids in process_tree(server.pid).items()}

        async def faulter():
            first = cfg.calm_fraction * cfg.duration_s
            await asyncio.sleep(first)
            while time.monotonic() - t0 < cfg.duration_s:
                done = inject(rng.choice(cfg.faults), process_tree(server.pid), rng)
                if done:
                    faults.append((time.monotonic() - t0, done))
                await asyncio.sleep(cfg.fault_interval_s)

        async def launch(outcome: Outcome):
            await asyncio.sleep(max(0.0, outcome.start - (time.monotonic() - t0)))
            await one_request(client, base, model, cfg, outcome, t0)

        fault_task = asyncio.create_task(faulter()) if cfg.faults else None
        await asyncio.gather(*(launch(o) for o in plan))
        if fault_task is not None:
            fault_task.cancel()
        soak_s = time.monotonic() - t0
        await asyncio.sleep(cfg.worker_timeout_s + 1)  # let a stopped worker be replaced
        idle = await idle_metrics(client, base)
        rss_end = {role: [(p, _rss_mb(p)) for p in pids]
                   for role, pids in process_tree(server.pid).items()}
    for o in plan:
        if o.status == "ok" and o.kind != "disconnect" and o.text != reference[o.prompt]:
            o.status, o.detail = "mismatched", f"{o.text!r} != {reference[o.prompt]!r}"
    return {"plan": plan, "faults": faults, "idle": idle, "rss_start": rss_start,
            "rss_end": rss_end, "soak_s": soak_s}


async def idle_metrics(client, base: str) -> dict:
    """running, waiting and KV usage from /metrics (any server process answers)."""
    wanted = {"tidal:num_requests_running": "running", "tidal:num_requests_waiting": "waiting",
              "tidal:kv_cache_usage_perc": "kv_usage", "tidal:worker_restarts_total": "restarts"}
    for _ in range(20):
        try:
            r = await client.get(f"{base}/metrics", timeout=5)
            values = {}
            for line in r.text.splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in wanted:
                    values[wanted[name]] = float(line.rsplit(" ", 1)[-1])
            if len(values) >= 3:
                return values
        except Exception:  # noqa: BLE001 - a restarting process; try again
            pass
        await asyncio.sleep(1)
    return {}


def stop_server(server: subprocess.Popen, seen: set[int], grace: float = 30.0) -> list[int]:
    """SIGTERM the server and wait; the pids of the tree still alive after (orphans)."""
    seen |= {p for pids in process_tree(server.pid).values() for p in pids}
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.2)
    orphans = sorted(p for p in seen if _alive(p))
    if server.poll() is None:
        orphans.append(server.pid)
    try:
        os.killpg(server.pid, signal.SIGKILL)  # clean up whatever the report names
    except ProcessLookupError:
        pass
    return orphans


def report(cfg: ChaosConfig, result: dict, orphans: list[int]) -> tuple[str, int]:
    """The printed report and the exit status (0 when nothing was lost or mismatched)."""
    plan: list[Outcome] = result["plan"]
    by_status: dict[str, int] = {}
    for o in plan:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    kinds: dict[str, int] = {}
    for _, f in result["faults"]:
        kinds[f.split()[0]] = kinds.get(f.split()[0], 0) + 1
    lost = by_status.get("lost", 0) + sum(v for k, v in by_status.items()
                                          if k.startswith("bad-body-"))
    if "http-kill" not in kinds:
        lost += by_status.get("cut", 0)  # nothing should have broken a connection
    mismatched = by_status.get("mismatched", 0)
    lines = [
        f"{'=' * 16} tidal bench chaos {'=' * 16}",
        f"duration {result['soak_s']:.0f} s, {len(plan)} requests at {cfg.request_rate:g}/s, "
        f"{cfg.api_server_count} HTTP processes, --worker-timeout {cfg.worker_timeout_s:g} s",
        "faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
                               or "none"),
        f"requests sent:  {len(plan)}",
        "answered:       " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())
                                       if k not in ("lost", "mismatched")),
        f"lost:           {by_status.get('lost', 0)}",
        f"mismatched:     {mismatched}",
    ]
    idle = result["idle"]
    lines.append(f"at idle:        running {idle.get('running', float('nan')):g}, waiting "
                 f"{idle.get('waiting', float('nan')):g}, KV usage "
                 f"{idle.get('kv_usage', float('nan')):g}, worker restarts "
                 f"{idle.get('restarts', float('nan')):g}")
    lines.append(f"orphans:        {len(orphans)}" + (f" {orphans}" if orphans else ""))
    for phase, during in (("without faults", False), ("with faults", True)):
        lat = sorted(o.latency_s for o in plan
                     if o.during_faults == during and o.status == "ok")
        if lat:
            p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            lines.append(f"latency {phase:15s} p50 {p50 * 1e3:7.0f} ms  p99 {p99 * 1e3:7.0f} ms "
                         f"({len(lat)} ok requests)")
    lines.append("RSS (MB) at the start of the soak -> at its end, per role:")
    for role in ("core", "worker", "http"):
        start = [round(m) for _, m in result["rss_start"].get(role, [])]
        end = [round(m) for _, m in result["rss_end"].get(role, [])]
        lines.append(f"  {role:7s} {start} -> {end}")
    problems = [o for o in plan if o.status in ("lost", "mismatched")
                or o.status.startswith("bad-body-")]
    for o in problems[:10]:
        lines.append(f"  {o.status} at {o.start:.1f} s ({o.kind}): {o.detail}")
    bad = lost + mismatched + len(orphans) + int(any(idle.get(k, 1) != 0 for k in
                                                     ("running", "waiting", "kv_usage")))
    return "\n".join(lines), 0 if bad == 0 else 1


def run_chaos(cfg: ChaosConfig, log_path: str) -> tuple[str, int]:
    """Start the server, soak it, stop it; the report and the exit status."""
    import httpx

    from ...ipc.transport import free_tcp_port

    rng = random.Random(cfg.seed)
    port = free_tcp_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(cfg, port, log_path)
    seen: set[int] = set()
    try:
        async def prepare():
            async with httpx.AsyncClient() as client:
                model = await wait_ready(client, base, 180)
                refs = []
                for prompt in PROMPTS:
                    status, text, detail = await complete(
                        client, base, _body(model, prompt, cfg, False), cfg.request_timeout_s)
                    if status != "ok":
                        raise RuntimeError(f"reference request failed: {status} {detail}")
                    refs.append(text)
                return model, refs

        model, reference = asyncio.run(prepare())
        seen |= {p for pids in process_tree(server.pid).values() for p in pids}
        result = asyncio.run(soak(cfg, server, base, model, reference, rng))
        seen |= {p for _, f in result["faults"] for p in [int(f.split()[-1])]}
    finally:
        orphans = stop_server(server, seen)
    return report(cfg, result, orphans)


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model folder for `tidal serve` (default: the bundled demo model)")
    p.add_argument("--duration", type=float, default=600.0, help="soak seconds (600)")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s (4)")
    p.add_argument("--fault-interval", type=float, default=5.0,
                   help="seconds between two faults (5)")
    p.add_argument("--faults", default="worker-kill,worker-stop,http-kill",
                   help=f"comma-separated, from {','.join(FAULTS)} "
                        "(default: worker-kill,worker-stop,http-kill)")
    p.add_argument("--calm", type=float, default=0.2,
                   help="fraction of the duration before the first fault (0.2)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (32)")
    p.add_argument("--api-server-count", type=int, default=2, help="HTTP processes (2)")
    p.add_argument("--worker-timeout", type=float, default=3.0,
                   help="the server's --worker-timeout: a stopped worker is replaced after it")
    p.add_argument("--kv-cache-memory", default="256MiB",
                   help="the server's --kv-cache-memory (256MiB): a worker makes its whole CPU "
                        "KV cache resident at start-up, and with 4 GiB that takes longer than a "
                        "short --worker-timeout allows a fresh worker's first steps")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a request may take before it counts as lost (120)")
    p.add_argument("--seed", type=int, default=0, help="traffic and fault seed (0)")
    p.add_argument("--serve-args", default="", help="more `tidal serve` flags, one string")
    p.add_argument("--log", default="chaos-serve.log", help="the server's log file")


def chaos_config_from_args(ns: argparse.Namespace) -> ChaosConfig:
    faults = tuple(f for f in ns.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    if not 0 <= ns.calm < 1:
        raise ValueError(f"--calm must be in [0, 1), got {ns.calm}")
    return ChaosConfig(model=ns.model, duration_s=ns.duration, request_rate=ns.request_rate,
                       fault_interval_s=ns.fault_interval, faults=faults,
                       calm_fraction=ns.calm, max_tokens=ns.max_tokens,
                       api_server_count=ns.api_server_count,
                       worker_timeout_s=ns.worker_timeout, kv_cache_memory=ns.kv_cache_memory,
                       request_timeout_s=ns.request_timeout, seed=ns.seed,
                       serve_args=ns.serve_args.split())
