"""Redis side of one request: enqueue its job, follow its output stream, cancel it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ResponseError

from gateway.errors import Unavailable
from gateway.output_reader import OutputReader
from nightjar import metrics as m
from nightjar.dispatch_lease import DirectDispatch
from nightjar.keys import Keys
from nightjar.messages import Cancel, Job, OutputChunk
from nightjar.service_util import write_and_publish

log = logging.getLogger("gateway")


class RequestQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, reader: OutputReader, *, cancel_ttl_s: float,
                 direct: DirectDispatch | None = None) -> None:
        self._redis = redis
        self._keys = keys
        self._reader = reader
        self._direct = direct  # None: every job goes through the scheduler
        self._cancel_ttl_ms = int(cancel_ttl_s * 1000)
        self._background: set[asyncio.Task] = set()
        self._forget: list[str] = []  # output streams of finished requests, deleted together

    async def enqueue(self, job: Job) -> None:
        """Into a leased worker's inbox (nightjar.dispatch_lease), else on the requests stream.

        No MAXLEN on the stream: trimming would silently drop queued requests; the cap is
        enforced at admission and the scheduler deletes each entry once it is dispatched.
        Shielded: see gateway/output_reader.py for why a handler never awaits redis-py directly."""
        raw = job.encode()
        try:
            if self._direct is None:
                await asyncio.shield(self._redis.xadd(self._keys.requests, {b"job": raw}))
                path = "queued"
            else:
                worker = await asyncio.shield(self._direct.enqueue(job.request_id, raw, job.enqueued_unix_ms))
                path = "queued" if worker is None else "direct"
        except ResponseError as exc:  # maxmemory with noeviction: Redis refuses writes rather than evict queues
            if not isinstance(exc, OutOfMemoryError) and "OOM" not in str(exc):
                raise
            log.error("Redis is full, a request was refused: %s", exc)
            raise Unavailable("the request queue (Redis) is full (maxmemory); retry shortly") from None
        m.DISPATCHES.labels(path=path).inc()

    async def outputs(self, request_id: str) -> AsyncIterator[list[OutputChunk]]:
        """Every chunk written to the request's output stream, in order, until a final one
        (read by the gateway's one OutputReader; see there why handlers wait on a queue).

        Yields every chunk already waiting as one batch: a handler that fell behind the engine
        sends them as one response instead of one gRPC message each (the messages, not the
        tokens, are what cost the gateway and the client CPU)."""
        stream = self._keys.output(request_id)
        queue = await self._reader.register(stream)
        failure: BaseException | None = None  # met while batching: raised after the chunks before it
        try:
            while True:
                item = failure if failure is not None else await queue.get()
                if isinstance(item, BaseException):
                    raise item
                batch = [item]
                while batch[-1].finish_reason is None and not queue.empty():
                    item = queue.get_nowait()
                    if isinstance(item, BaseException):
                        failure = item
                        break
                    batch.append(item)
                yield batch
                if batch[-1].finish_reason is not None:
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
        """The final chunk was read: the output stream is no longer needed.

        Streams that end together (a batch finishes in the same engine step) go in one DEL,
        sent once the handlers of this loop turn have all asked."""
        self._forget.append(self._keys.output(request_id))
        if len(self._forget) == 1:
            task = asyncio.get_running_loop().create_task(self._forget_all())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _forget_all(self) -> None:
        await asyncio.sleep(0.01)  # no one waits on it: let the streams ending in the same step join
        keys, self._forget = self._forget, []
        try:
            await self._redis.delete(*keys)
        except Exception as exc:  # the streams expire on their own (TTL set with the final chunk)
            log.warning("could not delete %d finished output streams: %s", len(keys), exc)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await write_and_publish(self._redis, lambda pipe: pipe.set(self._keys.cancel(request_id), reason,
                                                                        px=self._cancel_ttl_ms),
                                    self._keys.cancel_channel, Cancel(request_id, reason).encode())
        except Exception as exc:  # Redis down: the key check on re-dispatch cannot help either; log it
            log.warning("could not cancel %s: %s", request_id, exc)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
