"""The gateway's table of in-flight requests and its admission limits.

One owner: every method runs on the gateway's event loop (gRPC handlers and the health task
share it), so the table needs no lock; nothing else holds request state. The stream limit is
an explicit semaphore, acquired without waiting: a full gateway answers RESOURCE_EXHAUSTED
at once rather than queueing invisibly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.errors import QueueFull, Unavailable


@dataclass
class InFlight:
    request_id: str
    admitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    enqueued: bool = False  # a job may exist at a worker (so leaving must cancel it)
    finished: bool = False


class AdmissionTable:
    def __init__(self, max_streams: int, max_queued: int, retry_after_ms: int,
                 recheck: Callable[[], Awaitable[bool]] | None = None) -> None:
        self._streams = asyncio.Semaphore(max_streams)
        self._max_queued = max_queued
        self._retry_after_ms = retry_after_ms
        self._entries: dict[str, InFlight] = {}
        self._queued = 0  # entries without a first token
        self.backlog = 0  # undispatched jobs in the requests stream (XLEN, polled by the health task)
        self.redis_ok = True  # last health poll reached Redis
        self._recheck = recheck  # asks Redis again before a request is refused for the poll's answer
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._entries)

    @property
    def queued(self) -> int:
        return self._queued

    def check_open(self) -> None:
        if self.draining:
            raise Unavailable("the gateway is draining (shutting down); retry on another instance")
        if not self.redis_ok:
            raise Unavailable("the request queue (Redis) is unreachable; retry shortly")

    async def admit(self, request_id: str) -> InFlight:
        if not self.redis_ok and not self.draining and self._recheck is not None:
            self.redis_ok = await self._recheck()
        self.check_open()
        waiting = max(self._queued, self.backlog)
        if self._streams.locked() or waiting >= self._max_queued:
            # Scale the hint with how far past the cap the queue is, so clients spread out.
            over = 1 + max(0, waiting - self._max_queued) / max(1, self._max_queued)
            raise QueueFull(
                f"queue full ({waiting} waiting, cap {self._max_queued}; {self.in_flight} streams in flight)",
                retry_after_ms=int(self._retry_after_ms * over),
            )
        assert request_id not in self._entries, "request ids are generated unique"
        await self._streams.acquire()  # never waits: locked() was checked just above, no await between
        entry = InFlight(request_id)
        self._entries[request_id] = entry
        self._queued += 1
        self.idle.clear()
        return entry

    def first_token(self, entry: InFlight) -> None:
        if entry.first_token_s is None:
            entry.first_token_s = time.perf_counter()
            self._queued -= 1

    def release(self, entry: InFlight) -> bool:
        """Free the entry's slot; False if it was already released."""
        if self._entries.pop(entry.request_id, None) is None:
            return False
        if entry.first_token_s is None:
            self._queued -= 1
        self._streams.release()
        if not self._entries:
            self.idle.set()
        return True
