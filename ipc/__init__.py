"""Everything that crosses a process boundary: message types, their encoding, sockets."""

from .messages import *  # noqa: F401,F403
