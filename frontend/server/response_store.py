"""The Responses API's store: responses kept for `previous_response_id` and GET / DELETE.

    ResponseStore(max_size) .put(record) .get(id) .delete(id) -> bool

A bounded, in-memory LRU of `StoredResponse`s, one per HTTP process (`--responses-store-size`
entries; 0 keeps none: every id is then a 404). Reading
a response (GET, or continuing it with `previous_response_id`) makes it the most recently
used; past the bound the least recently used is dropped, and asking for it later is a 404,
as for an id never stored.

With `--api-server-count N > 1` each HTTP process keeps its own store and the kernel hands
each connection to any of them; so a response id carries the index of the process that made
it (`resp_<index>_<hex>`), and a request for an id made by another process is a 404 that says
so (`owner_index`) instead of a bare "not found". docs/responses.md says what to do.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_STORE_SIZE = 1024
"""Responses each HTTP process keeps (`--responses-store-size`)."""

_ID = re.compile(r"resp_(\d+)_[0-9a-f]+")


@dataclass
class StoredResponse:
    """One stored response: its JSON body and the conversation that continues it."""

    body: dict
    """The response object as answered (object "response")."""
    conversation: list[dict] = field(default_factory=list)
    """The chat messages of its input (without `instructions`, which a continuation does
    not inherit, as OpenAI's API) and then its output, in the chat template's form."""


def response_id(server_index: int, hex_id: str) -> str:
    """A response id that names the HTTP process that made it."""
    return f"resp_{server_index}_{hex_id}"


def owner_index(resp_id: str) -> int | None:
    """The index of the HTTP process that made `resp_id`, or None for an id not of ours."""
    match = _ID.fullmatch(resp_id)
    return int(match.group(1)) if match else None


class ResponseStore:
    """A bounded LRU of stored responses (per HTTP process)."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE):
        if max_size < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, record: StoredResponse) -> None:
        """Keep `record` as the most recently used; drop the least recently used beyond the
        bound."""
        if self.max_size == 0:
            return
        self._items[record.body["id"]] = record
        self._items.move_to_end(record.body["id"])
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, resp_id: str) -> StoredResponse | None:
        record = self._items.get(resp_id)
        if record is not None:
            self._items.move_to_end(resp_id)
        return record

    def delete(self, resp_id: str) -> bool:
        return self._items.pop(resp_id, None) is not None
