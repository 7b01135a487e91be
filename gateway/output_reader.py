"""OutputReader: one task follows every in-flight request's output stream with one XREAD.

It is the single owner of the read cursors: requests register a queue, the task reads all
registered streams in one blocking XREAD and hands each chunk to its request's queue. With
32 streams this is one Redis round trip per engine step instead of 32. A newly registered
stream interrupts the blocking read (CLIENT UNBLOCK on the reader's own connection) so its
first token is not held back by a read that did not know it.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from nightjar.messages import MessageError, OutputChunk

log = logging.getLogger("gateway")


class OutputReader:
    """Handlers only wait on their queue, never on a redis-py call: a gRPC handler cancelled
    while inside a redis-py read can lose the cancellation and hang (seen with grpcio 1.85 +
    redis-py 8 on Python 3.11).
    """

    def __init__(self, url_client: aioredis.Redis, reader: aioredis.Redis, block_ms: int) -> None:
        self._control = url_client  # sends CLIENT UNBLOCK
        self._reader = reader  # single-connection client: its id is the one to unblock
        self._block_ms = block_ms
        self._streams: dict[str, tuple[bytes, asyncio.Queue]] = {}  # stream -> (last id, queue)
        self._reading: frozenset[str] = frozenset()  # streams of the XREAD in flight
        self._in_read = False
        self._reader_id: int | None = None
        self._wake = asyncio.Event()
        self._unblocking: asyncio.Future | None = None  # the CLIENT UNBLOCK in flight, if any
        self._read_started: asyncio.Future | None = None  # resolved when the next XREAD is issued
        self._closed = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._read_started = asyncio.get_running_loop().create_future()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-output-reader")

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=2.0)

    async def register(self, stream: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[stream] = (b"0-0", queue)
        self._wake.set()
        for _ in range(50):  # until the read in flight includes the stream (or none is in flight)
            if not self._in_read or stream in self._reading or self._reader_id is None:
                break
            started = self._read_started
            # Registrations that arrive while an unblock is on its way share it: the reader
            # rebuilds its cursors after the read ends, so one interrupt takes in all of them.
            if self._unblocking is None or self._unblocking.done():
                self._unblocking = asyncio.ensure_future(self._control.client_unblock(self._reader_id))
            try:
                await asyncio.shield(self._unblocking)
            except Exception:  # Redis trouble: the reader reports it to every queue
                break
            # Wait for the next read rather than re-sending the unblock every millisecond; it is
            # re-sent only if that read still lacks the stream (the unblock overtook the XREAD).
            try:
                await asyncio.wait_for(asyncio.shield(started), 0.01)
            except TimeoutError:
                pass
        return queue

    def unregister(self, stream: str) -> None:
        self._streams.pop(stream, None)

    async def _run(self) -> None:
        while not self._closed:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self._reader_id is None:
                    self._reader_id = int(await self._reader.client_id())
                cursors = {s: last for s, (last, _q) in self._streams.items()}
                self._reading, self._in_read = frozenset(cursors), True
                started, self._read_started = self._read_started, asyncio.get_running_loop().create_future()
                if not started.done():
                    started.set_result(None)
                try:
                    reply = await self._reader.xread(cursors, block=self._block_ms, count=512)
                finally:
                    self._in_read = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis unreachable: every follower fails (-> UNAVAILABLE)
                self._reader_id = None
                for stream, (_last, queue) in list(self._streams.items()):
                    queue.put_nowait(exc)
                self._streams.clear()
                await asyncio.sleep(0.05)
                continue
            for name, entries in reply or ():
                stream = name.decode() if isinstance(name, bytes) else name
                held = self._streams.get(stream)
                if held is None:
                    continue
                last, queue = held
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        queue.put_nowait(OutputChunk.decode(fields[b"c"]))
                    except (KeyError, MessageError) as exc:
                        log.error("dropping a malformed output entry %s of %s: %s", entry_id, stream, exc)
                if stream in self._streams:
                    self._streams[stream] = (last, queue)
