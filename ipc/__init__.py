"""Everything that crosses a process boundary: message types, their encoding, sockets."""

from .frontend_messages import *  # noqa: F401,F403
from .messages import *  # noqa: F401,F403
from .worker_messages import *  # noqa: F401,F403
