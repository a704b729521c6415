"""The run's own folders (issue 38 §6), set when this module is first imported (by
tests/conftest.py, before any test or subprocess asks): every process started from then on
(daemons, workers, `tidal serve`) inherits both. A module of its own, not conftest.py, so a
test can import it: several conftest.py files exist and `import conftest` finds whichever
pytest loaded under that name."""

import os
import tempfile

from process_tree import alive
from real_models import real_model_cache

# Each pytest-xdist worker imports this module and gets a runtime folder of its own.
RUN_RUNTIME_DIR = tempfile.mkdtemp(prefix="tidal-run-")  # mode 0700, as XDG requires
os.environ["XDG_RUNTIME_DIR"] = RUN_RUNTIME_DIR
os.environ.setdefault("TIDAL_CACHE_DIR", real_model_cache())


def live_socket_owners(folder: str) -> dict[str, int]:
    """{socket file: pid} for each socket in `folder` whose creator is still alive. tidal names
    them TAG-PID-RANDOM.sock (ipc/transport.new_private_address); a process SIGKILLed by a
    fault test leaves its files behind, which is no leak: the folder goes with the run."""
    owners = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        parts = name.rsplit("-", 2)
        if name.endswith(".sock") and len(parts) == 3 and parts[1].isdigit():
            pid = int(parts[1])
            if pid != os.getpid() and alive(pid):
                owners[name] = pid
    return owners
