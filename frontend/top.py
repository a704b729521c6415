"""`tidal top [URL]`: the live page's view of the batch in a terminal, for a server reached
over SSH. It reads the server's `/ui/view` feed (frontend/server/ui.py) twice a second and
draws it with rich: the counters, the token budget and sequences of the last step, KV blocks,
the queue by priority, a strip of recent steps (one character a step: its tokens of the
budget; orange while a prefill chunk ran in it), the last step's requests, latency
percentiles, each engine core with -dp, and the engine core's latest warnings.
"""

from __future__ import annotations

import argparse
import os
import time

BLOCKS = " ▁▂▃▄▅▆▇█"
STRIP = 100
"""Steps in the strip."""


def add_top_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000",
                        help="the tidal server (default: http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: $TIDAL_API_KEY)")
    parser.add_argument("--interval", type=float, default=0.5, metavar="S",
                        help="seconds between two refreshes (default: 0.5)")
    parser.add_argument("--once", action="store_true",
                        help="print one snapshot and exit (for scripts and tests)")


class TopState:
    """What the screen shows, fed one snapshot at a time."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.last_step: dict[int, int] = {}
        self.snap: dict | None = None
        self.prev: dict | None = None
        self.rates = {"gen": 0.0, "prompt": 0.0, "steps": 0.0}

    def feed(self, snap: dict) -> None:
        for index, core in enumerate(snap.get("cores", [])):
            view = core.get("view") or {}
            seen = self.last_step.get(index, -1)
            new = [dict(s, core=index) for s in view.get("steps", []) if s["step_id"] > seen]
            self.steps += new
            if new:
                self.last_step[index] = new[-1]["step_id"]
        self.steps = self.steps[-STRIP:]
        if self.snap is not None:
            dt = snap["time"] - self.snap["time"]
            if dt > 0:
                now, before = snap["stats"], self.snap["stats"]
                self.rates = {"gen": (now["generation_tokens"] - before["generation_tokens"]) / dt,
                              "prompt": (now["prompt_tokens"] - before["prompt_tokens"]) / dt,
                              "steps": (now["num_steps"] - before["num_steps"]) / dt}
        self.snap = snap


def render(state: TopState, url: str):
    """The screen, as a rich renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    snap = state.snap
    if snap is None:
        return Text(f"connecting to {url} …")
    s = snap["stats"]
    views = [c["view"] for c in snap["cores"] if c.get("view")]
    budget = views[0]["max_num_batched_tokens"] if views else 0
    max_seqs = sum(v["max_num_seqs"] for v in views)
    blocks = sum(v["num_kv_blocks"] for v in views)
    used = sum(v["kv_blocks_used"] for v in views)
    cached = sum(v["kv_blocks_cached"] for v in views)
    last = state.steps[-1] if state.steps else None
    waiting: dict[str, int] = {}
    for v in views:
        for prio, n in (v.get("waiting_by_priority") or {}).items():
            waiting[prio] = waiting.get(prio, 0) + n

    head = Table.grid(padding=(0, 3))
    head.add_row(
        f"[b]{snap.get('model', '')}[/b] at {url}",
        f"running [b]{s['num_running']}[/b]/{max_seqs}",
        f"waiting [b]{s['num_waiting']}[/b]" + (" (" + ", ".join(
            f"prio {p}: {n}" for p, n in sorted(waiting.items(), key=lambda x: int(x[0])))
            + ")" if waiting else ""),
        f"budget [b]{last['num_tokens'] if last else 0}[/b]/{budget}",
        f"KV used [b]{used}[/b] cached {cached} free {max(0, blocks - used - cached)}",
    )
    hits = (f"{100 * s['prefix_cache_hits'] / s['prefix_cache_queries']:.1f}%"
            if s.get("prefix_cache_queries") else "–")
    lat = snap.get("latency", {})
    fmt = lambda d, q: f"{1000 * d[q]:.0f}" if d.get("n") else "–"  # noqa: E731
    head.add_row(
        f"generated [b]{state.rates['gen']:.1f}[/b] tok/s, prompt {state.rates['prompt']:.0f}"
        f" tok/s, {state.rates['steps']:.0f} steps/s",
        f"prefix hits {hits}", f"preemptions {s.get('num_preemptions', 0)}",
        f"TTFT p50/p90 {fmt(lat.get('ttft', {}), 'p50')}/{fmt(lat.get('ttft', {}), 'p90')} ms",
        f"ITL p50/p90 {fmt(lat.get('itl', {}), 'p50')}/{fmt(lat.get('itl', {}), 'p90')} ms")

    strip = Text()
    for step in state.steps:
        level = min(len(BLOCKS) - 1, round((len(BLOCKS) - 1)
                                           * (step["num_tokens"] / (budget or 1)) ** 0.5))
        style = ("red" if step.get("preempted") else
                 "yellow" if any(r["prefill"] for r in step["requests"]) else "blue")
        strip.append(BLOCKS[max(1, level)], style=style)
    parts = [head, Panel(strip, title="steps (height: tokens of the budget; yellow: a prefill "
                                      "chunk ran; red: preempted)", title_align="left")]
    if last is not None:
        detail = Table("request", "kind", "tokens", box=None, padding=(0, 2))
        for r in last["requests"][:12]:
            detail.add_row(r["req_id"][-16:], "prefill" if r["prefill"] else "decode",
                           str(r["num_tokens"]))
        more = len(last["requests"]) - 12
        parts.append(Panel(detail, title=f"step {last['step_id']}: "
                           f"{1000 * last['seconds']:.1f} ms"
                           + (f" (+{more} more)" if more > 0 else ""), title_align="left"))
    if len(snap["cores"]) > 1:
        cores = Table("core", "running", "waiting", "KV used", "steps", box=None,
                      padding=(0, 2))
        for i, core in enumerate(snap["cores"]):
            cs = core["stats"]
            cores.add_row(str(i), str(cs["num_running"]), str(cs["num_waiting"]),
                          f"{100 * cs['kv_cache_usage']:.0f}%", str(cs["num_steps"]))
        parts.append(Panel(cores, title="engine cores", title_align="left"))
    warnings = [w for v in views for w in v.get("warnings", [])][-5:]
    if warnings:
        parts.append(Panel("\n".join(warnings), title="warnings", title_align="left",
                           style="yellow"))
    return Group(*parts)


def run_top(ns: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    key = ns.api_key or os.environ.get("TIDAL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = ns.url.rstrip("/")
    state = TopState()
    console = Console()
    with httpx.Client(base_url=url, headers=headers, timeout=5.0) as client:
        def poll() -> str | None:
            try:
                since = max(state.last_step.values(), default=0) if len(state.last_step) == 1 else 0
                resp = client.get("/ui/view", params={"since": since})
            except httpx.HTTPError as e:
                return f"cannot reach {url}: {e}"
            if resp.status_code != 200:
                try:
                    return f"{url}: {resp.status_code} {resp.json()['error']['message']}"
                except Exception:
                    return f"{url}: HTTP {resp.status_code}"
            state.feed(resp.json())
            return None

        if ns.once:
            error = poll() or (time.sleep(ns.interval), poll())[1]
            if error:
                console.print(f"tidal top: {error}", style="red")
                return 1
            console.print(render(state, url))
            return 0
        with Live(render(state, url), console=console, refresh_per_second=4,
                  screen=False) as live:
            try:
                while True:
                    error = poll()
                    live.update(render(state, url) if error is None else
                                f"[red]{error}[/red] (retrying)")
                    time.sleep(ns.interval)
            except KeyboardInterrupt:
                return 0
