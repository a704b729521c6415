"""Start and stop a private engine-core daemon for one owner (`LLM(model)`, `AsyncLLM`,
`tidal serve MODEL`, the data-parallel router for each of its cores).

    python -m tidal.engine_core.daemon --engine-config <the EngineConfig as msgspec JSON>
        --listen <new private address> --lifeline-fd <read end of this process's lifeline pipe>

(With `data_parallel_size` > 1 in the config that process is the data-parallel router.)

A `ChildProcess` (supervisor.py): its own process group, so a Ctrl-C in the terminal reaches
the owner, which then stops the daemon in order; the caller's session; a lifeline, so it never
outlives its owner: when the owner dies without closing it, SIGKILL included, the daemon reads
end-of-file, stops as on SIGTERM (its workers with it) and is SIGKILLed if still there 15 s
later (`ipc/lifeline.py`). Its stderr is echoed line by line (unless `echo=False`) and the last
lines are kept, to be quoted when it fails. Stopping: SIGTERM, wait `stop_timeout` seconds,
then SIGKILL the daemon's whole process group (the daemon and any worker it left behind).
"""

from __future__ import annotations

import logging

from .config import EngineConfig, encode_engine_config
from .supervisor import ChildProcess
from ..ipc.transport import new_private_address

logger = logging.getLogger(__name__)


class DaemonProcess(ChildProcess):
    """A private `tidal core` subprocess listening on `address` (default: a fresh private
    one). Start it again at the same address through a `Supervisor` whose `start` makes a
    new one."""

    def __init__(self, config: EngineConfig, *, address: str | None = None,
                 echo: bool = True, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`extra_args`: daemon flags (--frontend-timeout, --log-level); `env`: the daemon's
        environment (None: this process's)."""
        self.config = config
        self.address = address or new_private_address()
        super().__init__(["-m", "tidal.engine_core.daemon",
                          "--engine-config", encode_engine_config(config),
                          "--listen", self.address, *(extra_args or [])],
                         name="engine core", echo=echo, env=env)
        logger.info("started engine core (pid %d) on %s", self.pid, self.address)
