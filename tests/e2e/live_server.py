"""Run `tidal serve` / `tidal core` as subprocesses for end-to-end tests (every wait bounded)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# small, fast engine settings for a tiny CPU model
ENGINE_FLAGS = ["--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A tidal subprocess in its own session, its output in a temporary file."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tidal-e2e-", suffix=".log")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.frontend.cli", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole session; returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


class LiveServer(Proc):
    """`tidal serve ARGS --port P` on 127.0.0.1; `start()` waits for /health. An `api_key`
    goes in $TIDAL_API_KEY, as a deployment should give it (never on a command line)."""

    def __init__(self, args: list[str], api_key: str | None = None, port: int | None = None):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        super().__init__(["serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
                          "--disable-uvicorn-access-log"],
                         env={"TIDAL_API_KEY": api_key or ""})

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, **kwargs)

    def start(self, timeout: float = 150.0) -> "LiveServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"tidal serve exited early:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        out = self.output()
        self.stop()
        raise RuntimeError(f"tidal serve not healthy within {timeout} s:\n{out[-4000:]}")


def scrape(server: LiveServer, timeout: float = 10) -> tuple[dict, str]:
    """({metric sample name: value summed over labels}, the answering server index)."""
    r = httpx.get(server.base_url + "/metrics", timeout=timeout)
    assert r.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if "finished_reason" in sample.labels:  # also per finish reason
                key = f"{sample.name}/{sample.labels['finished_reason']}"
                values[key] = values.get(key, 0.0) + sample.value
    return values, r.headers["x-tidal-server"]
