"""Shared by the gateway tests that stand in for the worker: take the job the gateway queued."""

from __future__ import annotations

import asyncio
import time

from nightjar.keys import Keys
from nightjar.messages import Job


async def take_job(redis, keys: Keys, timeout_s: float = 5.0) -> Job:
    """The oldest job on the requests stream, removed from it (no scheduler in these rigs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = await redis.xrange(keys.requests)
        if entries:
            entry_id, fields = entries[0]
            await redis.xdel(keys.requests, entry_id)
            return Job.decode(fields[b"job"])
        await asyncio.sleep(0.02)
    raise AssertionError("no job was enqueued")
