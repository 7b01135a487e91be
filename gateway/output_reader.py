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
import secrets
import time

import redis.asyncio as aioredis

from gateway.errors import Unavailable
from nightjar.messages import MessageError, OutputChunk
from nightjar.service_util import REDIS_LOST_ERRORS, SlotNode

log = logging.getLogger("gateway")


RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


class OutputReader:
    """Handlers only wait on their queue, never on a redis-py call: a gRPC handler cancelled
    while inside a redis-py read can lose the cancellation and hang (seen with grpcio 1.85 +
    redis-py 8 on Python 3.11).

    A Redis error does not end the streams: the reader keeps its cursors and retries with backoff
    for up to ``retry_s`` (each request's own deadline still applies in its handler), so a stream
    survives a Redis restart with AOF or a failover. Whether Redis came back with its data is told
    by a mark (``Keys.data_mark``: a random id set once, no TTL): after every error the reader
    reads it again, and a Redis without the mark it knew has lost the output streams, so every
    stream fails UNAVAILABLE at once instead of waiting for entries that will never come. Entries
    lost in between (AOF's last second after a crash, a replica behind its primary) show as a gap
    in the token indices, which the handler answers with UNAVAILABLE too, never with a hole.
    """

    def __init__(self, url_client: aioredis.Redis, reader: aioredis.Redis | None, block_ms: int, *,
                 data_mark_key: str, retry_s: float = 10.0, pin: SlotNode | None = None) -> None:
        self._control = url_client  # reads the data mark
        self._reader = reader  # single-connection client: its id is the one to unblock
        self._unblocker = url_client  # sends CLIENT UNBLOCK, on the reader's node
        # Redis Cluster: the reader and the unblocker are clients of the node that owns the
        # stack's slot, asked for again after every error (a failover moves the slot).
        self._pin = pin
        self._block_ms = block_ms
        self._mark_key = data_mark_key
        self._mark: bytes | None = None  # the data mark of the Redis the cursors belong to
        self._retry_s = retry_s  # how long streams wait out Redis errors before they fail
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
                self._unblocking = asyncio.ensure_future(self._unblocker.client_unblock(self._reader_id))
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

    def _fail_all(self, exc: BaseException) -> None:
        for _stream, (_last, queue) in list(self._streams.items()):
            queue.put_nowait(exc)
        self._streams.clear()

    async def _check_data(self) -> None:
        """Adopt Redis's data mark (setting one if it has none); a mark other than the one the
        cursors were read under means the output streams are gone: fail them all now."""
        mark = await self._control.get(self._mark_key)
        if self._mark is not None and mark != self._mark:
            log.error("Redis came back without its data (mark %s, was %s): failing %d streams",
                      mark, self._mark, len(self._streams))
            self._fail_all(Unavailable("Redis lost the request's output (it restarted without persistence); "
                                       "retry the request"))
        if mark is None:
            await self._control.set(self._mark_key, secrets.token_hex(8), nx=True)
            mark = await self._control.get(self._mark_key)
        self._mark = mark

    async def _run(self) -> None:
        failing_since: float | None = None  # when the current run of Redis errors began
        delay = RETRY_FIRST_S
        while not self._closed:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self._mark is None or failing_since is not None:
                    await self._check_data()
                    if failing_since is not None:
                        log.info("Redis answers again after %.1fs; %d streams continue", time.monotonic() - failing_since,
                                 len(self._streams))
                    failing_since, delay = None, RETRY_FIRST_S
                    if not self._streams:
                        continue
                if self._reader_id is None:
                    if self._pin is not None:
                        self._reader, self._unblocker = await self._pin.clients()
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
            except REDIS_LOST_ERRORS as exc:  # wait it out, cursors kept, up to retry_s
                self._reader_id = None
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("reading output streams failed (%s: %s); retrying for up to %.0fs",
                                type(exc).__name__, exc, self._retry_s)
                if now - failing_since >= self._retry_s:
                    log.error("Redis failed for %.1fs: failing %d streams", now - failing_since, len(self._streams))
                    self._fail_all(exc)  # -> UNAVAILABLE
                    failing_since, delay = None, RETRY_FIRST_S
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            except Exception as exc:  # not Redis: a bug; every follower fails rather than hangs
                log.exception("output reader failed")
                self._reader_id = None
                self._fail_all(exc)
                await asyncio.sleep(RETRY_FIRST_S)
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
