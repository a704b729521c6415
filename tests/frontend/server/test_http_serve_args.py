"""`tidal serve` flags: engine flags and server flags on one parser, validated early."""

import argparse
from types import SimpleNamespace

import pytest

from tidal.engine_core.supervisor import Supervisor
from tidal.frontend.server.serve import (
    EXIT_NOT_STARTED, _api_key, _check_args, _hold_metrics_dir, _remove_metrics_dir_if_last,
    _MAX_RESTARTS, _RESTART_WINDOW_S, _ProcessTree, add_serve_args, bind_socket,
)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_engine_flags_coexist():
    ns = parse("some/model", "--max-num-queued-reqs", "3", "--stream-interval", "4",
               "--served-model-name", "m", "--api-server-count", "2", "--api-key", "k")
    assert ns.model_tag == "some/model" and ns.max_num_queued_reqs == 3
    assert ns.stream_interval == 4 and ns.served_model_name == ["m"]
    assert (ns.api_server_count, ns.api_key, ns.host, ns.port) == (2, "k", "127.0.0.1", 8000)
    assert ns.engine is None
    assert ns.max_request_body_bytes == 16 * 2**20
    assert parse("--max-request-body-bytes", "1MiB").max_request_body_bytes == 2**20
    attach = parse("--engine", "ipc:///tmp/x.sock", "--engine-key-file", "keys")
    assert attach.engine == "ipc:///tmp/x.sock" and attach.engine_key_file == "keys"


def test_api_key_comes_from_the_environment_unless_given_and_then_warns(monkeypatch,
                                                                         caplog):
    """$TIDAL_API_KEY keeps the key off every command line; --api-key wins over it, with a
    warning that the command line shows it to every local user."""
    monkeypatch.setenv("TIDAL_API_KEY", "from-env")
    assert _api_key(parse()) == "from-env" and not caplog.records
    assert _api_key(parse("--api-key", "from-argv")) == "from-argv"
    assert "TIDAL_API_KEY" in caplog.text and "from-argv" not in caplog.text
    monkeypatch.setenv("TIDAL_API_KEY", "")
    assert _api_key(parse()) is None


@pytest.mark.parametrize("argv,word", [
    (["--api-server-count", "0"], "api-server-count"),
    (["--max-num-queued-reqs", "0"], "max-num-queued-reqs"),
    (["--max-num-queued-tokens", "0"], "max-num-queued-tokens"),
    (["--port", "70000"], "port"),
    (["--frontend-timeout", "0"], "frontend-timeout"),
    (["--engine", "ipc:///tmp/x.sock", "--frontend-timeout", "3"], "tidal core"),
    (["--max-request-body-bytes", "0"], "max-request-body-bytes"),
])
def test_bad_server_flags_are_value_errors(argv, word):
    with pytest.raises(ValueError, match=word):
        _check_args(parse(*argv))


def test_bind_socket_on_a_free_port():
    sock = bind_socket("127.0.0.1", 0)
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
    finally:
        sock.close()


class _ExitedProcess:
    """An HTTP process that has ended, as `_HttpProcess` shows one to its Supervisor."""

    def __init__(self, exitcode):
        self.proc = SimpleNamespace(exitcode=exitcode, pid=4242)

    def alive(self) -> bool:
        return self.proc.exitcode is None

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def failure_message(self, what: str) -> str:
        return f"{what} (exit status {self.proc.exitcode})"


def test_a_dead_http_process_is_restarted_but_not_forever():
    """Killed: started again under its index, its admission slot zeroed; a 6th death within
    a minute, or a process that never started, stops the server instead."""
    tree = _ProcessTree(parse("--api-server-count", "2"))
    tree._spawn_args = (None, None, [3, 5])  # spec, socket, admission slots
    spawned = []

    def server(index: int, exitcode) -> Supervisor:
        supervisor = Supervisor(f"HTTP server tidal-http-{index}",
                                lambda: spawned.append(index) or _ExitedProcess(-9),
                                _MAX_RESTARTS, window_s=_RESTART_WINDOW_S)
        supervisor.child = _ExitedProcess(exitcode)
        return supervisor

    tree.servers = [server(0, -9), server(1, None)]
    for _ in range(5):
        assert tree._restart_server(0)
    assert spawned == [0] * 5 and tree._spawn_args[2] == [0, 5]
    assert not tree._restart_server(0)
    tree.servers[1].child = _ExitedProcess(EXIT_NOT_STARTED)
    assert not tree._restart_server(1)


def test_the_last_http_process_out_removes_the_metrics_folder(tmp_path, monkeypatch):
    """Supervisor SIGKILLed: each HTTP process holds a shared lock on the Prometheus
    multiprocess folder while it lives; as it ends it drops it, and only the last one out
    (no lock left but its own probe) removes the folder, with every process's files."""
    folder = tmp_path / "tidal-prometheus-x"
    folder.mkdir()
    (folder / "counter_4242.db").write_bytes(b"")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    first, second = _hold_metrics_dir(), _hold_metrics_dir()
    _remove_metrics_dir_if_last(first)
    assert (folder / "counter_4242.db").exists()  # the second still serves
    _remove_metrics_dir_if_last(second)
    assert not folder.exists()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    assert _hold_metrics_dir() is None  # one HTTP process: no folder
