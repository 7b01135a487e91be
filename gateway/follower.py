"""Redis side of one request: enqueue its job, follow its output stream, cancel it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from gateway.output_reader import OutputReader
from nightjar.keys import Keys
from nightjar.messages import Cancel, Job, MessageError, OutputChunk

log = logging.getLogger("gateway")


class RequestQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, reader: OutputReader, *, cancel_ttl_s: float) -> None:
        self._redis = redis
        self._keys = keys
        self._reader = reader
        self._cancel_ttl_ms = int(cancel_ttl_s * 1000)
        self._background: set[asyncio.Task] = set()

    async def enqueue(self, job: Job) -> None:
        # No MAXLEN: trimming would silently drop queued requests; the cap is enforced at
        # admission and the scheduler deletes each entry once it is dispatched. Shielded:
        # see gateway/output_reader.py for why a handler never awaits a redis-py call directly.
        await asyncio.shield(self._redis.xadd(self._keys.requests, {b"job": job.encode()}))

    async def outputs(self, request_id: str) -> AsyncIterator[OutputChunk]:
        """Every chunk written to the request's output stream, in order, until a final one
        (read by the gateway's one OutputReader; see there why handlers wait on a queue)."""
        stream = self._keys.output(request_id)
        queue = await self._reader.register(stream)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._reader.unregister(stream)

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """Mark the request cancelled and tell the workers, without waiting.

        Runs as its own task because the caller is usually a handler being cancelled
        (client gone), which may not await anything any more.
        """
        task = asyncio.get_running_loop().create_task(self._cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget_soon(self, request_id: str) -> None:
        """The final chunk was read: the output stream is no longer needed."""
        task = asyncio.get_running_loop().create_task(self._redis.delete(self._keys.output(request_id)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._keys.cancel(request_id), reason, px=self._cancel_ttl_ms)
                pipe.publish(self._keys.cancel_channel, Cancel(request_id, reason).encode())
                await pipe.execute()
        except Exception as exc:  # Redis down: the key check on re-dispatch cannot help either; log it
            log.warning("could not cancel %s: %s", request_id, exc)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
