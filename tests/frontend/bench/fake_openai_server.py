"""A minimal OpenAI-compatible streaming server for unit tests of the benchmark client.

Only the benchmark's client layer is under test here (the live tests use `tidal serve`). It
streams one chunk per token with a small delay, reports `usage`, answers 503 beyond
`max_in_flight` concurrent requests, and exposes tidal-named Prometheus metrics.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServerState:
    def __init__(self, max_in_flight: int | None, token_delay_s: float):
        self.max_in_flight = max_in_flight
        self.token_delay_s = token_delay_s
        self.in_flight = 0
        self.num_requests = 0
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def metrics_text(self) -> str:
        with self.lock:
            running, done = self.in_flight, self.num_requests
        return "\n".join([
            f'tidal:num_requests_running{{model_name="fake"}} {running}',
            'tidal:num_requests_waiting{model_name="fake"} 0',
            f'tidal:kv_cache_usage_perc{{model_name="fake"}} {min(1.0, running / 4)}',
            f'tidal:prefix_cache_queries_total{{model_name="fake"}} {100 * done}',
            f'tidal:prefix_cache_hits_total{{model_name="fake"}} {25 * done}',
            f'tidal:num_preemptions_total{{model_name="fake"}} {done // 2}',
        ]) + "\n"


def _handler(state: FakeServerState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # body ends when the connection closes

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: str, content_type="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake"}]}))
            elif self.path == "/metrics":
                self._send(200, state.metrics_text(), "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.bodies.append(body)
                busy = state.max_in_flight is not None and state.in_flight >= state.max_in_flight
                if not busy:
                    state.in_flight += 1
            if busy:
                self._send(503, json.dumps({"error": {"message": "busy", "code": 503}}))
                return
            try:
                self._stream(body)
            finally:
                with state.lock:
                    state.in_flight -= 1

        def _stream(self, body: dict):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            num_tokens = body["max_tokens"]
            for i in range(num_tokens):
                time.sleep(state.token_delay_s)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            # Counted before [DONE] is sent: a client may scrape /metrics the moment it reads
            # [DONE], before this thread returns (CI once saw 7 of 8 requests counted).
            with state.lock:
                state.num_requests += 1
            usage = {"prompt_tokens": 5, "completion_tokens": num_tokens,
                     "total_tokens": 5 + num_tokens}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # the default backlog of 5 refuses a burst of connections
    daemon_threads = True


class FakeOpenAIServer:
    """Context manager: a threaded server on a free loopback port; `.url`, `.state`."""

    def __init__(self, max_in_flight: int | None = None, token_delay_s: float = 0.002):
        self.state = FakeServerState(max_in_flight, token_delay_s)
        self.httpd = _Server(("127.0.0.1", 0), _handler(self.state))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
