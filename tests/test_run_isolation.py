"""A test run keeps to its own folders (issue 38 §6; tests/conftest.py sets them up): its ipc://
sockets in a runtime folder of the run's own, removed at the end, tidal's cache under a
temporary root instead of the user's home, and no process of the run outliving it."""

from __future__ import annotations

import os
import subprocess
import sys

from run_folders import RUN_RUNTIME_DIR, live_socket_owners
from real_models import real_model_cache

from tidal.ipc.paths import cache_dir
from tidal.ipc.transport import new_private_address, runtime_dir


def test_sockets_go_into_the_runs_own_runtime_folder():
    assert runtime_dir() == os.path.join(RUN_RUNTIME_DIR, "tidal")
    assert new_private_address("x").startswith(f"ipc://{RUN_RUNTIME_DIR}/tidal/x-{os.getpid()}-")
    # a process the tests start (a daemon, a worker) finds the same folder
    child = subprocess.run([sys.executable, "-c", "from tidal.ipc.transport import runtime_dir;"
                            "print(runtime_dir())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == runtime_dir()


def test_the_cache_is_under_a_temporary_root_not_the_home_folder():
    if "TIDAL_TEST_CACHE" not in os.environ:
        assert not real_model_cache().startswith(os.path.expanduser("~") + os.sep)
    assert cache_dir() == os.environ["TIDAL_CACHE_DIR"]
    assert not cache_dir().startswith(os.path.join(os.path.expanduser("~"), ".cache"))


def test_a_socket_whose_process_lives_on_is_found(tmp_path):
    """What pytest_sessionfinish checks for: a socket named for a live process is reported,
    one of a process that is gone (a SIGKILLed core's) is not."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"engine-{child.pid}-0123abcd.sock").touch()
        (tmp_path / "engine.sock").touch()  # a fixed name names no process
        assert live_socket_owners(str(tmp_path)) == {f"engine-{child.pid}-0123abcd.sock":
                                                     child.pid}
    finally:
        child.kill()
        child.wait()
    assert live_socket_owners(str(tmp_path)) == {}
