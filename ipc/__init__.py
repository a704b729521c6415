"""Everything that crosses a process boundary: message types (`messages`,
`frontend_messages`, `worker_messages`), their encoding and sockets (`transport`).

Nothing is re-exported here: each side imports the module of the boundary it speaks, and
`import tidal.ipc.paths` (all that `kernels/` may take) stays free of msgspec and the
message modules."""
