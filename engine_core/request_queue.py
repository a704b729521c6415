"""Waiting queues: a small interface with a first-come-first-served and a priority version.

Preemption is "prepend back to the queue": fcfs puts the victim at the front (it resumes before
any newer arrival); priority pushes it into the heap, where (priority, arrival) decides.
"""

from __future__ import annotations

import abc
import heapq
from collections import deque
from typing import Iterable, Iterator

from .request import Request


class RequestQueue(abc.ABC):
    """Requests waiting for admission, in the order the scheduler should try them."""

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abc.abstractmethod
    def prepend(self, request: Request) -> None:
        """Put back a preempted request (front under fcfs, by key under priority)."""

    @abc.abstractmethod
    def peek(self) -> Request:
        """The next request to admit (IndexError when empty)."""

    @abc.abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request (IndexError when empty)."""

    @abc.abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None:
        """Drop these requests (those not queued are ignored)."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many requests wait."""

    def remove(self, request: Request) -> None:
        """Drop one request (ignored if not queued)."""
        self.remove_many((request,))

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a deque."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def priority_key(request: Request) -> tuple[int, float, int]:
    """Lower priority value first, then earlier arrival, then earlier add()."""
    return (request.priority, request.arrival_time, request.arrival_seq)


class PriorityRequestQueue(RequestQueue):
    """A binary heap on (priority, arrival_time, arrival_seq)."""

    def __init__(self) -> None:
        # heap entries: (priority, arrival_time, arrival_seq, request); arrival_seq is unique
        # per request, so two entries never compare their Request objects.
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._heap = [e for e in self._heap if id(e[3]) not in drop]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for `SchedulerConfig.scheduling_policy`."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
